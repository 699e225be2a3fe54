"""Per-device peaks, recompute overheads and communication of planned sharded steps.

    python scripts/shard_report.py [CONFIG] [--batch-size 32] [--fraction 0.5] [--scan-layers]

Runs on 8 simulated CPU devices (set here, before JAX starts). For each scheme (dp and
fsdp on data=8; tp and fsdp+tp on data=4,model=2) it plans the config's step at a
per-device budget `fraction` of the way from fixed memory to the unplanned step's
per-device peak, and prints XLA's per-device peaks, the measured FLOP overhead and the
collectives (count and bytes, loop bodies once per iteration) of the compiled unplanned
and planned steps. `--scan-layers` stacks the config's blocks in one scan first.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

SCHEMES = {"dp": "data=8", "fsdp": "data=8", "tp": "data=4,model=2",
           "fsdp+tp": "data=4,model=2"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="configs/llama-tiny.yaml")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--scan-layers", action="store_true",
                    help="plan the config with `scan_layers: true`")
    args = ap.parse_args()

    import remat_planner as rp
    from remat_planner.budget import units_of
    from remat_planner.config import build_workload, load_config, make_optimizer
    from remat_planner.errors import InfeasibleBudgetError

    cfg = load_config(args.config, batch_size=args.batch_size)
    if args.scan_layers:
        cfg = cfg.model_copy(update={"model": {**cfg.model, "scan_layers": True}})
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    unsharded = rp.measure(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt)
    # The budgets are byte counts (a fraction of the way from fixed memory to the unplanned
    # peak), so every size is shown as for a budget given in bytes: in the default family,
    # decimal (docs/guide.md; the CLI's units_of).
    units = units_of(None)
    fb = units.format
    print(f"sizes in {units.example.split(' = ')[0]} ({units.example})")
    print(f"{args.config}{' (scan_layers: true)' if args.scan_layers else ''}, batch "
          f"{args.batch_size}: one device, no remat: "
          f"{fb(unsharded.peak_bytes)}")
    print("| scheme | mesh | fixed / device | no-remat peak / device | budget | planned peak "
          "/ device | FLOP overhead | all-gather (no remat -> plan) | all-reduce (no remat "
          "-> plan) | time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    profiles = {}  # stage profiles shared by the schemes' analyses of the same program
    for scheme, mesh in SCHEMES.items():
        t0 = time.perf_counter()
        an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, mesh=mesh,
                        sharding=scheme, profiles=profiles)
        nr = an.noremat
        budget = int(an.fixed.total + args.fraction * (nr.peak_bytes - an.fixed.total))
        assert units_of(budget) is units
        try:
            p = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt,
                        analysis=an)
        except InfeasibleBudgetError as err:
            print(f"| {scheme} | {mesh} | {fb(an.fixed.total)} | {fb(nr.peak_bytes)} | "
                  f"{fb(budget)} | infeasible: {err} | | | | |", flush=True)
            continue
        seconds = time.perf_counter() - t0
        comm = p.metadata["communication"]

        def c(kind, d):
            return f"{d[kind]['count']} x {fb(d[kind]['bytes'])}"
        print(f"| {scheme} | {mesh} | {fb(an.fixed.total)} | {fb(nr.peak_bytes)} | {fb(budget)} "
              f"| {fb(p.measured_peak_bytes)} | "
              f"{100 * (p.measured_flops - nr.flops) / nr.flops:.1f}% | "
              f"{c('all-gather', nr.communication)} -> {c('all-gather', comm)} | "
              f"{c('all-reduce', nr.communication)} -> {c('all-reduce', comm)} | "
              f"{seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
