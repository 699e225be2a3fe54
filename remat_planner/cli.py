"""`remat-plan`: plan, verify and train from a YAML config. A thin layer over the API.

Exit codes: 0 ok; 2 bad input (missing file, bad YAML, unknown model or field, bad
budget, a --plan file for another step, unwritable --out, --points below 12); 3 budget
infeasible (the message states the smallest feasible budget; with --max-batch,
infeasible even at batch size 1; with --plan, the saved plan's XLA peak is above it);
1 unexpected internal error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .constants import MIN_POINTS

EXIT_CODES = """exit codes:
  0  success
  2  bad input: missing/unreadable config, invalid YAML, unknown model type or field,
     wrong field type, unparseable or non-positive budget, plan file mismatch,
     unwritable --out, frontier --points below 12
  3  budget infeasible: below the smallest feasible plan (the message states it);
     --max-batch: no plan fits even at batch size 1; --plan: the saved plan's XLA
     peak is above the budget
  1  unexpected internal error (please report it)"""


def _parser(prog: str, description: str, example: str) -> argparse.ArgumentParser:
    """A parser with the arguments every command shares: CONFIG, --budget, overrides."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help=f"YAML config, e.g. {example}")
    p.add_argument("--budget",
                   help="memory for the whole step: params + grads + optimizer state + batch + "
                        "activations, e.g. 12GB (10^9) or 11GiB (2^30) or bytes; sizes are "
                        "shown in the family you type (GB in, GB out; GiB in, GiB out; plain "
                        "bytes: GB). Required unless --plan gives a saved plan (then its budget)")
    p.add_argument("--plan", metavar="PLAN.json",
                   help="use a plan saved with --out instead of planning: it is checked against "
                        "this config (a plan for another model, batch or dtype is refused, exit "
                        "2) and verified against the budget with XLA")
    p.add_argument("--batch-size", type=int, help="override the config's batch_size")
    p.add_argument("--seq-len", type=int, help="override the config's seq_len")
    p.add_argument("--mesh", help="device mesh for a sharded step, e.g. data=4,model=2 "
                                  "(overrides the config's mesh:); the budget is then per device")
    p.add_argument("--sharding", help="sharding scheme over the mesh: dp, fsdp, tp or fsdp+tp "
                                      "(overrides the config's sharding:)")
    p.add_argument("--cpu-devices", type=int, metavar="N",
                   help="simulate N devices on the host CPU (compile-time planning of a mesh "
                        "on a machine without it; sets jax_num_cpu_devices before JAX starts)")
    p.add_argument("--cost-model", choices=("flops", "time"),
                   help="what the planner minimises: recompute FLOPs (default) or recompute "
                        "time by the roofline model; overrides the config's cost_model")
    return p


def _plan_parser() -> argparse.ArgumentParser:
    p = _parser("remat-plan",
                "Plan activation rematerialization for a JAX training step so it fits a "
                "memory budget, verify the fit with XLA, and compare with JAX's built-in "
                "checkpoint policies. Subcommands: `remat-plan explain CONFIG ...` shows "
                "what the plan keeps and recomputes and draws memory.png; "
                "`remat-plan train CONFIG ...` runs training steps with the plan; "
                "`remat-plan frontier CONFIG --out DIR` measures the memory/recompute "
                "frontier against JAX's built-in policies.",
                "configs/gpt2-small.yaml")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan to this file")
    p.add_argument("--no-verify", action="store_true",
                   help="skip compiling with XLA (no measured peaks, no policy comparison)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip measuring JAX's built-in per-block policies")
    p.add_argument("--max-batch", action="store_true",
                   help="search for the largest batch size whose planned step fits the budget "
                        "(and the largest without remat and with each built-in policy), every "
                        "answer verified with XLA; --batch-size sets where the search starts")
    return p


def _train_parser() -> argparse.ArgumentParser:
    p = _parser("remat-plan train",
                "Plan for the budget, then run real optimizer steps on synthetic data on "
                "this machine with the plan applied.", "configs/gpt2-tiny.yaml")
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    p.add_argument("--json", action="store_true", help="print the loss curve as JSON")
    return p


def _explain_parser() -> argparse.ArgumentParser:
    p = _parser("remat-plan explain",
                "Plan for the budget and explain it: per segment (by Flax module) the "
                "tensors it keeps, what it recomputes and what that costs, the nesting as a "
                "tree; with --out, explain.json and memory.png (modelled live bytes over the "
                "step with and without the plan, XLA peaks as points).",
                "configs/gpt2-small.yaml")
    p.add_argument("--out", metavar="DIR", help="write explain.json and memory.png here")
    p.set_defaults(out_is_dir=True)
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.add_argument("--no-verify", action="store_true", help="skip XLA (model only)")
    return p


