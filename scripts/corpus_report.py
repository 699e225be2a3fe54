"""The planner against nn.remat per block on the test corpus (tests/corpus.py).

For each model: XLA's peak without remat; the peak and recompute overhead of each
built-in policy applied per block in the model's own source; the planner's smallest
feasible budget (by its model) and the XLA peak of its plan there, or, where XLA puts
every plan at that budget over, the plan at the budget the error names; and, at each
built-in's peak, one fresh `rp.plan` call's XLA peak and overhead. Overheads are XLA's
FLOPs over the step without remat. Also the model's prediction error (without XLA's
correction) over the plans returned, per model and in all, and the fitted scales.
Run from the repository root:

    python scripts/corpus_report.py [MODEL ...]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402
import remat_planner as rp  # noqa: E402
from remat_planner.baselines import POLICIES  # noqa: E402
from remat_planner.memory import simulate  # noqa: E402

MIB = 2 ** 20


def model_error(an: rp.Analysis, plan: rp.Plan) -> float:
    """The memory model's own prediction for `plan` (no XLA correction) against XLA."""
    act, _ = simulate(an.chain_for(plan.segments, chain=an.chain), plan.segments)
    return an.predicted_peak(act) / plan.measured_peak_bytes - 1


def report(name: str, errors: list[float]) -> None:
    m = corpus.get(name)
    t0 = time.perf_counter()
    measure = lambda f: rp.measure(f, m.params, m.batch, m.optimizer, has_aux=m.has_aux)  # noqa: E731
    base = measure(m.loss_fn)
    over = lambda flops: flops / base.flops - 1  # noqa: E731
    print(f"\n## {name}: no remat {base.peak_bytes / MIB:.2f} MiB")
    an = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)
    own: list[float] = []  # this model's errors
    low = an.min_feasible_budget()
    try:
        p = rp.plan(m.loss_fn, m.params, m.batch, low, m.optimizer, analysis=an)
        own.append(model_error(an, p))
        print(f"smallest feasible (model) {low / MIB:.2f} MiB: plan XLA "
              f"{p.measured_peak_bytes / MIB:.2f} MiB, {over(p.measured_flops):.2%}")
    except rp.InfeasibleBudgetError as err:
        # the budget the error names, planned: the smallest XLA-feasible end
        named = err.min_feasible_bytes
        p = rp.plan(m.loss_fn, m.params, m.batch, named, m.optimizer, analysis=an)
        own.append(model_error(an, p))
        print(f"smallest feasible (model) {low / MIB:.2f} MiB: XLA over; at the named "
              f"{named / MIB:.2f} MiB the plan is XLA {p.measured_peak_bytes / MIB:.2f} MiB, "
              f"{over(p.measured_flops):.2%}")
    if not m.n_blocks:
        errors += own
        return
    print("| built-in per block | its peak | its overhead | planner peak | planner overhead |")
    print("|---|---|---|---|---|")
    for pname, policy in POLICIES.items():
        b = measure(m.make_remat_loss((policy,) * m.n_blocks))
        try:
            p = rp.plan(m.loss_fn, m.params, m.batch, b.peak_bytes, m.optimizer,
                        has_aux=m.has_aux)
            own.append(model_error(an, p))
            ours = (f"{p.measured_peak_bytes / MIB:.2f} MiB | {over(p.measured_flops):.2%} "
                    f"({p.metadata.get('compiles')} compiles)")
            if p.measured_flops > b.flops + rp.planner.REUSE_TOLERANCE * base.flops:
                ours += " (more)"
        except rp.InfeasibleBudgetError:
            ours = "infeasible | -"
        print(f"| {pname} | {b.peak_bytes / MIB:.2f} MiB | {over(b.flops):.2%} | {ours} |")
    errors += own
    print(f"model (uncorrected) vs XLA over its {len(own)} plans: median "
          f"{statistics.median(map(abs, own)):.2%}, max {max(map(abs, own)):.2%}; "
          f"fitted residual_scale {an.residual_scale:.2f}, workspace_scale "
          f"{an.workspace_scale:.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")


def main(names: list[str]) -> None:
    errors: list[float] = []
    for name in names or list(corpus.MODELS):
        report(name, errors)
    if errors:
        print(f"\nmodel (uncorrected) vs XLA over {len(errors)} returned plans: median "
              f"{statistics.median(map(abs, errors)):.2%}, max {max(map(abs, errors)):.2%}")


if __name__ == "__main__":
    main(sys.argv[1:])
