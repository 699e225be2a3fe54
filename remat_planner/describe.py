"""A plan in words: stage names a person can read, keep options and scan schemes as
sentences, and the plan as a text table (`Plan.summary`, `print(plan)`, the CLI).

Nothing here changes a plan or a number: it only says what the plan's fields mean.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Sequence

from .memory import run_chain
from .plan import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING, STORE, KeepRule, Plan,
                   ScanOption, ScanScheme, Segment, Store, parse_option)
from .units import DEFAULT_UNITS, Units, format_flops

# What a segment run with each keep option holds from its forward for its backward.
KEEP_WORDS = {
    STORE: "everything (no checkpoint)",
    NOTHING: "its inputs only (checkpoint)",
    DOTS_NO_BATCH: "inputs + projections (dots without batch dims)",
    DOTS_NARROW: "inputs + projections + attention's probs @ V",
    DOTS: "inputs + every dot output (attention scores too)",
}
# The same, short, for the sub-stages of a scanned layer.
SHORT_WORDS = {
    STORE: "keeps everything",
    NOTHING: "keeps its inputs only",
    DOTS_NO_BATCH: "keeps projections",
    DOTS_NARROW: "keeps projections and probs @ V",
    DOTS: "keeps dots",
}
# Primitives that move or reshape data: left out when naming code by what it computes.
_PLUMBING = {"broadcast_in_dim", "reshape", "convert_element_type", "stop_gradient", "squeeze",
             "slice", "expand_dims", "transpose", "copy", "copy_p", "pjit", "select_n", "lt",
             "gt", "le", "ge", "eq", "ne", "and", "or", "not", "iota", "concatenate",
             "dynamic_slice", "dynamic_update_slice", "pad", "rev"}
_UNNAMED = re.compile(r"^eqns\[(\d+):(\d+)\]$")


def keep_words(option: str, sub_stages: Sequence[str] = ()) -> str:
    """A keep option (or a scan scheme) in words; a name that is no option, as it is."""
    try:
        kind = parse_option(option)
    except ValueError:
        return option
    match kind:
        case ScanOption():
            return scan_words(option, sub_stages)
        case Store() | KeepRule():
            return KEEP_WORDS[kind.name]
    return option  # a kind without words here


def pretty_stage_name(name: str) -> str:
    """`GPT2/h_0[ln_1,attn]` -> `GPT2/h_0 (ln_1, attn)`; other names unchanged."""
    m = re.match(r"^(.*?)\[(.*)\]$", name)
    if m is None or _UNNAMED.match(name):
        return name
    head, tails = m.group(1), m.group(2).split(",")
    return f"{head} ({', '.join(tails)})" if head else ", ".join(tails)


def _computes(names: Sequence[str]) -> str:
    """What a run of unnamed equations computes, from its primitives."""
    counts = Counter(names)
    has = counts.__contains__
    if has("log") and (has("exp") or has("reduce_max") or has("logistic")) and (
            has("gather") or has("eq") or has("select_n") or has("dot_general")):
        return "softmax cross-entropy"
    if (has("integer_pow") or has("square") or has("mul")) and has("sub") and \
            has("reduce_sum") and not has("log") and not has("exp"):
        return "mean squared error"
    ops = [p for p, _ in counts.most_common() if p not in _PLUMBING] or list(counts)
    if has("reduce_sum") and has("div") and set(ops) <= {"reduce_sum", "div", "mul", "add"}:
        return "mean"
    return ", ".join(ops[:4]) + (" ..." if len(ops) > 4 else "")


def stage_label(name: str, program=None, is_last: bool = False,
                span: tuple[int, int] | None = None) -> str:
    """A stage's name for people. Module paths read as `GPT2/h_0 (ln_1, attn)`; code
    outside any Flax module (named `eqns[a:b]` by the planner) is named by what it
    computes, given the traced program: the last stage, which returns the scalar, is
    `loss (softmax cross-entropy)`, others `code outside any module: reduce_sum, log`.
    A named last stage holds the loss too: `GPT2 (ln_f, wte.attend) + loss (...)`."""
    m = _UNNAMED.match(name)
    if m is None:
        label = pretty_stage_name(name)
        if program is not None and span is not None and span[1] == len(program.eqns):
            # the last stage: its code outside any module is the loss
            tail = [e.name for e in program.eqns[span[0]:span[1]] if not e.module_path.strip("/")]
            if tail:
                label += f" + loss ({_computes(tail)})"
        elif program is None and is_last:
            label += " + loss"  # the last stage makes the loss (graph.merge_loss_tail)
        return label
    lo, hi = int(m.group(1)), int(m.group(2))
    if program is None:
        return ("loss and other code outside any module" if is_last
                else "code outside any module") + f" (equations {lo}-{hi - 1})"
    what = _computes([e.name for e in program.eqns[lo:hi]])
    is_last = is_last or hi == len(program.eqns)
    return f"loss ({what})" if is_last else f"code outside any module: {what}"


def _unnamed_span(plan: Plan, a: int, b: int, program) -> str:
    """Stages [a, b) that are all code outside any module, named by what they compute."""
    lo, hi = plan.stages[a].start, plan.stages[b - 1].stop
    where = f"stage {a}" if b - a == 1 else f"stages {a}-{b - 1}"
    if program is None:
        last = b == len(plan.stages)
        return ("loss and other code outside any module" if last
                else "code outside any module") + f" ({where})"
    what = _computes([e.name for e in program.eqns[lo:hi]])
    if hi == len(program.eqns):
        return f"loss ({what})" + ("" if b - a == 1 else f" ({where})")
    return f"code outside any module ({where}): {what}"


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside parentheses and brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def sub_stage_label(name: str, index: int) -> str:
    """A scanned layer's sub-stage by its role: `h/h[ln_1,attn,ln_2]` -> `attention`."""
    inner = re.search(r"\[(.*)\]", name)
    mods = (inner.group(1) if inner else name.rsplit("/", 1)[-1]).lower()
    if "attn" in mods or "attention" in mods or "->" in mods:
        return "attention"
    if any(k in mods for k in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "MLP"
    return f"part {index + 1}"


def _iteration_words(plan: str, names: Sequence[str]) -> str:
    """One layer's plan over its sub-stages (`dots|dots_no_batch`, `(nothing|store)`,
    `[dots]`) in words."""
    if plan.startswith("[") and plan.endswith("]"):
        return f"each layer is one checkpoint that {SHORT_WORDS.get(plan[1:-1], plan[1:-1])}"
    texts, pos = [], 0
    for part in _split_top(plan, "|"):
        if part.startswith("(") and part.endswith(")"):
            inner = _split_top(part[1:-1], "|")
            covered = names[pos:pos + len(inner)] if names else []
            texts.append(f"one checkpoint around {' and '.join(covered) or 'its sub-stages'} "
                         f"(inside: {_iteration_words(part[1:-1], covered)})")
            pos += len(inner)
            continue
        who = names[pos] if pos < len(names) else f"part {pos + 1}"
        texts.append(f"{who} {SHORT_WORDS.get(part, part)}")
        pos += 1
    return ", ".join(texts)


def scan_words(option: str, sub_stages: Sequence[str] = ()) -> str:
    """A scan scheme in words: `scan:12x2*dots|dots_no_batch` -> `12 layers, 2 per
    iteration: attention keeps dots, MLP keeps projections`. `sub_stages`: the names of a
    layer's sub-stages (`sub_stage_label`); without them `part 1`, `part 2`."""
    scheme = ScanScheme.parse(option)
    texts = []
    for part in scheme.parts:
        g = part.layers_per_iteration
        where = f"{part.count} layers" + (f", {g} per iteration" if g > 1 else "")
        if part.groups:
            where += (f", in {part.n_groups} checkpointed groups of "
                      f"{' x '.join(str(k) for k in part.groups)} iterations (only each "
                      "group's input kept; a group is recomputed in the backward)")
        runs = []  # (first layer, last layer, plan) of each run of equal layer plans
        for item in part.policy.split(";"):
            count, star, name = item.partition("*")
            k = int(count) if star else 1
            name = name if star else item
            first = runs[-1][1] + 1 if runs else 1
            runs.append((first, first + k - 1, name))
        names = list(sub_stages)
        if len(runs) == 1:
            texts.append(f"{where}: {_iteration_words(runs[0][2], names)}")
        else:
            texts.append(f"{where}: " + "; ".join(
                f"layer{'s' if a != b else ''} {a if a == b else f'{a}-{b}'} of each "
                f"iteration: {_iteration_words(p, names)}" for a, b, p in runs))
    return "; then ".join(texts)


def segment_name(plan: Plan, a: int, b: int, program=None) -> str:
    """The modules stages [a, b) of `plan` cover: one stage by its label (stage_label);
    stages of one module named once, `Llama/layers_2 (attn_norm, attn, mlp_norm, mlp)`;
    otherwise `first to last (k stages)`."""
    n = len(plan.stages)

    def label(i: int) -> str:
        st = plan.stages[i]
        return stage_label(st.name, program, is_last=i == n - 1, span=(st.start, st.stop))

    if all(_UNNAMED.match(plan.stages[i].name) for i in range(a, b)):
        return _unnamed_span(plan, a, b, program)
    if b - a == 1:
        return label(a)
    parts = [re.match(r"^(.*?)(?:\[(.*)\])?$", plan.stages[i].name) for i in range(a, b)]
    heads = {m.group(1) for m in parts}
    if len(heads) == 1 and not _UNNAMED.match(plan.stages[a].name) and all(
            m.group(2) for m in parts):
        tails = dict.fromkeys(t for m in parts for t in m.group(2).split(","))
        return f"{heads.pop()} ({', '.join(tails)})"
    return f"{label(a)} to {label(b - 1)} ({b - a} stages)"


# ---------------------------------------------------------------------------------------
# The plan as a table
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    depth: int
    where: str                     # the module range
    keeps: str                     # in words
    kept_bytes: int | None         # what the memory model counts it keeping; None: unknown
    recompute_flops: float | None  # recomputed in its backward, nested segments included


def sub_stage_labels(analysis) -> list[str]:
    """The roles of a scanned layer's sub-stages (sub_stage_label: `attention`, `MLP`,
    `part 3`), in order; [] without an analysis or for a model without a layer scan.
    What a plan records in its metadata (`scan_sub_stages`) to be read without the
    analysis."""
    sc = getattr(analysis, "scan_chain", None) if analysis is not None else None
    if sc is None:
        return []
    return [sub_stage_label(s.name, i) for i, s in enumerate(sc.stack.chain.stages)]




def segment_rows(plan: Plan, analysis=None) -> list[Row]:
    """One row per segment, nested ones after their region with depth + 1. With the
    `analysis` the plan was made on, each row has its kept bytes and recompute FLOPs."""
    program = analysis.program if analysis is not None else None
    chain = None
    if analysis is not None:
        chain = analysis.chain_for(plan.segments, chain=analysis.chain)
    subs = sub_stage_labels(analysis) or list(plan.metadata.get("scan_sub_stages", ()))

    rows: list[Row] = []

    def walk(segs: Sequence[Segment], depth: int) -> None:
        for s in segs:
            where = segment_name(plan, s.start, s.stop, program)
            kept = flops = None
            if s.children:
                keeps = "only its inputs: one checkpoint around the segments below"
                if chain is not None:
                    kept = chain.region_input_bytes(s.start, s.stop)
                    flops = run_chain(chain, s.children, 0, inside_region=True)[1]
            else:
                keeps = keep_words(s.option, subs)
                if s.saved and s.kind not in (Store(), KeepRule(NOTHING)):
                    keeps += f" ({len(s.saved)} tensor{'s' if len(s.saved) > 1 else ''})"
                if chain is not None:
                    option = chain.leaf_profile(s.start, s.stop).option(s.option)
                    kept, flops = option.keep_bytes, option.recompute_flops
            rows.append(Row(depth, where, keeps, None if kept is None else int(kept),
                            None if flops is None else float(flops)))
            walk(s.children, depth + 1)

    walk(plan.segments, 0)
    return rows


def _table(header: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[bool],
           wrap: dict[int, int] | None = None) -> list[str]:
    """A plain-text table; the columns in `wrap` ({index: width}) wrap at word boundaries
    onto continuation lines, no cell is ever cut."""
    import textwrap
    wrap = wrap or {}
    cells = [[textwrap.wrap(c, wrap[i], subsequent_indent="  ") or [""] if i in wrap else [c]
              for i, c in enumerate(r)] for r in body]
    head = [[h] for h in header]
    widths = [max(len(x) for r in [head, *cells] if i < len(r) for x in r[i])
              for i in range(len(header))]

    def lines(row):
        height = max(len(c) for c in row)
        out = []
        for k in range(height):
            parts = [(c[k] if k < len(c) else "") for c in row]
            out.append("  ".join(p.rjust(w) if r else p.ljust(w)
                                 for p, w, r in zip(parts, widths, right)).rstrip())
        return out

    return [*lines(head), "  ".join("-" * w for w in widths),
            *(x for r in cells for x in lines(r))]


def _checkpointed(segments: Sequence[Segment]) -> int:
    """Segments of the tree (children included) that are `jax.checkpoint` regions."""
    return sum(s.is_checkpoint + _checkpointed(s.children) for s in segments)


def summary(plan: Plan, analysis=None, units: Units | None = None, figures: bool = True) -> str:
    """`plan` as a table a person can read, then every figure with its meaning.

    Per segment: the modules it covers (nesting as indentation), what it keeps in words
    and, with the `analysis` the plan was made on, the bytes it keeps and the FLOPs its
    backward recomputes (and their share of the step). `units`: the budget's unit family
    (budget.units_of); by default budget.DEFAULT_UNITS (decimal). `figures`: also list
    the plan's totals (budget, peaks, recompute), each with its meaning.
    """
    units = units or DEFAULT_UNITS
    fb = units.format
    rows = segment_rows(plan, analysis)
    n_ckpt = _checkpointed(plan.segments)  # one row per segment, as segment_rows walks them
    out = [f"remat plan for a budget of {fb(plan.budget_bytes)}: {len(plan.segments)} "
           f"top-level segments over {len(plan.stages)} stages, {n_ckpt} checkpointed"]
    step = plan.step_flops

    def share(f):
        return f"{100 * f / step:.2f}%" if step else "-"

    body = []
    for r in rows:
        where = "  " * r.depth + r.where
        if r.kept_bytes is None:
            body.append([where, r.keeps])
        else:
            body.append([where, r.keeps, fb(r.kept_bytes), format_flops(r.recompute_flops),
                         share(r.recompute_flops)])
    if analysis is None:
        out += _table(["segment (modules)", "keeps"], body, [False, False], {1: 64})
    else:
        out += _table(["segment (modules)", "keeps", "kept", "recomputes", "of step"], body,
                      [False, False, True, True, True], {1: 64})
    if not n_ckpt:
        out.append("no remat needed: every segment keeps everything, nothing is recomputed")
    if analysis is None:
        out.append("  (per-segment bytes and FLOPs: plan.summary(analysis), with the "
                   "rp.analyze(...) result the plan was made on)")
    else:
        out.append("  kept: bytes the segment holds from its forward until its backward "
                   "(memory model)")
        out.append("  recomputes: forward work its backward redoes (nested segments "
                   "included), and its share of the step's FLOPs")
    if not figures:
        return "\n".join(out)
    out.append("")
    out.append("the plan's figures:")
    items = [
        ("budget", fb(plan.budget_bytes),
         "memory for the whole training step: params, grads, optimizer state, batch, "
         "activations"),
        ("predicted peak", fb(plan.predicted_peak_bytes),
         "the memory model's peak of the planned step"),
        ("XLA peak", fb(plan.measured_peak_bytes) if plan.measured_peak_bytes is not None
         else "not verified",
         "XLA's buffer assignment of the compiled planned step: the figure that proves the "
         "fit" if plan.measured_peak_bytes is not None else
         "the plan was not compiled (verify=False): only the model's prediction"),
        ("recompute", f"{format_flops(plan.recompute_flops)} = {share(plan.recompute_flops)}",
         "extra FLOPs the plan spends recomputing, as a share of the step without remat "
         "(cost model)"),
    ]
    time_over = plan.recompute_time_overhead
    if plan.metadata.get("cost_model") == "time" and time_over is not None:
        items.append(("recompute time", f"{100 * time_over:.1f}%",
                        "predicted extra step time (roofline: FLOPs and bytes moved per "
                        "recomputed equation); what this plan minimised"))
    w0 = max(len(f[0]) for f in items)
    w1 = max(len(f[1]) for f in items)
    out += [f"  {a.ljust(w0)}  {b.rjust(w1)}  {c}" for a, b, c in items]
    return "\n".join(out)