def _frontier_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remat-plan frontier",
        description="Measure the memory/recompute frontier: analyse the step once, plan it "
                    "at budgets from the smallest feasible to the no-remat peak (each plan "
                    "verified with XLA) and at the XLA peak of each JAX built-in policy, and "
                    "write frontier.csv, frontier.png and frontier.md to --out.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config, e.g. configs/gpt2-small.yaml")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for frontier.csv, frontier.png, frontier.md (created)")
    p.add_argument("--points", type=int, default=MIN_POINTS,
                   help=f"budgets in the sweep (default and minimum {MIN_POINTS})")
    p.add_argument("--batch-size", type=int, help="override the config's batch_size")
    p.add_argument("--seq-len", type=int, help="override the config's seq_len")
    p.add_argument("--json", action="store_true", help="print every point as one JSON object")
    p.set_defaults(out_is_dir=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = _join_negative_budget(list(sys.argv[1:] if argv is None else argv))
    from .errors import InfeasibleBudgetError, RematPlannerError
    args = None
    try:
        if argv[:1] == ["explain"]:
            args = _parse(_explain_parser(), argv[1:])
            return _explain(args)
        if argv[:1] == ["train"]:
            args = _parse(_train_parser(), argv[1:])
            return _train(args)
        if argv[:1] == ["frontier"]:
            args = _frontier_parser().parse_args(argv[1:])
            return _frontier(args)
        args = _parse(_plan_parser(), argv)
        if args.max_batch:
            if args.plan:
                from .errors import ConfigError
                raise ConfigError("--max-batch plans every batch size it probes; drop --plan")
            return _max_batch(args)
        return _plan(args)
    except InfeasibleBudgetError as e:
        units = getattr(args, "units", None)
        if units is not None:
            e = e.in_units(units)
        print(f"remat-plan: error: {e}", file=sys.stderr)
        return e.exit_code
    except RematPlannerError as e:
        print(f"remat-plan: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("remat-plan: interrupted", file=sys.stderr)
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    """Parse; a command that takes --budget needs it unless --plan names a saved plan."""
    args = parser.parse_args(argv)
    if args.budget is None and getattr(args, "plan", None) is None:
        parser.error("the following arguments are required: --budget (or --plan PLAN.json)")
    args.units = None
    return args


def _console(stderr: bool = False):
    """A rich Console. Piped or redirected (not a terminal), it is wide enough that no
    table cell is cut (cells that still do not fit wrap: no column truncates)."""
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=200)


def _cols(table, *names: str, left: tuple[str, ...] = ()) -> None:
    """Add columns that wrap (never cut) their cells; `left` ones left-justified, the rest
    right-justified."""
    for n in names:
        table.add_column(n, justify="left" if n in left else "right", overflow="fold")


def _join_negative_budget(argv: list[str]) -> list[str]:
    """`--budget -5GB` would read as an unknown option; join it so the budget parser can
    say what is wrong with the value."""
    out = []
    i = 0
    while i < len(argv):
        if argv[i] == "--budget" and i + 1 < len(argv) and argv[i + 1][:1] == "-" \
                and argv[i + 1][1:2].isdigit():
            out.append(f"--budget={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _check_writable(path: str | None, *, directory: bool = False) -> None:
    """Fail before minutes of planning, not after, when an output path cannot be written.

    A file's directory must exist; a directory (explain --out) is created, so its nearest
    existing ancestor must be writable."""
    import os

    from .errors import ConfigError
    if not path:
        return
    target = os.path.abspath(path)
    parent = target if directory else os.path.dirname(target)
    if directory:
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot write --out {path!r}: {parent!r} is not a writable directory; "
                          "choose another path")


_OVERRIDES = (("batch_size", "--batch-size"), ("seq_len", "--seq-len"), ("mesh", "--mesh"),
              ("sharding", "--sharding"))


def _check_flags(args) -> None:
    """A bad flag value is the flag's fault, not the config file's: say so first."""
    from .errors import ConfigError
    for field, flag in _OVERRIDES[:2]:
        value = getattr(args, field, None)
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} {value}: must be greater than 0 (it overrides the "
                              f"config's field '{field}')")


def _blame_flags(args, err):
    """A ConfigError about a field a flag overrode, reworded to name the flag."""
    from .errors import ConfigError
    text = str(err)
    for field, flag in _OVERRIDES:
        value = getattr(args, field, None)
        if value is None:
            continue
        for marker in (f"field '{field}': ", f"field '{field}'"):
            if marker in text:
                source, _, rest = text.partition(marker)
                where = source.rstrip(": ")
                rest = rest.replace(f" {field} ", f" {flag} ")
                return ConfigError(f"{flag} {value}: {rest or 'invalid'} (it overrides "
                                   f"the field '{field}' of {where})")
    return err


def _load_config(args):
    from .config import load_config
    from .errors import ConfigError
    _check_flags(args)
    try:
        return load_config(args.config, batch_size=args.batch_size, seq_len=args.seq_len,
                           mesh=getattr(args, "mesh", None),
                           sharding=getattr(args, "sharding", None))
    except ConfigError as e:
        raise _blame_flags(args, e) from None


def _build_workload(args, cfg):
    from .config import build_workload
    from .errors import ConfigError
    try:
        return build_workload(cfg)
    except ConfigError as e:
        raise _blame_flags(args, e) from None


