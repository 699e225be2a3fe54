"""Time planning of a scanned GPT (d=2048) at 12, 48 and 96 layers on this machine.

Each run is `remat_planner.plan` from scratch on abstract shapes: trace, profile the
layer stack once (its body's sub-stages, XLA workspaces), the calibration compiles
(the step without remat and with the stack checkpointed, side by side), the solve,
and the closed loop's XLA verification(s). The budget sits a third of the way from the
smallest feasible budget to the no-remat peak. Phases are timed from the planner's
progress messages; CPU seconds (all threads) are reported too, since wall time on a
shared machine includes waiting for the cores.

    python scripts/scan_timing.py [--layers 12 48 96] [--batch 4] [--seq 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import optax

from remat_planner import planner
from remat_planner.models.gpt2_workload import GPT2Settings, build_gpt2


def time_one(n_layer: int, batch: int, seq: int) -> dict:
    settings = GPT2Settings(n_layer=n_layer, d_model=2048, n_head=16, max_seq_len=max(seq, 1024),
                            scan_layers=True)
    wl = build_gpt2(settings, batch, seq)
    optimizer = optax.adamw(3e-4)
    marks: list[tuple[str, float]] = []
    say = lambda msg: marks.append((msg, time.perf_counter()))

    t0, c0 = time.perf_counter(), time.process_time()
    an = planner.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer,
                         progress=say)
    t_analysis = time.perf_counter() - t0
    budget = int(an.min_feasible_budget() + (an.noremat.peak_bytes - an.min_feasible_budget()) / 3)
    t1 = time.perf_counter()
    plan = planner.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                        analysis=an, progress=say)
    t_plan = time.perf_counter() - t1
    cpu = time.process_time() - c0

    def since(prefix: str) -> float:
        """Seconds from the first message starting with `prefix` to the next message."""
        times = [t for _, t in marks] + [t1 + t_plan]
        for i, (msg, t) in enumerate(marks):
            if msg.startswith(prefix):
                return times[i + 1] - t
        return 0.0

    verify = sum(b - a for (m, a), b in zip(marks, [t for _, t in marks[1:]] + [t1 + t_plan])
                 if m.startswith("verifying"))
    return {
        "n_layer": n_layer, "batch": batch, "seq": seq, "params": wl.param_count,
        "seconds_total": round(t_analysis + t_plan, 2),
        "cpu_seconds_total": round(cpu, 2),  # all threads; wall time on a busy machine is more
        "seconds_trace_and_profile": round(t_analysis - since("measuring the step"), 2),
        "seconds_calibration": round(since("measuring the step"), 2),
        "seconds_solve_and_verify": round(t_plan, 2),
        "seconds_verify": round(verify, 2),
        "verify_rounds": plan.metadata.get("verify_rounds"),
        "budget_bytes": budget, "measured_peak_bytes": plan.measured_peak_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "noremat_peak_bytes": an.noremat.peak_bytes,
        "recompute_overhead": round(plan.recompute_overhead, 4),
        "scan_scheme": [s.option for s in plan.segments],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [time_one(n, args.batch, args.seq) for n in args.layers]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['n_layer']:3d} layers ({r['params'] / 1e9:.2f}B params): {r['seconds_total']:5.1f}s "
              f"(CPU {r['cpu_seconds_total']:.1f}s) "
              f"= trace+profile {r['seconds_trace_and_profile']:.1f}s + calibration "
              f"{r['seconds_calibration']:.1f}s + solve+verify {r['seconds_solve_and_verify']:.1f}s "
              f"({r['verify_rounds']} XLA verification(s), {r['seconds_verify']:.1f}s); "
              f"budget {r['budget_bytes'] / 1e9:.1f} GB, XLA {r['measured_peak_bytes'] / 1e9:.1f} GB, "
              f"overhead {100 * r['recompute_overhead']:.1f}%, {r['scan_scheme'][1:2]}")


if __name__ == "__main__":
    main()
