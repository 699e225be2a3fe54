"""A plan as what a Flax user writes by hand: `nn.remat` / `nnx.remat` around stock modules.

`plan.apply(loss_fn)` replays the traced step segment by segment (remat_planner/apply.py).
This module says instead which of the model's own modules to wrap in `nn.remat`, and with
which policy, so that the step compiles to the same checkpoints without the replay and
without tagging anything inside Flax's modules with `checkpoint_name`.

A checkpointed segment of the plan is exported when its equations are exactly those of
one Flax module (by the module paths JAX records for each equation; the outermost such
module). Its policy is a `PrimitivePolicy`: a JAX policy predicate, `policy(prim, *avals,
**params) -> bool` as `jax.checkpoint_policies` are, that keeps the outputs of the
equations the plan keeps, recognised by primitive, operand shapes and dtypes and
dimension numbers. A nested region becomes an `nn.remat` module holding further
`nn.remat` submodules. `store` segments are left as they are.

What cannot be exported is said, never approximated:
- a checkpointed segment over part of a module, or over several sibling modules
  (`Block_0[LayerNorm_1,Dense_0,Dense_1]`): `nn.remat` wraps one module, and wrapping
  the pieces one by one keeps their boundaries too, so it is another plan;
- a kept value whose primitive and shapes match a value of the same module the plan
  recomputes: a predicate is called with primitive, operand avals and parameters, never
  a position, and JAX reuses its answers for identical jitted sub-computations (the
  partial evaluation of `jnp.einsum`'s jit is cached), so counting calls cannot stand in
  for positions either;
- a layer-stack scan scheme (`scan:...`): write it with `nn.scan` as `explain` describes;
- equations without a Flax module path (plain JAX; flax.nnx records none).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from . import planner
from .budget import parse_budget
from .errors import (InfeasibleBudgetError, PlanMismatchError, RematPlannerError,
                     UnsupportedModelError)
from .memory import dot_outputs, simulate
from .plan import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING, STORE, KeepRule, Plan,
                   ScanOption, Segment, Store)
from .solve import Solution
from .trace import Literal, Program
from .verify import as_batch

# Built-in policies that keep exactly the dot outputs of each keep rule.
BUILTIN = {NOTHING: "jax.checkpoint_policies.nothing_saveable",
           DOTS_NO_BATCH: "jax.checkpoint_policies.dots_with_no_batch_dims_saveable",
           DOTS_NARROW: "remat_planner.dots_narrow_saveable",
           DOTS: "jax.checkpoint_policies.dots_saveable"}

_RULE_WORDS = {NOTHING: "keeps only its inputs",
               DOTS_NO_BATCH: "keeps its projections (dot_general outputs without batch dims)",
               DOTS_NARROW: "keeps its projections and attention's probs @ values",
               DOTS: "keeps every dot_general and convolution output"}

Signature = tuple  # (primitive name, ((shape, dtype), ...) of operands, dimension numbers)


def _dims(params: dict):
    """The parameters that tell equations of one primitive apart beyond shapes."""
    dims = params.get("dimension_numbers")
    return None if dims is None else repr(dims)


def signature(prim_name: str, operand_avals: Sequence, params: dict) -> Signature:
    """What a policy predicate can see of an equation: primitive, operand shapes and
    dtypes, dimension numbers."""
    ops = tuple((tuple(int(d) for d in getattr(a, "shape", ())), str(getattr(a, "dtype", "")))
                for a in operand_avals)
    return (prim_name, ops, _dims(params))


@dataclasses.dataclass(frozen=True)
class PrimitivePolicy:
    """A `jax.checkpoint` policy that keeps the outputs of equations with these signatures.

        nn.remat(Block, policy=exported.policy_for("Block_0"))

    `keep` holds (primitive, ((operand shape, dtype), ...), dimension numbers) entries;
    `builtin` names a built-in policy that keeps the same values in the module the
    policy was made for, where one does."""

    keep: frozenset
    builtin: str | None = None

    def __call__(self, prim, *avals, **params) -> bool:
        if not any(k[0] == prim.name for k in self.keep):
            return False
        return signature(prim.name, avals, params) in self.keep

    def describe(self) -> str:
        if not self.keep:
            return "keeps nothing but the module's inputs"
        parts = []
        for name, ops, _ in sorted(self.keep):
            shapes = " x ".join(f"{dt}{list(s)}" for s, dt in ops)
            parts.append(f"{name}({shapes})")
        return "keeps the outputs of " + "; ".join(parts)

    def to_python(self, name: str) -> str:
        """Source of a self-contained policy function `name` (needs only `import jax`)."""
        if not self.keep:
            return (f"def {name}(prim, *avals, **params):  # = nothing_saveable\n"
                    "    return False\n")
        rows = ",\n".join(f"    ({n!r}, {ops!r}, {dims!r})" for n, ops, dims in sorted(self.keep))
        same = f"  # same values as {self.builtin} here" if self.builtin else ""
        return (f"_{name.upper()}_KEEP = {{\n{rows},\n}}\n\n\n"
                f"def {name}(prim, *avals, **params):{same}\n"
                f"    if prim.name not in {sorted({k[0] for k in self.keep})!r}:\n"
                "        return False\n"
                "    ops = tuple((tuple(int(d) for d in a.shape), str(a.dtype)) for a in avals)\n"
                "    dims = params.get('dimension_numbers')\n"
                f"    return (prim.name, ops, None if dims is None else repr(dims)) in _{name.upper()}_KEEP\n")


@dataclasses.dataclass(frozen=True)
class Wrap:
    """One module to wrap in `nn.remat` (or `nnx.remat`), with its policy.

    path: the module's path as JAX records it (`LM/Decoder_0/Block_0`, the root module's
      class first); `scope` is the same without the root, as in the params tree.
    class_name: the module's class when its name is Flax's automatic `Class_N`, else None.
    stages: the plan's stages [start, stop) it covers; option: the plan's keep option.
    nested: wrapped submodules inside it (a nested checkpoint region), in order.
    """

    path: str
    class_name: str | None
    stages: tuple[int, int]
    option: str
    policy: PrimitivePolicy
    description: str
    nested: tuple["Wrap", ...] = ()

    @property
    def scope(self) -> str:
        return self.path.partition("/")[2] or self.path

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]


@dataclasses.dataclass(frozen=True)
class FlaxExport:
    """A plan as `nn.remat` wraps of the model's modules: `wraps` are non-overlapping and
    in program order; `problems` says, per segment that could not be exported, why (empty:
    the wraps are the whole plan; modules not listed stay as they are)."""

    wraps: tuple[Wrap, ...]
    problems: tuple[str, ...]
    fingerprint: str

    @property
    def exact(self) -> bool:
        return not self.problems

    def all_wraps(self) -> list[Wrap]:
        """Every wrap, nested ones after their parent."""
        out = []

        def walk(ws):
            for w in ws:
                out.append(w)
                walk(w.nested)
        walk(self.wraps)
        return out

    def find(self, module: str) -> Wrap | None:
        """The wrap of `module`: its full path, its scope, or a unique path suffix
        (`Block_0`, `Decoder_0/Block_0`); None when the plan leaves it unwrapped."""
        hits = [w for w in self.all_wraps()
                if module in (w.path, w.scope) or w.path.endswith("/" + module)]
        if len(hits) > 1:
            raise KeyError(f"{module!r} names {len(hits)} wrapped modules: "
                           + ", ".join(w.path for w in hits))
        return hits[0] if hits else None

    def policy_for(self, module: str) -> PrimitivePolicy | None:
        """The policy to pass to `nn.remat` for `module`, or None: leave it unwrapped."""
        w = self.find(module)
        return None if w is None else w.policy

    def to_python(self) -> str:
        """Code to paste: one policy function per distinct policy, and which module to
        wrap with which (as comments: where to write `nn.remat` depends on your model)."""
        lines = ["import jax", "import flax.linen as nn", ""]
        names: dict[PrimitivePolicy, str] = {}
        for w in self.all_wraps():
            if w.policy not in names:
                names[w.policy] = f"policy_{len(names)}"
                lines += ["", w.policy.to_python(names[w.policy])]
        lines += ["", "# Wrap these modules (program order; indented: inside the one above):"]

        def walk(ws, depth):
            for w in ws:
                cls = w.class_name or f"<class of {w.name}>"
                lines.append(f"# {'    ' * depth}{w.scope}: nn.remat({cls}, "
                             f"policy={names[w.policy]})  # {w.description}")
                walk(w.nested, depth + 1)
        walk(self.wraps, 0)
        if not self.wraps:
            lines.append("#   (none: the plan checkpoints no whole module)")
        for p in self.problems:
            lines.append(f"# NOT EXPORTED: {p}")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        out = []

        def walk(ws, depth):
            for w in ws:
                cls = f" ({w.class_name})" if w.class_name else ""
                out.append(f"{'  ' * depth}nn.remat {w.scope}{cls}: {w.description}")
                walk(w.nested, depth + 1)
        walk(self.wraps, 0)
        if not self.wraps:
            out.append("no module wrapped in nn.remat")
        out += [f"not exported: {p}" for p in self.problems]
        return "\n".join(out)


# ---------------------------------------------------------------------------------------

_AUTO_NAME = re.compile(r"^([A-Z][A-Za-z0-9]*)_\d+$")


def _module_spans(program: Program) -> dict[str, tuple[int, int, int]]:
    """Module path -> (first equation, last + 1, number of equations) under it."""
    spans: dict[str, list[int]] = {}
    for i, e in enumerate(program.eqns):
        parts = [p for p in e.module_path.split("/") if p]
        for d in range(1, len(parts) + 1):
            s = spans.setdefault("/".join(parts[:d]), [i, i + 1, 0])
            s[1] = i + 1
            s[2] += 1
    return {k: tuple(v) for k, v in spans.items()}


def _aligned_module(spans, lo: int, hi: int) -> str | None:
    """The outermost module whose equations are exactly [lo, hi), or None."""
    hits = [p for p, (a, b, n) in spans.items() if a == lo and b == hi and n == hi - lo]
    if not hits:
        return None
    return min(hits, key=lambda p: p.count("/"))


def _what_it_covers(spans, program: Program, lo: int, hi: int) -> str:
    """In words, what equations [lo, hi) are: the innermost module holding them all and
    which of its submodules they run, whole or in part."""
    paths = [tuple(p for p in e.module_path.split("/") if p) for e in program.eqns[lo:hi]]
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    parent = "/".join(common)
    children = list(dict.fromkeys(p[len(common)] for p in paths if len(p) > len(common)))
    own = sum(len(p) == len(common) for p in paths)
    if not parent:
        return f"code outside any module{' and ' + ', '.join(children) if children else ''}"
    parts = []
    for c in children:
        a, b, n = spans[f"{parent}/{c}"]
        whole = a >= lo and b <= hi
        parts.append(c if whole else f"part of {c}")
    words = ", ".join(parts) if parts else "none of its submodules"
    glue = f" and {own} equations of {parent}'s own code" if own else ""
    advice = (f"; to wrap them, move them into a module of their own inside {parent}"
              if parts and all(not p.startswith("part of") for p in parts) else "")
    return f"in {parent}: {words}{glue}{advice}"


def _operand_avals(program: Program, eqn):
    out = []
    for v in eqn.invars:
        if isinstance(v, Literal):
            out.append(np.asarray(v.val))
        else:
            out.append(program.avals[v])
    return out


def _eqn_signature(program: Program, eqn) -> Signature:
    return signature(eqn.name, _operand_avals(program, eqn), eqn.params)


def _leaf_policy(program: Program, lo: int, hi: int,
                 seg: Segment) -> tuple[PrimitivePolicy | None, str | None]:
    """The policy keeping `seg.saved` among equations [lo, hi), or (None, why not)."""
    saved = set(seg.saved)
    keep, other = set(), set()
    for e in program.eqns[lo:hi]:
        sig = _eqn_signature(program, e)
        kept = [v in saved for v in e.outvars]
        if any(kept) and not all(kept):
            return None, f"it keeps some outputs of one {e.name} equation but not others"
        (keep if any(kept) else other).add(sig)
    missing = saved - {v for e in program.eqns[lo:hi] for v in e.outvars}
    if missing:
        return None, f"it keeps values {sorted(missing)} computed outside it"
    clash = keep & other
    if clash:
        name, ops, _ = sorted(clash)[0]
        shapes = " x ".join(f"{dt}{list(s)}" for s, dt in ops)
        return None, (f"it keeps some {name}({shapes}) outputs and recomputes others with the "
                      "same shapes, which a policy predicate cannot tell apart")
    rule = seg.kind.rule if isinstance(seg.kind, KeepRule) else None
    same_as_rule = rule is not None and set(seg.saved) == set(_rule_outputs(program, lo, hi, rule))
    builtin = BUILTIN.get(rule) if same_as_rule else None
    return PrimitivePolicy(frozenset(keep), builtin), None


def _rule_outputs(program: Program, lo: int, hi: int, rule: str) -> tuple[int, ...]:
    """The values keep rule `rule` (KeepRule.rule) keeps among equations [lo, hi)."""
    if rule == NOTHING:
        return ()
    return dot_outputs(program, lo, hi, rule)


def _describe(option: str, policy: PrimitivePolicy) -> str:
    words = _RULE_WORDS.get(option, option)
    if policy.builtin:
        return f"{words} (= {policy.builtin} here)"
    return f"{words}: {policy.describe()}"


def export_flax(plan: Plan, program: Program, classes: dict[str, str] | None = None) -> FlaxExport:
    """`plan` (made for `program`, the traced loss: `analysis.program`) as `nn.remat`
    wraps of the model's modules; see the module docstring for what is exported.
    `classes` (module scope -> class name, `module_classes`) names the wrapped modules'
    classes; without it a class is named only from an automatic `Class_N` name."""
    classes = classes or {}

    def class_of(path: str) -> str | None:
        return classes.get(path.partition("/")[2]) or _class_name(path)
    if program.fingerprint() != plan.fingerprint:
        raise PlanMismatchError("plan was made for another computation than this program; "
                                "export it with the analysis (or trace) it was made for")
    spans = _module_spans(program)
    problems: list[str] = []

    def stage_names(seg: Segment) -> str:
        a, b = plan.stages[seg.start].name, plan.stages[seg.stop - 1].name
        return a if seg.stop - seg.start == 1 else f"{a} .. {b}"

    def convert(segments: Sequence[Segment], inside: str | None) -> list[Wrap]:
        wraps = []
        for seg in segments:
            if isinstance(seg.kind, Store):
                continue
            where = f"stages {seg.start}-{seg.stop - 1} ({stage_names(seg)}, {seg.option})"
            lo, hi = plan.stages[seg.start].start, plan.stages[seg.stop - 1].stop
            if isinstance(seg.kind, ScanOption):
                problems.append(f"{where}: a layer-stack scan scheme; write it with nn.scan "
                                "as `explain` describes, or use plan.apply")
                continue
            path = _aligned_module(spans, lo, hi)
            if path is None and not any(e.module_path.strip("/") and "(" not in e.module_path
                                        for e in program.eqns[lo:hi]):
                problems.append(f"{where}: its equations carry no Flax module path (plain "
                                "JAX, or flax.nnx, which records none), so there is no "
                                "module to wrap")
                continue
            if path is None:
                problems.append(f"{where}: its equations are not exactly one Flax module's "
                                f"({_what_it_covers(spans, program, lo, hi)}); nn.remat "
                                "wraps one module, and wrapping the parts one by one would "
                                "keep their boundaries too, another plan")
                continue
            if inside is not None and not path.startswith(inside + "/"):
                problems.append(f"{where}: module {path} is not inside {inside}")
                continue
            if seg.children:
                policy = PrimitivePolicy(frozenset(), BUILTIN[NOTHING]) if not seg.saved else None
                if policy is None:
                    problems.append(f"{where}: a region that keeps values besides its inputs")
                    continue
                nested = tuple(convert(seg.children, path))
                desc = "keeps only its inputs; inside, " + (
                    f"{len(nested)} wrapped submodule(s)" if nested else "nothing else wrapped")
                wraps.append(Wrap(path, class_of(path), (seg.start, seg.stop), seg.option,
                                  policy, desc, nested))
                continue
            policy, why = _leaf_policy(program, lo, hi, seg)
            if policy is None:
                problems.append(f"{where} in module {path}: {why}")
                continue
            wraps.append(Wrap(path, class_of(path), (seg.start, seg.stop), seg.option,
                              policy, _describe(seg.option, policy)))
        return wraps

    wraps = convert(plan.segments, None)
    return FlaxExport(tuple(wraps), tuple(problems), plan.fingerprint)


def _class_name(path: str) -> str | None:
    m = _AUTO_NAME.match(path.rpartition("/")[2])
    return m.group(1) if m else None


def module_classes(loss_fn: Callable, params, batch) -> dict[str, str]:
    """Module scope (`Decoder_0/Block_0`, as in the params tree) -> class name of every
    linen module `loss_fn(params, *batch)` calls, recorded on abstract shapes."""
    import flax.linen as nn
    import jax

    found: dict[str, str] = {}

    def record(next_fun, args, kwargs, context):
        mod = context.module
        path = getattr(mod, "path", None)
        if path and context.method_name == "__call__":
            found.setdefault("/".join(str(p) for p in path), type(mod).__name__)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda p, *b: loss_fn(p, *b), params, *as_batch(batch))
    return found


def export_for(plan: Plan, analysis, loss_fn: Callable | None = None, params=None,
               batch=None) -> FlaxExport:
    """`export_flax` of the analysed step; with `loss_fn`, params and batch (abstract
    shapes suffice) the wrapped modules' classes are looked up (`module_classes`)."""
    classes = module_classes(loss_fn, params, batch) if loss_fn is not None else None
    return export_flax(plan, analysis.program, classes)