def _load(args):
    from .budget import parse_budget, units_of
    from .units import DEFAULT_UNITS, Units
    _check_writable(getattr(args, "out", None), directory=getattr(args, "out_is_dir", False))
    if args.cpu_devices is not None:
        from .errors import ConfigError
        if args.cpu_devices < 1:
            raise ConfigError(f"--cpu-devices must be positive, got {args.cpu_devices}")
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from .config import make_optimizer, sharding_spec
    budget = None if args.budget is None else parse_budget(args.budget)
    args.units = units_of(args.budget) if args.budget is not None else DEFAULT_UNITS
    cfg = _load_config(args)
    args.spec = sharding_spec(cfg)
    wl = _build_workload(args, cfg)
    if args.spec is not None and args.spec.model_axis:
        # the tp layout (which kernels stay replicated) once, for the planner and the
        # built-in policies it is compared with alike
        from .sharding import with_unpaired
        args.spec = with_unpaired(_step(wl, None, args.spec), wl.abstract_params,
                                  wl.abstract_batch)
    args.saved_plan = None
    if getattr(args, "plan", None):
        args.saved_plan = _saved_plan(args.plan, wl, args.spec)
        if budget is None:  # the saved plan's own budget, in the units it was given in
            budget = args.saved_plan.budget_bytes
            args.units = Units(args.saved_plan.metadata.get("units", DEFAULT_UNITS.value))
    return cfg, wl, make_optimizer(cfg.optimizer), budget


def _saved_plan(path: str, wl, spec):
    """The plan saved in `path`, checked against this step: one line naming what differs
    (PlanMismatchError, exit 2) for another model, batch shape, dtype or sharding."""
    from .apply import check_matches
    from .errors import ConfigError, PlanMismatchError
    from .plan import Plan
    from .trace import trace
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"cannot read --plan {path!r}: {why}; pass a plan file written by "
                          "remat-plan --out") from None
    try:
        plan = Plan.from_json(text)
    except PlanMismatchError as e:
        raise PlanMismatchError(f"--plan {path}: {e}") from None
    theirs = plan.sharding.to_dict() if plan.sharding is not None else None
    ours = spec.to_dict() if spec is not None else None
    if (theirs is None) != (ours is None) or (ours is not None and (
            theirs.get("scheme"), theirs.get("mesh")) != (ours.get("scheme"), ours.get("mesh"))):
        def name(d):
            return "one device" if d is None else f"{d.get('scheme')} on mesh {d.get('mesh')}"
        raise PlanMismatchError(f"--plan {path} was made for another step: sharding: "
                                f"{name(ours)} (plan: {name(theirs)}); re-plan for this step")
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch, has_aux=wl.has_aux)
    try:
        check_matches(plan, program, wl.abstract_params, wl.abstract_batch)
    except PlanMismatchError as e:
        what = str(e).removeprefix("plan does not match this computation: ")
        raise PlanMismatchError(f"--plan {path} was made for another step: {what}") from None
    return plan


def _step(wl, optimizer, spec):
    """The training step of workload `wl` (step.Step) with `optimizer`, sharded by `spec`."""
    from .step import Step
    return Step(wl.loss_fn, optimizer, wl.has_aux, spec)


def _verify_saved(plan, wl, step, budget: int, verify: bool = True):
    """A saved plan held against `budget`: XLA's peak and FLOPs of `step` (a step.Step
    of workload `wl`) planned by it."""
    import dataclasses

    from .verify import measure_step
    plan = dataclasses.replace(plan, budget_bytes=int(budget),
                               metadata={**plan.metadata,
                                         "saved_budget_bytes": plan.budget_bytes})
    if not verify:
        return dataclasses.replace(plan, measured_peak_bytes=None, measured_flops=None)
    m = measure_step(step.planned(plan), wl.abstract_params, wl.abstract_batch)
    return dataclasses.replace(plan, measured_peak_bytes=m.peak_bytes, measured_flops=m.flops)


def _saved_or_new_plan(args, cfg, wl, optimizer, budget, verify, say):
    """(analysis, plan): the --plan FILE verified with XLA against `budget`, or a new plan."""
    from . import planner as pl

    if args.saved_plan is not None:
        an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer,
                        calibrate=verify, progress=say, has_aux=wl.has_aux, sharding=args.spec)
        say(f"verifying the saved plan {args.plan} with XLA")
        return an, _verify_saved(args.saved_plan, wl, _step(wl, optimizer, args.spec), budget,
                                 verify)
    return _analyze_and_plan(wl, optimizer, budget, verify, say, args.spec,
                             _cost_model(args, cfg))


def _with_units(plan, units, an=None):
    """The plan with the budget's unit family in its metadata, so a later --plan shows
    sizes in the same family, and (given the analysis) the roles of a scanned layer's
    sub-stages, so that print(plan) names them without the analysis."""
    import dataclasses

    from .describe import sub_stage_labels
    extra = {"units": units.value}
    if an is not None and sub_stage_labels(an):
        extra["scan_sub_stages"] = sub_stage_labels(an)
    return dataclasses.replace(plan, metadata={**plan.metadata, **extra})


