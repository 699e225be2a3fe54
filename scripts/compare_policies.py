"""Plan a config at JAX's built-in policy peaks and across its budget range; print a table.

Every figure comes from this run: XLA's memory_analysis peak and cost_analysis FLOPs of
the donated optimizer step, compiled with the CPU option that keeps remat.

    python scripts/compare_policies.py configs/gpt2-small.yaml
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from remat_planner import planner as pl
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.errors import RematPlannerError

MiB = 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--fractions", default="0.25,0.5,0.85",
                    help="budgets as fractions of the way from smallest feasible to no remat")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    P, B = wl.abstract_params, wl.abstract_batch
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr, flush=True)
    an = pl.analyze(wl.loss_fn, P, B, opt, progress=log)
    base = pl.measure_builtin_policies(wl.loss_fn, P, B, opt, progress=log)
    nr = base["no_remat"]
    print(f"# {args.config}: {wl.param_count:,} params, jax {jax.__version__}")
    print(f"analysis: {len(an.program.eqns)} equations, {an.chain.n} stages, residual scale "
          f"{an.residual_scale:.3f}, workspace scale {an.workspace_scale:.3f}")
    print()
    print("| budget (MiB) | from | planner XLA peak | predicted | pred. error | planner overhead "
          "| policy peak | policy overhead | rounds |")
    print("|---|---|---|---|---|---|---|---|---|")

    def row(budget, label, policy=None):
        try:
            p = pl.plan(wl.loss_fn, P, B, budget, opt, analysis=an, progress=log)
        except RematPlannerError as e:
            print(f"| {budget / MiB:.1f} | {label} | infeasible: {e} | | | | | | |")
            return
        ov = (p.measured_flops - nr.flops) / nr.flops
        err = (p.predicted_peak_bytes - p.measured_peak_bytes) / p.measured_peak_bytes
        pol = (f"{policy.peak_bytes / MiB:.1f} | {100 * (policy.flops - nr.flops) / nr.flops:.2f}%"
               if policy else " | ")
        print(f"| {budget / MiB:.1f} | {label} | {p.measured_peak_bytes / MiB:.1f} | "
              f"{p.predicted_peak_bytes / MiB:.1f} | {100 * err:+.1f}% | {100 * ov:.2f}% | {pol} | "
              f"{p.metadata.get('verify_rounds')} |", flush=True)

    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        row(base[name].peak_bytes, name, base[name])
    low, high = an.min_feasible_budget(), nr.peak_bytes
    for f in map(float, args.fractions.split(",")):
        row(int(low + f * (high - low)), f"{f:.2f} of [min {low / MiB:.1f}, no remat "
            f"{high / MiB:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
