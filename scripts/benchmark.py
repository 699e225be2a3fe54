"""Wall-clock benchmark of planned training steps against no remat and JAX's built-in
policies, and calibration of the recompute time model (remat_planner.costmodel).

For each config: the planner's analysis, JAX's built-in policies per block (on the scan
body for scanned models), and the planner's plans at each built-in policy's XLA peak
and at fractions of the feasible range, each with the FLOPs and the time objective
(identical plans are timed once). Every variant is the jitted, donated AdamW step
(verify.train_step, CPU option that keeps remat) on real random parameters and batch.
After a warm-up (compile + one step) the variants run round-robin, the order rotated
each repetition, every call blocked with block_until_ready; a measurement is `--inner`
consecutive steps (chosen so that one lasts at least --min-seconds), preceded by
`--prime` untimed steps of the same variant: on this VM a step whose temporaries were
freed a few seconds earlier pays for faulting them in from the host again (300 MB: about
1 s, against 0.03 s when reused at once), which a training loop running step after step
does not; without priming the no-remat step, with the largest temporaries, looked twice
as slow as any remat variant. Even primed, glibc's malloc hands the step's large
temporaries back to the kernel when they are freed, so every step faults them in again
(gpt2-bench without remat: 83,000 minor page faults a step, 340 MB), a cost that grows
with the peak and that an accelerator's pooling allocator does not have. The script
therefore re-runs itself with a caching allocator preloaded (`--allocator`, default
tcmalloc, Debian's libtcmalloc-minimal4; jemalloc also works): 5,600 faults a step, the
no-remat step 20% faster, and the remat variants' ratios near their FLOPs. Page faults
per step are reported for every variant. Reported: median
seconds per step and its IQR, and per repetition the ratio to the no-remat step run in
the same round (median and IQR): on a shared machine ratios measured side by side are
the figures, absolute seconds drift with the load.

Predicted overheads per variant, all from this run:
- XLA: extra FLOPs of the compiled step (cost_analysis; jaxpr count for scans);
- time (default): the roofline model at the default machine balance, from the step's
  jaxpr FLOPs and memory traffic (planner.step_traffic), for any variant;
- time (fitted): the same at the balance fitted by least squares to this run's measured
  ratios (leave-one-out errors are given too, the honest out-of-sample figure);
- planner: for plans, the DP's own prediction (plan.recompute_time_overhead).

    python scripts/benchmark.py configs/gpt2-bench.yaml configs/gpt2-tiny.yaml \\
        --reps 9 --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's remat_planner, not an installed one

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from remat_planner import baselines, costmodel  # noqa: E402
from remat_planner import planner as pl  # noqa: E402
from remat_planner.config import build_workload, load_config, make_optimizer  # noqa: E402
from remat_planner.errors import RematPlannerError  # noqa: E402
from remat_planner.step import Step  # noqa: E402
from remat_planner.verify import train_step  # noqa: E402

MiB = 2**20
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


@dataclasses.dataclass
class Variant:
    label: str
    step: object            # jitted (params, opt_state, batch) -> (params, opt_state, loss, ...)
    xla_peak: int
    xla_flops: float
    jaxpr_flops: float
    jaxpr_bytes: float
    planner_time: float | None = None   # DP's predicted time overhead (plans only)
    planner_flops: float | None = None  # DP's predicted FLOP overhead (plans only)
    segments: tuple = ()
    times: list = dataclasses.field(default_factory=list)
    faults: list = dataclasses.field(default_factory=list)  # minor page faults per step


def build_variants(wl, opt, args, say) -> tuple[list[Variant], pl.Analysis]:
    P, B = wl.abstract_params, wl.abstract_batch
    an = pl.analyze(wl.loss_fn, P, B, opt, progress=say, has_aux=wl.has_aux)
    base = pl.measure_builtin_policies(wl.loss_fn, P, B, opt, progress=say, has_aux=wl.has_aux)
    time_model = costmodel.CostModel("time")
    variants = []

    def add(label, loss, m, plan=None):
        jf, jb = pl.step_traffic(Step(loss, opt, wl.has_aux), P, B)
        v = Variant(label, train_step(loss if plan is None else wl.loss_fn, opt, plan, wl.has_aux),
                    m.peak_bytes if plan is None else plan.measured_peak_bytes,
                    m.flops if plan is None else plan.measured_flops, jf, jb)
        if plan is not None:
            v.planner_time, v.planner_flops = plan.recompute_time_overhead, plan.recompute_overhead
            v.segments = plan.segments
        variants.append(v)

    add("no remat", wl.loss_fn, base["no_remat"])
    for name in baselines.POLICIES:
        point = Step(wl.loss_fn, has_aux=wl.has_aux)
        add(name, baselines.builtin_loss(name, point, P, B), base[name])
    budgets = [] if args.no_policy_budgets else [
        (f"at {name} peak", base[name].peak_bytes) for name in baselines.POLICIES]
    low, high = an.min_feasible_budget(), base["no_remat"].peak_bytes
    budgets += [(f"{f:.2f} of range", int(low + f * (high - low)))
                for f in map(float, filter(None, args.fractions.split(",")))]
    for where, budget in budgets:
        for kind in args.objectives.split(","):
            model = time_model if kind == "time" else costmodel.CostModel("flops")
            try:
                p = pl.plan(wl.loss_fn, P, B, budget, opt, analysis=an, progress=say,
                            cost_model=model)
            except RematPlannerError as e:
                say(f"plan {where} ({kind}) infeasible: {e}")
                continue
            same = next((v for v in variants if v.segments and v.segments == p.segments), None)
            label = f"plan {kind}, {where} ({budget / MiB:.1f} MiB)"
            if same is not None:
                same.label += f" = {label}"
                continue
            add(label, p.apply(wl.loss_fn), None, p)
    return variants, an


def run_timing(variants: list[Variant], wl, opt, seed: int, reps: int, min_seconds: float,
               say, prime: int = 1) -> int:
    key = jax.random.key(seed)
    params = wl.init_params(key)
    batch = wl.synthetic_batch(jax.random.fold_in(key, 1))
    states = []
    for v in variants:  # each variant trains its own copy (params and state are donated)
        p = jax.tree.map(jnp.copy, params)
        states.append((p, opt.init(p)))

    def run(i, inner, prime=0):
        p, s = states[i]
        for _ in range(prime):  # untimed: brings the step's buffers back into memory
            out = variants[i].step(p, s, batch)
            p, s = out[0], out[1]
        jax.block_until_ready((p, s))
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(inner):
            out = variants[i].step(p, s, batch)
            p, s = out[0], out[1]
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        states[i] = (p, s)
        return dt / inner, faults / inner

    warm = []
    for i, v in enumerate(variants):
        say(f"warm-up (compile): {v.label}")
        run(i, 1)
        warm.append(run(i, 1)[0])
    inner = max(1, math.ceil(min_seconds / max(warm[0], 1e-6)))
    n = len(variants)
    for r in range(reps):
        say(f"repetition {r + 1}/{reps} ({n} variants x {inner} step(s))")
        for j in range(n):
            i = (j + r) % n
            seconds, faults = run(i, inner, prime)
            variants[i].times.append(seconds)
            variants[i].faults.append(faults)
    return inner


def quartiles(x) -> tuple[float, float, float]:
    q1, med, q3 = np.percentile(np.asarray(x, dtype=float), [25, 50, 75])
    return float(q1), float(med), float(q3)


def analyse(variants: list[Variant], an: pl.Analysis) -> dict:
    base = variants[0]
    t0 = np.asarray(base.times)
    rows = []
    for v in variants:
        ratios = np.asarray(v.times) / t0
        rows.append({"variant": v, "time": quartiles(v.times), "ratio": quartiles(ratios)})
    points = [(v.jaxpr_flops, v.jaxpr_bytes, base.jaxpr_flops, base.jaxpr_bytes,
               r["ratio"][1] - 1.0) for v, r in zip(variants, rows)]
    fit_b, fit_rms = costmodel.fit_balance(points)
    # Leave-one-out: each variant predicted by the balance fitted without it.
    loo = []
    for i in range(1, len(points)):
        b, _ = costmodel.fit_balance(points[:i] + points[i + 1:])
        loo.append(costmodel.predicted_overhead(b, *points[i][:4]) - points[i][4])
    default_b = costmodel.CostModel().balance
    for row, pt in zip(rows, points):
        v = row["variant"]
        row["measured"] = pt[4]
        row["xla_flops"] = (v.xla_flops - base.xla_flops) / base.xla_flops
        row["time_default"] = costmodel.predicted_overhead(default_b, *pt[:4])
        row["time_fitted"] = costmodel.predicted_overhead(fit_b, *pt[:4])
        row["flops_only"] = costmodel.predicted_overhead(0.0, *pt[:4])
    # Exploratory, not used by the planner: overhead ~ a * (extra XLA FLOPs share) +
    # g * (XLA peak change share), a 2-parameter least squares without intercept.
    X = np.array([[r["xla_flops"], (r["variant"].xla_peak - base.xla_peak) / base.xla_peak]
                  for r in rows[1:]])
    y = np.array([r["measured"] for r in rows[1:]])
    coef = np.linalg.lstsq(X, y, rcond=None)[0] if len(y) >= 2 else np.zeros(2)
    loo_fp = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        if keep.sum() >= 2:
            c = np.linalg.lstsq(X[keep], y[keep], rcond=None)[0]
            loo_fp.append(float(X[i] @ c - y[i]))
    for r, x in zip(rows, np.vstack([[0.0, 0.0], X])):
        r["footprint"] = float(x @ coef)
    rms = lambda key: float(np.sqrt(np.mean([(r[key] - r["measured"]) ** 2 for r in rows[1:]])))
    t_noremat = rows[0]["time"][1]
    return {
        "rows": rows, "fitted_balance": fit_b, "default_balance": default_b,
        "fitted_flops_per_second": (base.jaxpr_flops + fit_b * base.jaxpr_bytes) / t_noremat,
        "rms": {"xla_flops": rms("xla_flops"), "flops_only": rms("flops_only"),
                "time_default": rms("time_default"), "time_fitted": rms("time_fitted"),
                "time_fitted_loo": float(np.sqrt(np.mean(np.square(loo)))) if loo else None,
                "footprint": rms("footprint"),
                "footprint_loo": float(np.sqrt(np.mean(np.square(loo_fp)))) if loo_fp else None},
        "footprint_coef": [float(c) for c in coef],
    }


def markdown(config: str, wl, an, res: dict, inner: int, reps: int, args_prime: int) -> str:
    pc = lambda x: "" if x is None else f"{100 * x:+.1f}%"
    out = [f"### {config} ({wl.param_count:,} parameters; {an.chain.n} stages)", ""]
    out.append(f"{reps} repetitions after warm-up, {inner} step(s) per measurement after "
               f"{args_prime} untimed one(s). "
               "Ratio: seconds / no-remat seconds in the same round, median [IQR]. "
               "Predicted overheads: extra XLA FLOPs; the time model at the default balance "
               f"({res['default_balance']:.1f} FLOP/byte) and at the balance fitted to this "
               f"run ({res['fitted_balance']:.1f} FLOP/byte); the planner's DP prediction "
               "(plans). Diff: time (fitted) minus measured, percentage points.")
    out.append("")
    out.append("| variant | XLA peak MiB | median s/step [IQR] | page faults/step | ratio [IQR] "
               "| measured overhead | XLA FLOPs | time (default) | time (fitted) "
               "| planner (time / FLOPs) | diff pp | FLOPs + footprint |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        v = r["variant"]
        q1, med, q3 = r["time"]
        rq1, rmed, rq3 = r["ratio"]
        planner = ("" if v.planner_time is None
                   else f"{pc(v.planner_time)} / {pc(v.planner_flops)}")
        out.append(f"| {v.label} | {v.xla_peak / MiB:.1f} | {med:.4f} [{q1:.4f}, {q3:.4f}] | "
                   f"{np.median(v.faults):,.0f} | "
                   f"{rmed:.3f} [{rq1:.3f}, {rq3:.3f}] | {pc(r['measured'])} | "
                   f"{pc(r['xla_flops'])} | {pc(r['time_default'])} | {pc(r['time_fitted'])} | "
                   f"{planner} | {100 * (r['time_fitted'] - r['measured']):+.1f} | "
                   f"{pc(r['footprint'])} |")
    e = res["rms"]
    out += ["", f"RMS error of predicted vs measured overhead over the remat variants: XLA "
                f"FLOPs {100 * e['xla_flops']:.1f} pp, jaxpr FLOPs only "
                f"{100 * e['flops_only']:.1f} pp, time model default "
                f"{100 * e['time_default']:.1f} pp, fitted {100 * e['time_fitted']:.1f} pp "
                f"(leave-one-out {100 * (e['time_fitted_loo'] or 0):.1f} pp). Fitted constants: "
                f"balance {res['fitted_balance']:.1f} FLOP/byte, "
                f"{res['fitted_flops_per_second'] / 1e9:.1f} GFLOP/s, bandwidth "
                + (f"{res['fitted_flops_per_second'] / res['fitted_balance'] / 1e9:.2f} GB/s."
                   if res["fitted_balance"] >= 0.01 else "unbounded (no byte term)."), ""]
    a, g = res["footprint_coef"]
    out += [f"Exploratory (not in the planner): overhead ~ {a:.2f} x (extra XLA FLOPs share) "
            f"{g:+.2f} x (XLA peak change share), fitted to this run: RMS "
            f"{100 * e['footprint']:.1f} pp, leave-one-out "
            f"{100 * (e['footprint_loo'] or 0):.1f} pp (column FLOPs + footprint).", ""]
    return "\n".join(out)


def header(argv, machine: costmodel.CostModel | None) -> str:
    import jaxlib
    lines = [f"Produced by `python scripts/benchmark.py {shlex.join(argv)}` on "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; jax "
             f"{jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}; "
             f"machine: {platform.machine()} {platform.processor() or ''} with "
             f"{len(os.sched_getaffinity(0))} CPU cores available (shared with other jobs); "
             f"allocator: {loaded_allocator() or 'the system malloc (no caching allocator preloaded)'}.",
             ""]
    if machine is not None:
        lines += [f"Micro-benchmarks (costmodel.measure_machine): matmul "
                  f"{machine.flops_per_second / 1e9:.1f} GFLOP/s, fused elementwise "
                  f"{machine.bytes_per_second / 1e9:.2f} GB/s, balance "
                  f"{machine.balance:.1f} FLOP/byte.", ""]
    return "\n".join(lines)


# Caching allocators the script can preload (library names for ctypes.util.find_library).
ALLOCATORS = {"tcmalloc": "tcmalloc_minimal", "jemalloc": "jemalloc"}


def loaded_allocator() -> str | None:
    """The caching allocator mapped into this process, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((name for name, lib in ALLOCATORS.items() if f"lib{lib}" in maps), None)