def _progress(console, enabled: bool):
    """A status spinner on stderr that shows the pipeline's current step."""
    if not enabled:
        return None, (lambda msg: None)
    status = console.status("starting", spinner="dots")
    status.start()
    t0 = time.perf_counter()
    return status, (lambda msg: status.update(f"[{time.perf_counter() - t0:5.1f}s] {msg}"))


def _cost_model(args, cfg) -> str:
    return getattr(args, "cost_model", None) or cfg.cost_model


def _analyze_and_plan(wl, optimizer, budget: int, verify: bool, say, spec=None,
                      cost_model: str = "flops"):
    """The pipeline on a workload: one analysis (calibrated when verifying), one plan."""
    from . import planner as pl
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer,
                    calibrate=verify, progress=say, has_aux=wl.has_aux, sharding=spec)
    plan = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                   verify=verify, analysis=an, progress=say, cost_model=cost_model)
    return an, plan


def _plan(args) -> int:
    from . import baselines as bl
    from .verify import measure_step

    err = _console(stderr=True)
    cfg, wl, optimizer, budget = _load(args)
    status, say = _progress(err, err.is_terminal and not args.json)
    t0 = time.perf_counter()
    verify = not args.no_verify
    compare = verify and not args.no_compare
    # The built-in policies do not depend on the plan: measure them on a worker thread
    # while the planner runs (XLA compiles release the GIL, so the two overlap).
    pool = ThreadPoolExecutor(max_workers=1) if compare else None
    futures = {}
    if pool is not None:
        for name in bl.POLICIES:
            step = _step(wl, optimizer, args.spec)
            loss = bl.builtin_loss(name, step, wl.abstract_params, wl.abstract_batch)
            futures[name] = pool.submit(measure_step, step.with_loss(loss), wl.abstract_params,
                                        wl.abstract_batch)
    try:
        an, plan = _saved_or_new_plan(args, cfg, wl, optimizer, budget, verify, say)
        baselines = {}
        if compare:
            baselines[bl.NO_REMAT] = an.noremat
            say("measuring JAX's built-in policies per block")
            for name, fut in futures.items():
                baselines[name] = fut.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if status is not None:
            status.stop()
    seconds = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            f.write(_with_units(plan, args.units, an).to_json())
    report = _report(cfg, wl, an, plan, baselines, seconds)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_report(report, plan, an, args.units, args.plan)
        if args.out:
            _console().print(f"plan written to {args.out}", markup=False, highlight=False)
    if args.saved_plan is not None and plan.fits() is False:
        raise _over_budget(args, plan, "")
    return 0


def _over_budget(args, plan, command: str):
    """The one-line error for a saved plan that XLA finds above the budget (exit 3)."""
    from .errors import PlanOverBudgetError
    fb = args.units.format
    budget = fb(plan.budget_bytes).replace(" ", "")
    return PlanOverBudgetError(
        f"the saved plan {args.plan} does not fit the budget: XLA peak "
        f"{fb(plan.measured_peak_bytes)} > {fb(plan.budget_bytes)}; raise --budget to at least "
        f"{fb(round_up(plan.measured_peak_bytes, args.units))} or re-plan: remat-plan "
        f"{command}{args.config} --budget {budget} --out NEW.json")


def round_up(n: int, units) -> int:
    from .units import round_up_display
    return round_up_display(n, units)


def _report(cfg, wl, an, plan, baselines, seconds) -> dict:
    noremat_flops = an.noremat.flops if an.noremat else None

    def overhead(m):
        return None if not noremat_flops else (m.flops - noremat_flops) / noremat_flops

    sharded = {} if an.sharding is None else {"sharding": {
        **an.sharding.to_dict(), "devices": an.sharding.n_devices, "budget_is": "per device",
        "collective_outputs_kept": len(an.pinned),
        "communication_no_remat": an.noremat.communication if an.noremat else None,
        "communication_plan": plan.metadata.get("communication")}}
    return {
        "config": str(cfg.type),
        "model": {**wl.info, "param_count": wl.param_count},
        **sharded,
        "budget_bytes": plan.budget_bytes,
        "fixed": {"params_bytes": an.fixed.params_bytes, "grads_bytes": an.fixed.grads_bytes,
                  # of grads_bytes, those live only in their stage's backward (not in total)
                  "staged_grads_bytes": an.fixed.staged_grads_bytes,
                  # of grads_bytes, the others: live from the backward on (not in total)
                  "timed_grads_bytes": an.fixed.timed_grads_bytes,
                  "opt_state_bytes": an.fixed.opt_state_bytes,
                  "batch_bytes": an.fixed.batch_bytes, "total_bytes": an.fixed.total},
        "no_remat": {"predicted_peak_bytes": an.noremat_predicted_peak,
                     "measured_peak_bytes": an.noremat.peak_bytes if an.noremat else None,
                     "flops": noremat_flops},
        "plan": {
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": plan.measured_peak_bytes,
            "fits": plan.fits(),
            "recompute_flops_predicted": plan.recompute_flops,
            "recompute_overhead_predicted": plan.recompute_overhead,
            "cost_model": plan.metadata.get("cost_model"),
            "recompute_time_overhead_predicted": plan.recompute_time_overhead,
            "measured_flops": plan.measured_flops,
            "recompute_overhead_measured": (None if plan.measured_flops is None or not noremat_flops
                                            else (plan.measured_flops - noremat_flops) / noremat_flops),
            "segments": [_segment_row(plan, s) for s in plan.segments],
        },
        "builtin_policies": {name: {"measured_peak_bytes": m.peak_bytes, "flops": m.flops,
                                    "recompute_overhead": overhead(m)}
                             for name, m in baselines.items()},
        "seconds": round(seconds, 2),
    }


