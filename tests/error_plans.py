"""The plans on which the memory model is compared with XLA, per corpus model
(tests/corpus.py): used by tests/test_corpus.py's prediction check and by
scripts/model_error.py.

For an analysis: the plan that stores everything, the plan that checkpoints every stage
but the last (the calibration's two steps), each built-in keep rule per block
(planner.per_block_plans), and the solver's plans at 0, 25, 50, 75 and 95% of the way
from the model's smallest feasible budget to its no-remat peak.
"""

from __future__ import annotations

import dataclasses

import corpus
import remat_planner as rp
from remat_planner.memory import simulate
from remat_planner.plan import NOTHING, STORE, Segment
from remat_planner.planner import per_block_plans, plan_from_segments
from remat_planner.solve import ChainSolver
from remat_planner.verify import measure_step

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.95)
# How far the uncalibrated prediction may be from XLA's peak (issue: "within 3%").
TOLERANCE = 0.03


def plans(an: rp.Analysis) -> dict[str, tuple[Segment, ...]]:
    """The plans compared, by label: store, ckpt, block<j>, solve<fraction>."""
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


def predicted(an: rp.Analysis, segments, offset: int = 0) -> int:
    """The analysis's memory model's peak for `segments` (offset: the calibration's)."""
    act, _ = simulate(an.chain_for(segments, chain=an.chain), segments)
    return an.fixed.total + max(act, an.fixed.update_bytes) + offset


@dataclasses.dataclass(frozen=True)
class Row:
    """One plan: XLA's peak and the model's error against it, uncalibrated (`raw`: no
    scales, no offset) and as `rp.plan` uses it (`fitted`)."""

    label: str
    xla_bytes: int
    raw: float
    fitted: float


def measure(name: str, fitted: rp.Analysis | None = None) -> tuple[rp.Analysis, list[Row]]:
    """The corpus model's calibrated analysis (`fitted`, made here when not given) and one
    Row per plan of plans(): each compiled as the donated optax step and compared with
    both models."""
    m = corpus.get(name)
    if fitted is None:
        fitted = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)
    raw = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux,
                     calibrate=False)
    rows = []
    for label, segments in plans(fitted).items():
        plan = plan_from_segments(fitted, segments, 0, 0, m.params, m.batch)
        xla = measure_step(fitted.step.planned(plan), m.params, m.batch).peak_bytes
        rows.append(Row(label, xla, predicted(raw, segments) / xla - 1,
                        predicted(fitted, segments, fitted.calibration_bytes) / xla - 1))
    return fitted, rows