# ---------------------------------------------------------------------------------------
# The cheapest plan that is all whole modules
# ---------------------------------------------------------------------------------------

def module_units(an, program: Program | None = None) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """The pieces of the analysed step a user can wrap in `nn.remat`: (first stage, stop
    stage, module path, keep options) for each repeated block (the chain's spans) and each
    single stage whose equations are exactly one module's, in order, non-overlapping."""
    program = program or an.program
    spans = _module_spans(program)
    stages = an.stage_infos
    units, covered = [], set()
    for a, c, profile in an.chain.spans:
        path = _aligned_module(spans, stages[a].start, stages[c - 1].stop)
        if path is not None:
            units.append((a, c, path, tuple(o.name for o in profile.options
                                              if isinstance(o.kind, KeepRule))))
            covered.update(range(a, c))
    for i, st in enumerate(stages):
        if i in covered:
            continue
        path = _aligned_module(spans, st.start, st.stop)
        if path is not None:
            names = tuple(o.name for o in an.chain.stages[i].options
                          if isinstance(o.kind, KeepRule))
            if names:
                units.append((i, i + 1, path, names))
    return sorted(units)


def _module_segments(an, units, choice) -> tuple[Segment, ...]:
    """Segments checkpointing unit k under `choice[k]` (None: its stages stored)."""
    by_start = {a: (c, rule) for (a, c, _, _), rule in zip(units, choice)}
    segments, i = [], 0
    while i < an.chain.n:
        c, rule = by_start.get(i, (None, None))
        if rule is None:
            segments.append(Segment(i, i + 1, STORE))
            i += 1
            continue
        profile = an.chain.leaf_profile(i, c)
        segments.append(Segment(i, c, rule, profile.option(rule).saved))
        i = c
    return tuple(segments)