def _segment_row(plan, seg, depth: int = 0) -> dict:
    names = [plan.stages[i].name for i in range(seg.start, seg.stop)]
    row = {"stages": [seg.start, seg.stop], "modules": names[0] if len(names) == 1
           else f"{names[0]} .. {names[-1]}", "keep": seg.option, "saved_values": len(seg.saved)}
    if seg.children:
        row["children"] = [_segment_row(plan, c, depth + 1) for c in seg.children]
    return row


# What each row of the step-memory table means, one line each.
_MEANING = {
    "params": "the model's parameters",
    "grads": "one gradient per parameter",
    "staged": "freed once their update is applied, so not in the total",
    "timed": "absent in the forward, so charged where they exist, not in the total",
    "opt_state": "optimizer state (Adam/AdamW: two moments per parameter)",
    "batch": "the step's inputs",
    "total": "held through the whole step, whatever the plan",
    "no_remat": "XLA's peak of the step as written, without remat",
    "budget": "what you asked for (--budget): the whole step's memory",
    "predicted": "the memory model's peak of the planned step",
    "measured": "XLA's buffer assignment of the compiled planned step: the figure that "
                "proves the fit",
    "overhead": "extra FLOPs spent recomputing, as a share of the step without remat: by "
                "the cost model, and counted by XLA in the compiled step (trust XLA's)",
    "time": "predicted extra step time by the roofline model (FLOPs and bytes moved per "
            "recomputed equation); --cost-model time minimises it",
}


def _print_report(report: dict, plan, an, units, plan_file: str | None = None) -> None:
    from rich.table import Table

    from .describe import summary
    fb = units.format
    console = _console()
    m = report["model"]
    head = Table(title="model", show_header=False)
    _cols(head, "field", "value", left=("field", "value"))
    for k, v in m.items():
        head.add_row(k, ("yes" if v else "no") if isinstance(v, bool)
                     else f"{v:,}" if isinstance(v, int) else str(v))
    sh = report.get("sharding")
    if sh:
        head.add_row("sharding", f"{sh['scheme']} on mesh {sh['mesh']} ({sh['devices']} devices); "
                                 "every figure below is per device")
    console.print(head)

    mem = Table(title=f"step memory ({units.example})", show_header=True)
    _cols(mem, "what", "size", "meaning", left=("what", "meaning"))
    mem.columns[2].max_width = 72
    fx = report["fixed"]
    for k in ("params_bytes", "grads_bytes", "opt_state_bytes", "batch_bytes", "total_bytes"):
        mem.add_row(f"fixed: {k[:-6].replace('_', ' ')}", fb(fx[k]), _MEANING[k[:-6]])
        if k == "grads_bytes" and fx["staged_grads_bytes"]:
            mem.add_row("  of which live only in their stage's backward",
                        fb(fx["staged_grads_bytes"]), _MEANING["staged"])
        if k == "grads_bytes" and fx.get("timed_grads_bytes"):
            mem.add_row("  of which live from the backward on", fb(fx["timed_grads_bytes"]),
                        _MEANING["timed"])
    nr = report["no_remat"]
    mem.add_row("no remat: peak (XLA)", fb(nr["measured_peak_bytes"]) if nr["measured_peak_bytes"]
                else "not verified", _MEANING["no_remat"])
    mem.add_row("budget", fb(report["budget_bytes"]), _MEANING["budget"])
    pr = report["plan"]
    mem.add_row("plan: predicted peak", fb(pr["predicted_peak_bytes"]), _MEANING["predicted"])
    mem.add_row("plan: XLA-verified peak", fb(pr["measured_peak_bytes"])
                if pr["measured_peak_bytes"] else "not verified", _MEANING["measured"])
    over = pr["recompute_overhead_measured"]
    mem.add_row("plan: recompute overhead", f"{100 * pr['recompute_overhead_predicted']:.1f}% "
                f"predicted" + (f", {100 * over:.1f}% by XLA FLOPs" if over is not None else ""),
                _MEANING["overhead"])
    if pr.get("cost_model") == "time" and pr.get("recompute_time_overhead_predicted") is not None:
        mem.add_row("plan: recompute time",
                    f"{100 * pr['recompute_time_overhead_predicted']:.1f}% predicted",
                    _MEANING["time"])
    console.print(mem)
    no_remat_peak = nr["measured_peak_bytes"] or report["no_remat"].get("predicted_peak_bytes")
    if no_remat_peak and report["budget_bytes"] >= no_remat_peak:
        by = "XLA" if nr["measured_peak_bytes"] else "memory model"
        console.print(f"no remat needed: the step without remat peaks at {fb(no_remat_peak)} "
                      f"({by}), within the budget {fb(report['budget_bytes'])}", markup=False,
                      highlight=False)
    if plan_file:
        saved = plan.metadata.get("saved_budget_bytes")
        console.print(f"plan loaded from {plan_file}" + (
            f" (solved for a budget of {fb(saved)})" if saved is not None else ""),
            markup=False, highlight=False)

    console.print(summary(plan, an, units, figures=False), markup=False, highlight=False,
                  soft_wrap=True)

    if report["builtin_policies"]:
        cmp_ = Table(title="same step, JAX built-in policies per block (XLA: peak and "
                           "recompute overhead of each compiled step)")
        _cols(cmp_, "policy", "peak", "fits budget", "recompute overhead", left=("policy",))
        rows = dict(report["builtin_policies"])
        rows["remat-planner"] = {"measured_peak_bytes": pr["measured_peak_bytes"],
                                 "recompute_overhead": over}
        for name, r in rows.items():
            ov = r["recompute_overhead"]
            cmp_.add_row(name, fb(r["measured_peak_bytes"]),
                         "yes" if r["measured_peak_bytes"] <= report["budget_bytes"] else "no",
                         "-" if ov is None else f"{100 * ov:.1f}%")
        console.print(cmp_)
    if sh and sh.get("communication_plan"):
        comm = Table(title="communication per device (collectives in the compiled step)")
        _cols(comm, "collective", "no remat", "plan", left=("collective",))
        before, after = sh["communication_no_remat"] or {}, sh["communication_plan"]
        for kind, c in after.items():
            b = before.get(kind, {"count": 0, "bytes": 0})
            if c["count"] or b["count"]:
                comm.add_row(kind, f"{b['count']} x, {fb(b['bytes'])}",
                             f"{c['count']} x, {fb(c['bytes'])}")
        console.print(comm)
    console.print(f"done in {report['seconds']:.1f}s")