def preload_allocator(choice: str, argv: list[str]) -> None:
    """Re-run this script with the caching allocator `choice` preloaded (LD_PRELOAD takes
    effect at process start only); return if it is loaded already, or `choice` is
    `system`, or the library is not installed (a warning names the package)."""
    if choice == "system" or loaded_allocator() is not None:
        return
    names = list(ALLOCATORS) if choice == "auto" else [choice]
    for name in names:
        lib = ctypes.util.find_library(ALLOCATORS[name])
        if lib:
            env = dict(os.environ)
            env["LD_PRELOAD"] = " ".join(filter(None, [env.get("LD_PRELOAD"), lib]))
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    print(f"benchmark: no caching allocator found ({', '.join(names)}); timing with the system "
          "malloc, whose per-step page faults favour low-peak variants (apt-get install "
          "libtcmalloc-minimal4)", file=sys.stderr)


def write_markdown(path: Path, body: str) -> None:
    block = f"{BEGIN}\n{body}\n{END}"
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            path.write_text(head + block + rest.split(END, 1)[1])
            return
        path.write_text(text.rstrip() + "\n\n" + block + "\n")
        return
    path.write_text(f"# Benchmarks\n\n{block}\n")


def main(argv=None, reexec: bool = False) -> int:
    """Run the benchmark; with `reexec` (the command line) first re-run the script under
    the chosen caching allocator."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions after warm-up")
    ap.add_argument("--min-seconds", type=float, default=0.05,
                    help="consecutive steps per measurement so that one lasts this long")
    ap.add_argument("--prime", type=int, default=1,
                    help="untimed steps before each measurement (see the module docstring)")
    ap.add_argument("--fractions", default="0.2,0.5",
                    help="extra budgets, as fractions from smallest feasible to no remat")
    ap.add_argument("--no-policy-budgets", action="store_true",
                    help="do not plan at the built-in policies' XLA peaks")
    ap.add_argument("--objectives", default="flops,time",
                    help="planner cost models to plan with (comma-separated: flops,time)")
    ap.add_argument("--markdown", metavar="FILE", help="write the tables into FILE between "
                    f"{BEGIN} and {END} (created if missing)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--no-micro", action="store_true", help="skip the machine micro-benchmarks")
    ap.add_argument("--allocator", choices=["auto", *ALLOCATORS, "system"], default="auto",
                    help="caching allocator to re-run under (LD_PRELOAD; see the module "
                    "docstring); auto: tcmalloc, else jemalloc, else the system malloc")
    args = ap.parse_args(argv)
    if reexec:
        preload_allocator(args.allocator, argv)
    t_start = time.perf_counter()
    say = lambda m: print(f"[{time.perf_counter() - t_start:6.1f}s] {m}", file=sys.stderr,
                          flush=True)
    machine = None if args.no_micro else costmodel.measure_machine()
    sections, dump = [header(argv, machine)], {}
    for config in args.configs:
        cfg = load_config(config)
        wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
        variants, an = build_variants(wl, opt, args, say)
        inner = run_timing(variants, wl, opt, cfg.seed, args.reps, args.min_seconds, say,
                           args.prime)
        res = analyse(variants, an)
        text = markdown(config, wl, an, res, inner, args.reps, args.prime)
        print(text, flush=True)
        sections.append(text)
        dump[config] = {
            "fitted_balance": res["fitted_balance"], "default_balance": res["default_balance"],
            "fitted_flops_per_second": res["fitted_flops_per_second"], "rms": res["rms"],
            "footprint_coef": res["footprint_coef"],
            "inner": inner,
            "variants": [{"label": r["variant"].label, "xla_peak_bytes": r["variant"].xla_peak,
                          "times": r["variant"].times, "page_faults": r["variant"].faults,
                          "ratio_quartiles": r["ratio"],
                          "measured_overhead": r["measured"], "xla_flops_overhead": r["xla_flops"],
                          "time_default": r["time_default"], "time_fitted": r["time_fitted"],
                          "planner_time": r["variant"].planner_time,
                          "planner_flops": r["variant"].planner_flops,
                          "jaxpr_flops": r["variant"].jaxpr_flops,
                          "jaxpr_bytes": r["variant"].jaxpr_bytes} for r in res["rows"]]}
    if machine is not None:
        dump["machine"] = dataclasses.asdict(machine)
    if args.markdown:
        write_markdown(Path(args.markdown), "\n".join(sections))
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(reexec=True))