def _choices(units, limit: int = 4000):
    """Keep rules per unit to try: with every unit offering the same rules, each count of
    units per rule (frugal rules on the earliest units, and on the latest); otherwise
    each rule for all units. `None` stores a unit."""
    import itertools
    rules_sets = {u[3] for u in units}
    if len(rules_sets) == 1:
        rules = (None, *next(iter(rules_sets)))
        n = len(units)
        seen = set()
        for counts in itertools.combinations_with_replacement(range(len(rules)), n):
            order = [rules[k] for k in counts]
            for arrangement in (order, order[::-1]):
                t = tuple(arrangement)
                if t not in seen:
                    seen.add(t)
                    yield t
            if len(seen) > limit:
                return
        return
    for rule in {r for u in units for r in u[3]}:
        yield tuple(rule if rule in u[3] else None for u in units)
    yield tuple(None for _ in units)


def module_plan(loss_fn: Callable, params, batch, budget, optimizer=None, *, analysis=None,
                max_compiles: int = 4, progress: Callable[[str], None] | None = None) -> Plan:
    """The plan recomputing least, by the model, among plans that checkpoint only whole
    modules (the repeated blocks, and stages that are one module), each under one keep
    rule, that XLA fits within `budget`: the plan `export_flax` exports exactly.

    Candidates go to XLA cheapest first, up to `max_compiles`; the first XLA fits is
    returned, with XLA's figures (`measured_peak_bytes`, `measured_flops`) from the replay.
    Raises InfeasibleBudgetError when no candidate fits or the step has no such module."""

    say = progress or (lambda msg: None)
    budget_bytes = parse_budget(budget)
    batch = as_batch(batch)
    an = analysis or planner.analyze(loss_fn, params, batch, optimizer)
    units = module_units(an)
    if not units:
        raise UnsupportedModelError((
            "the step has no module whose equations form whole stages of the plan (a "
            "repeated block, or a module alone in a stage), so no plan is all nn.remat of "
            "whole modules; use plan.apply instead"))
    costs = planner.PlanCosts(an, planner.resolve_cost_model(None))
    # the step measured: this call's loss and optimizer, the analysis's has_aux and sharding
    step = an.step.replace(loss_fn=loss_fn, optimizer=optimizer)
    candidates = []
    for choice in _choices(units):
        segments = _module_segments(an, units, choice)
        act, cost = simulate(costs.objective_chain, segments)
        candidates.append((cost, an.predicted_peak(act), segments, act))
    candidates.sort(key=lambda c: (c[0], c[1]))
    tried = 0
    smallest = min(c[1] for c in candidates)
    for cost, peak, segments, act in candidates:
        if peak > budget_bytes:
            continue
        if tried >= max_compiles:
            break
        tried += 1
        say(f"verifying a whole-module plan ({tried}/{max_compiles})")
        p = planner.make_plan(an, Solution(segments, cost, act), budget_bytes, params, batch, 0,
                               costs=costs)
        m = planner.measure_plan(an, p, step, params, batch)
        if m.peak_bytes <= budget_bytes:
            return planner.with_measurement(p, m, whole_modules=True)
    raise InfeasibleBudgetError(budget_bytes, smallest, detail=(
        f"no plan of nn.remat over whole modules fits ({tried} checked with XLA)"))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m remat_planner.export CONFIG --budget B [--batch-size N] [--seq-len N]
    [--python]`: the cheapest plan of nn.remat over whole modules within B, checked with
    XLA, and its exported form (`--python`: as code to paste)."""
    import argparse
    import sys

    from .config import build_workload, load_config, make_optimizer

    p = argparse.ArgumentParser(prog="python -m remat_planner.export",
                                description=main.__doc__.split(":", 1)[1].strip())
    p.add_argument("config")
    p.add_argument("--budget", required=True)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--python", action="store_true", help="print the form as code to paste")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, batch_size=args.batch_size, seq_len=args.seq_len)
        wl, optimizer = build_workload(cfg), make_optimizer(cfg.optimizer)
        say = lambda msg: print(msg, file=sys.stderr)
        an = planner.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer,
                     has_aux=wl.has_aux, progress=say)
        plan = module_plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, args.budget,
                           optimizer, analysis=an, progress=say)
    except RematPlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    exported = export_for(plan, an, wl.loss_fn, wl.abstract_params, wl.abstract_batch)
    print(f"XLA peak {plan.measured_peak_bytes:,} B (budget {plan.budget_bytes:,} B), "
          f"{plan.measured_flops:,.0f} FLOPs, recompute {100 * plan.recompute_overhead:.2f}% "
          "of the step")
    print(exported.to_python() if args.python else exported)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