def _explain(args) -> int:
    import os

    from .explain import explain, flax_names, plot_memory

    cfg, wl, optimizer, budget = _load(args)
    err = _console(stderr=True)
    status, say = _progress(err, err.is_terminal and not args.json)
    verify = not args.no_verify
    try:
        an, plan = _saved_or_new_plan(args, cfg, wl, optimizer, budget, verify, say)
        say("explaining")
        ex = explain(an, plan)
        report = {**ex.to_dict(), "flax_names": flax_names(an, plan)}
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "explain.json"), "w") as f:
                json.dump(report, f, indent=1)
            plot_memory(an, plan, os.path.join(args.out, "memory.png"), units=args.units)
    finally:
        if status is not None:
            status.stop()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_explanation(ex, an, plan, args.units)
        if args.plan:
            print(f"plan loaded from {args.plan}")
        if args.out:
            print(f"wrote {args.out}/explain.json and {args.out}/memory.png")
    if args.saved_plan is not None and plan.fits() is False:
        raise _over_budget(args, plan, "")
    return 0


def _print_explanation(ex, an, plan, units) -> None:
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree

    from .units import format_flops
    from .describe import keep_words, segment_name, stage_label, sub_stage_labels
    fb = units.format
    console = _console()
    subs = sub_stage_labels(an)
    tree = Tree(Text(f"plan (sizes in {units.example})"))

    def name_of(s) -> str:
        return segment_name(plan, s.start, s.stop, an.program)

    def walk(node, segs):
        for s in segs:
            name = name_of(s)
            what = ("only its inputs: one checkpoint around the segments below" if s.children
                    else keep_words(s.option, subs))
            share = 100 * s.recompute_flops / ex.step_flops if ex.step_flops else 0.0
            node_s = node.add(Text(f"{name}: keeps {what}; {fb(s.saved_bytes)} kept; "
                                   f"recomputes {format_flops(s.recompute_flops)} "
                                   f"({share:.2f}% of the step)"))
            walk(node_s, s.children)
            table = Table(title=Text(f"{name}: keeps {what}"), title_justify="left")
            _cols(table, "kept", "module", "produced by", "shape", "dtype", "size",
                  left=("kept", "module", "produced by", "shape", "dtype"))
            for t in s.kept:
                what_t = "value kept by the checkpoint policy" if t.what == "named value" else t.what
                module = stage_label(t.module, an.program) if t.module else ""
                table.add_row(*(Text(x) for x in (what_t, module, t.primitive,
                                                   str(list(t.shape)), t.dtype, fb(t.nbytes))))
            tables.append(table)

    tables = []
    walk(tree, ex.segments)
    console.print("per segment, each tensor it keeps for its backward. kept: 'input' = an "
                  "array the segment receives, kept as its checkpoint's input; 'value kept by "
                  "the checkpoint policy' = an output kept instead of recomputed; 'residual' = "
                  "what JAX's autodiff keeps for a segment without checkpoint", markup=False,
                  highlight=False)
    for t in tables:
        console.print(t, markup=False)
    console.print(tree, markup=False)
    measured = fb(ex.measured_peak_bytes) if ex.measured_peak_bytes else "not verified"
    share = 100 * ex.recompute_flops / ex.step_flops if ex.step_flops else 0.0
    rows = [("kept tensors", fb(ex.saved_bytes),
             "every tensor in the tables above: what the segments hold for the backward"),
            ("predicted peak", fb(ex.predicted_peak_bytes),
             "the memory model's peak of the planned step"),
            ("XLA peak", measured, "XLA's buffer assignment of the compiled planned step: "
                                   "the figure that proves the fit"),
            ("budget", fb(ex.budget_bytes), "memory for the whole training step"),
            ("recompute", f"{format_flops(ex.recompute_flops)} = {share:.2f}%",
             "extra FLOPs spent recomputing, as a share of the step's (cost model)")]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for a, b, c in rows:
        console.print(f"{a.ljust(w0)}  {b.rjust(w1)}  {c}", markup=False, highlight=False,
                      soft_wrap=True)
    if ex.noremat_measured_peak_bytes and ex.budget_bytes >= ex.noremat_measured_peak_bytes:
        console.print(f"no remat needed: the step without remat peaks at "
                      f"{fb(ex.noremat_measured_peak_bytes)} (XLA), within the budget",
                      markup=False, highlight=False)


