"""The memory model against XLA on every plan of a fixed set, per test-corpus model.

For each model of tests/corpus.py: the plan that stores everything, the plan that
checkpoints every stage but the last (the calibration's two steps), each built-in keep
rule per block (planner.per_block_plans), and the solver's plans at 0, 25, 50, 75 and
95% of the way from the model's smallest feasible budget to its no-remat peak. Each is
compiled (XLA's peak of the donated optax step) and compared with the model's peak:
"raw" is the model without the calibration (no scales, no offset), "fitted" the model
`rp.plan` uses. Prints one line per plan, then per model and over all plans the median
and largest error and how many plans are within 3%. Run from the repository root:

    python scripts/model_error.py [MODEL ...]

About 4 minutes for the ten models on 2 CPU cores.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402
import remat_planner as rp  # noqa: E402
from remat_planner.memory import simulate  # noqa: E402
from remat_planner.plan import NOTHING, STORE, Segment  # noqa: E402
from remat_planner.planner import per_block_plans, plan_from_segments  # noqa: E402
from remat_planner.solve import ChainSolver  # noqa: E402
from remat_planner.verify import measure_step  # noqa: E402

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.95)


def plans(an: rp.Analysis) -> dict[str, tuple[Segment, ...]]:
    """The plans compared, by label."""
    n = an.chain.n
    out = {"store": tuple(Segment(i, i + 1, STORE) for i in range(n)),
           "ckpt": tuple(Segment(i, i + 1, NOTHING if i < n - 1 else STORE) for i in range(n))}
    for j, segments in enumerate(per_block_plans(an)):
        out[f"block{j}"] = tuple(segments)
    lo, hi = an.min_feasible_budget(), an.noremat_predicted_peak
    solver = ChainSolver(an.chain, max(an.noremat_activation_bytes, 1))
    for f in FRACTIONS:
        solution = solver.solve(int(lo + f * (hi - lo)) - an.fixed.total - an.calibration_bytes)
        if solution is not None:
            out[f"solve{f:g}"] = tuple(solution.segments)
    return out


def predicted(an: rp.Analysis, segments, offset: int) -> int:
    act, _ = simulate(an.chain_for(segments, chain=an.chain), segments)
    return an.fixed.total + max(act, an.fixed.update_bytes) + offset


def report(name: str) -> list[tuple[float, float]]:
    m = corpus.get(name)
    t0 = time.perf_counter()
    fitted = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)
    raw = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux,
                     calibrate=False)
    print(f"## {name}: residual_scale {fitted.residual_scale:.2f}, workspace_scale "
          f"{fitted.workspace_scale:.2f}")
    rows = []
    for label, segments in plans(fitted).items():
        plan = plan_from_segments(fitted, segments, 0, 0, m.params, m.batch)
        xla = measure_step(fitted.step.planned(plan), m.params, m.batch).peak_bytes
        r = predicted(raw, segments, 0) / xla - 1
        f = predicted(fitted, segments, fitted.calibration_bytes) / xla - 1
        rows.append((r, f))
        print(f"  {label:10s} XLA {xla:>12,d} B   raw {r:+7.2%}   fitted {f:+7.2%}")
    summary(rows)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def summary(rows: list[tuple[float, float]], indent: str = "  ") -> None:
    for k, label in ((0, "raw"), (1, "fitted")):
        e = [abs(r[k]) for r in rows]
        print(f"{indent}{label}: median {statistics.median(e):.2%}, max {max(e):.2%}, "
              f"within 3%: {sum(x <= 0.03 for x in e)} of {len(e)}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"corpus models (default: all): {', '.join(sorted(corpus.MODELS))}")
    models = parser.parse_args().models
    unknown = [m for m in models if m not in corpus.MODELS]
    if unknown:
        parser.error(f"unknown corpus model {unknown[0]!r}; known: "
                     f"{', '.join(sorted(corpus.MODELS))}")
    every = []
    for model in models or corpus.MODELS:
        every += report(model)
    print(f"all {len(every)} plans:")
    summary(every)
