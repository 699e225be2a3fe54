"""What XLA holds at the peak of a planned step: the buffers live at the peak of XLA's
buffer assignment, grouped by what produced them (the jaxpr op name JAX gave the HLO
instruction) and shape. Use it to find what the memory model misses on a model.

The step is compiled on abstract shapes (nothing allocated) with XLA's dump on; the
peak's live set is read from the dump's live-range report
(`*-live-range.txt`, section "Live ranges at N (peak)") and each buffer's shape and op
name from the optimized HLO. Each group says where XLA put its buffers: `temp` (the
step's temporaries, what the memory model predicts) or `args` (the donated arguments'
own buffers: parameters, optimizer state and batch, and values XLA placed in them once
their contents were dead). Buffers listed as `(no op name)` of a parameter's shape are
mostly XLA's copies of parameters the backward still reads after their update could
run; they rotate through the donated parameter buffers and cost about one parameter of
temp (docs/jax-facts.md, fact 6). Run from the repository root on a model of the test
corpus (tests/corpus.py):

    python scripts/xla_peak_breakdown.py hf_gpt2 [store|checkpoint|nothing_saveable|
        dots_with_no_batch_dims_saveable|dots_saveable] [--top 20]

`store`: the step as planned with every stage stored (no remat); `checkpoint`: every
stage but the last checkpointed keeping only its inputs (the calibration plan);
a rule name: every copy of the repeated block checkpointed whole under it.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402
import remat_planner as rp  # noqa: E402
from remat_planner.memory import measure_compiler_options  # noqa: E402
from remat_planner.plan import NOTHING, STORE, Segment  # noqa: E402
from remat_planner.planner import per_block_plans  # noqa: E402
from remat_planner.verify import abstract, as_batch, make_step  # noqa: E402

RULES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?)[{ ]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def plan_segments(an: rp.Analysis, kind: str) -> tuple[Segment, ...]:
    n = an.chain.n
    if kind == "store":
        return tuple(Segment(i, i + 1, STORE) for i in range(n))
    if kind == "checkpoint":
        return tuple(Segment(i, i + 1, NOTHING if i < n - 1 else STORE) for i in range(n))
    plans = per_block_plans(an)
    if not plans:
        raise SystemExit("no repeated block found: only 'store' and 'checkpoint' apply")
    return plans[RULES.index(kind)]


def peak_live_set(dump: Path) -> tuple[int, list[tuple[str, int]]]:
    """(instruction index of the peak, [(buffer name, bytes)]) from the live-range report."""
    (report,) = dump.glob("*after_optimizations-live-range.txt")
    lines = report.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "(peak):" in line)
    index = int(re.search(r"at (\d+) \(peak\)", lines[start]).group(1))
    live = []
    for line in lines[start + 1:]:
        m = re.match(r"\s+(\S+?)\{[^}]*\}: (\d+) bytes", line)
        if m is None:
            break
        live.append((m.group(1), int(m.group(2))))
    return index, live


def allocation_kinds(dump: Path) -> dict[str, str]:
    """buffer name -> "temp" or "args": whether XLA's buffer assignment placed it in the
    step's temporary allocation or in an argument's (donated) buffer."""
    (report,) = dump.glob("*after_optimizations-buffer-assignment.txt")
    kind, out = None, {}
    for line in report.read_text().splitlines():
        head = re.match(r"allocation \d+: size \d+, (.*)", line)
        if head:
            kind = ("temp" if "preallocated-temp" in head.group(1)
                    else "args" if "parameter" in head.group(1) else "other")
            continue
        value = re.match(r"\s*value: <\d+ (\S+) @\d+>", line)
        if value and kind is not None:
            out[value.group(1)] = kind
    return out


def instructions(dump: Path) -> tuple[dict[str, tuple[str, str]], int]:
    """name -> (shape, op name) of every instruction of the optimized module, and the
    length of its schedule."""
    (hlo,) = dump.glob("*after_optimizations.txt")
    out = {}
    for line in hlo.read_text().splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            op = _OP_NAME.search(line)
            out[m.group(1)] = (m.group(2), op.group(1) if op else "")
    (report,) = dump.glob("*after_optimizations-live-range.txt")
    length = int(re.search(r"max (\d+)", report.read_text()).group(1))
    return out, length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(corpus.MODELS))
    ap.add_argument("plan", nargs="?", default="checkpoint", choices=("store", "checkpoint", *RULES))
    ap.add_argument("--top", type=int, default=20, help="groups to list")
    args = ap.parse_args()
    m = corpus.get(args.model)
    an = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux,
                    calibrate=False, measure_xla=False)
    segments = plan_segments(an, args.plan)
    planned = rp.Plan(segments=segments, stages=an.stage_infos,
                      fingerprint=an.program.fingerprint(), budget_bytes=0,
                      predicted_peak_bytes=0, recompute_flops=0.0, fixed_bytes=an.fixed.total,
                      step_flops=an.step_flops,
                      has_aux=m.has_aux).apply(m.loss_fn)
    step = make_step(planned, m.optimizer, m.has_aux)
    params, batch = abstract(m.params), abstract(as_batch(m.batch))
    opt_state = jax.eval_shape(m.optimizer.init, params)
    with tempfile.TemporaryDirectory() as tmp:
        options = {**measure_compiler_options(), "xla_dump_to": tmp}
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch).compile(options)
        index, live = peak_live_set(Path(tmp))
        info, length = instructions(Path(tmp))
        where = allocation_kinds(Path(tmp))
    ma = compiled.memory_analysis()
    total = sum(b for _, b in live)
    in_temp = sum(b for name, b in live if where.get(name) == "temp")
    print(f"{args.model}, plan {args.plan}: temp {ma.temp_size_in_bytes:,} B, arguments "
          f"{ma.argument_size_in_bytes:,} B; peak at instruction {index} of {length}, "
          f"{len(live)} buffers live, {total:,} B ({in_temp:,} B of them in temp)")
    groups: dict[tuple[str, str, str], list[int]] = collections.defaultdict(list)
    for name, size in live:
        shape, op = info.get(name, ("?", ""))
        op = re.sub(r"\[\\?'[^]]*\]", "[.]", op) if op.startswith(("params", "opt_state")) else op
        groups[(op or "(no op name: a copy or layout change XLA added)", shape,
                where.get(name, "?"))].append(size)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    print(f"{'bytes':>12} {'n':>4}  {'in':<5} {'shape':<22} produced by")
    for (op, shape, kind), sizes in rows[:args.top]:
        print(f"{sum(sizes):>12,} {len(sizes):>4}  {kind:<5} {shape:<22} {op}")


if __name__ == "__main__":
    main()