def _train(args) -> int:
    import jax
    from rich.progress import Progress

    from . import planner as pl
    from .verify import train_step

    if args.steps <= 0:
        from .errors import ConfigError
        raise ConfigError(f"--steps must be positive, got {args.steps}")
    cfg, wl, optimizer, budget = _load(args)
    console = _console(stderr=True)
    fb = args.units.format
    if args.saved_plan is not None:
        with console.status(f"verifying the saved plan {args.plan} with XLA"):
            plan = _verify_saved(args.saved_plan, wl, _step(wl, optimizer, args.spec), budget)
        if not plan.fits():
            raise _over_budget(args, plan, "")
    else:
        with console.status("planning"):
            plan = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                           has_aux=wl.has_aux, sharding=args.spec,
                           cost_model=_cost_model(args, cfg))
    source = f"plan from {args.plan}" if args.plan else "plan"
    console.print(f"{source}: XLA peak {fb(plan.measured_peak_bytes)} <= budget "
                  f"{fb(plan.budget_bytes)} (XLA's buffer assignment of the compiled step); "
                  f"recompute {100 * plan.recompute_overhead:.1f}% of the step's FLOPs "
                  "(cost model)", markup=False, highlight=False)
    key = jax.random.key(cfg.seed)
    params = wl.init_params(key)
    opt_state = optimizer.init(params)
    step = train_step(wl.loss_fn, optimizer, plan, wl.has_aux, params=wl.abstract_params,
                      batch=wl.abstract_batch, sharding=args.spec)
    # A fixed pool of synthetic batches, cycled, so the loss has something to go down on.
    pool = [wl.synthetic_batch(jax.random.fold_in(key, i)) for i in range(4)]
    losses = []
    with Progress(console=console, transient=False) as bar:
        task = bar.add_task("training", total=args.steps)
        for i in range(args.steps):
            batch = pool[i % len(pool)]
            if wl.has_aux:
                params, opt_state, loss, aux = step(params, opt_state, batch)
                if wl.update_batch is not None:  # e.g. BatchNorm stats carried to the next step
                    pool = [wl.update_batch(b, aux) for b in pool]
            else:
                params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            bar.update(task, advance=1, description=f"training loss {losses[-1]:.4f}")
    result = {"steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1],
              "losses": losses, "measured_peak_bytes": plan.measured_peak_bytes,
              "budget_bytes": plan.budget_bytes}
    if args.json:
        print(json.dumps(result))
    else:
        _console().print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
    return 0


@contextlib.contextmanager
def _progress_bar(console, enabled: bool, total: int | None):
    """A rich progress bar on stderr: yields step(description), which advances it by one
    step, and say(message), which shows the pipeline's current action beside it."""
    if not enabled:
        yield (lambda desc: None), (lambda msg: None)
        return
    from rich.markup import escape
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=total, detail="")
        started = [False]

        def step(desc: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=escape(desc), detail="")

        yield step, (lambda msg: bar.update(task, detail=escape(msg)))
        if total is not None:
            bar.update(task, completed=total)


def _frontier(args) -> int:
    import os

    from . import frontier as fr_mod
    from .units import DEFAULT_UNITS
    from .config import make_optimizer
    from .errors import ConfigError

    if args.points < MIN_POINTS:
        raise ConfigError(f"--points must be at least {MIN_POINTS}, got {args.points}")
    _check_writable(args.out, directory=True)
    units = DEFAULT_UNITS
    cfg = _load_config(args)
    wl, optimizer = _build_workload(args, cfg), make_optimizer(cfg.optimizer)
    err = _console(stderr=True)
    with _progress_bar(err, err.is_terminal and not args.json,
                       fr_mod.total_steps(args.points)) as (step, say):
        fr = fr_mod.sweep(wl, optimizer, points=args.points, config=args.config,
                          step=step, say=say)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write --out {args.out!r}: {e.strerror or e}") from None
    paths = {ext: os.path.join(args.out, f"frontier.{ext}") for ext in ("csv", "md", "png")}
    command = "remat-plan frontier " + " ".join(
        [args.config, "--out", args.out, "--points", str(args.points)]
        + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
        + (["--seq-len", str(args.seq_len)] if args.seq_len else []))
    fr_mod.write_csv(fr, paths["csv"])
    fr_mod.write_markdown(fr, paths["md"], command, units)
    fr_mod.plot(fr, paths["png"], units)
    if args.json:
        print(json.dumps({**fr.to_dict(), "files": paths}, indent=1))
    else:
        print_frontier(fr, units)
        print(f"wrote {paths['csv']}, {paths['png']}, {paths['md']}")
    return 0


def print_frontier(fr, units) -> None:
    """Print frontier `fr` (frontier.sweep) as `remat-plan frontier` does: its points, and
    the planner at each built-in policy's peak, sizes in `units`, on stdout; piped, no
    cell is cut (_console)."""
    from rich.table import Table

    fb = units.format
    console = _console()
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"
    t = Table(title=f"frontier of {fr.config} (XLA peak, overhead by XLA FLOPs; "
                    f"{units.example})")
    _cols(t, "point", "budget", "XLA peak", "overhead", "frontier", left=("point",))
    for p in sorted(fr.points, key=lambda p: p.budget_bytes or 0):
        t.add_row(p.label, fb(p.budget_bytes),
                  fb(p.peak_bytes) if p.feasible else "infeasible", pct(p.overhead),
                  ("knee" if p.knee else "yes") if p.on_frontier else "")
    console.print(t)
    c = Table(title="planner with the budget at each built-in policy's XLA peak")
    _cols(c, "built-in", "its peak", "its overhead", "planner peak", "planner overhead",
          "recompute vs policy", left=("built-in",))
    for cmp_ in fr.comparisons:
        rel = cmp_.relative_recompute
        c.add_row(cmp_.builtin.label, fb(cmp_.builtin.peak_bytes), pct(cmp_.builtin.overhead),
                  fb(cmp_.planner.peak_bytes) if cmp_.planner.feasible else "infeasible",
                  pct(cmp_.planner.overhead), "-" if rel is None else f"{100 * rel:+.1f}%")
    console.print(c)
    console.print(f"done in {fr.seconds:.1f}s (analysis {fr.analysis_seconds:.1f}s)")


def _max_batch(args) -> int:
    from . import baselines
    from .config import build_workload, load_config
    from .errors import ConfigError
    from .maxbatch import max_batch

    if args.no_verify:
        raise ConfigError("--max-batch verifies every answer with XLA; drop --no-verify")
    cfg, _, optimizer, budget = _load(args)
    workloads: dict = {}

    def make_workload(batch: int):
        if batch not in workloads:
            workloads[batch] = build_workload(load_config(args.config, batch_size=batch,
                                                          seq_len=args.seq_len))
        return workloads[batch]

    err = _console(stderr=True)
    names = () if args.no_compare else baselines.NAMES
    with _progress_bar(err, err.is_terminal and not args.json, 1 + len(names)) as (step, say):
        result = max_batch(make_workload, optimizer, budget, cfg.batch_size, say=say, step=step,
                           builtins=names)
    best = result.planner.best
    if args.out and best is not None and best.plan is not None:
        with open(args.out, "w") as f:
            f.write(_with_units(best.plan, args.units).to_json())
    report = {"config": str(cfg.type), "model": {k: v for k, v in make_workload(
        result.planner.batch).info.items()}, **result.to_dict()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    from rich.table import Table

    fb = args.units.format
    console = _console()
    t = Table(title=f"largest batch size within {fb(budget)} ({budget:,} bytes), XLA-verified")
    _cols(t, "step", "batch size", "XLA peak", "recompute overhead", "probes", left=("step",))
    rows = {"remat-planner": result.planner, **result.builtins}
    for name, srch in rows.items():
        b = srch.best
        probes = ", ".join(f"{p.batch}{'' if p.fits else 'x'}" for p in srch.probes)
        t.add_row(name, str(srch.batch), fb(b.peak_bytes) if b else "nothing fits",
                  "-" if b is None or b.overhead is None else f"{100 * b.overhead:.2f}%", probes)
    console.print(t)
    nr = result.builtins.get(baselines.NO_REMAT)
    if nr is not None:
        ratio = (f"{result.planner.batch / nr.batch:.1f}x" if nr.batch else
                 "no remat fits no batch at all")
        console.print(f"planned batch {result.planner.batch} vs {nr.batch} without remat: {ratio}")
    if args.out and best is not None:
        console.print(f"plan for batch size {best.batch} written to {args.out}")
    console.print(f"probes marked x do not fit; done in {result.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
