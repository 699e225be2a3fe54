"""The memory/recompute frontier of one step: the planner across budgets next to JAX's
built-in policies, all measured in one run through the same path.

`sweep()` analyses the step once (planner.analyze, calibrated), measures every built-in
comparison point (baselines.py; on a worker thread while the analysis runs) and the
planner's per-block plans (a per-block plan whose step lowers to the same XLA program as a
built-in's takes its measurement), plans at budgets spaced geometrically from the
smallest feasible one to the no-remat peak, and plans again at each built-in point's XLA
peak. The low end and the no-remat end are planned by planner.plan's closed loop; every
other point compiles at most one plan (_shot, SWEEP_COMPILES): the model's plan at its
budget less the model error XLA measured on the plan before, none where the frontier is
flat (FLAT_GAIN), and two consecutive points' plans compile side by side (_shots); a
comparison the planner loses is planned again with a whole plan() call. Every figure is
verify.measure's: XLA's memory_analysis peak and the FLOPs of the donated optimizer step
compiled with the CPU option that keeps remat. Each point ends with the cheapest plan XLA
measured in the run within its budget. Overhead is (FLOPs - no-remat FLOPs) / no-remat
FLOPs.

Writers: `write_csv`, `write_markdown`, `plot` (matplotlib, Agg). A row is
`Point.row()`; a later column (e.g. predicted time) is one more field there and in
`CSV_COLUMNS`.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import jax

from . import baselines
from . import planner as pl
from .constants import (FLAT_GAIN, LOW_END_COMPILES, MAX_COMPILES, MIN_POINTS, REUSE_TOLERANCE,
                        SWEEP_COMPILES)
from .errors import ConfigError, InfeasibleBudgetError
from .units import DEFAULT_UNITS, Units
from .step import Step
from .verify import measure_step

fb = DEFAULT_UNITS.format  # progress messages; the files take the units they are given


# Whether the sweep compiles on a worker thread beside the main one (the built-ins during
# the analysis, the no-remat end's plan, one plan of each pair of points: _shots); None:
# where the 1-minute load average is below the core count (use_threads). XLA compiles release
# the GIL, so with spare capacity they overlap (gpt2-tiny at load average 1.7: 30.2 s in
# threads, 33.1 s in one); on 2 cores kept busy by another job they only compete (load
# average 7-9: 56 and 74 s in threads, 51 and 67 s in one, run one after the other). The
# results are the same either way: a pair's measurements enter the analysis in queue
# order.
THREADS: bool | None = None


def use_threads() -> bool:
    """Whether the sweep compiles on a worker thread: THREADS where set, else whether the
    1-minute load average is below the core count (False where there is none)."""
    if THREADS is not None:
        return THREADS
    import os
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return False
    return load < (os.cpu_count() or 1)


StepReport = Callable[[str], None]


class InlineExecutor:
    """An executor that runs each task when it is submitted (THREADS off)."""

    def submit(self, fn, *args, **kwargs) -> Future:
        f = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


@dataclasses.dataclass
class Point:
    """One measured configuration of the step."""

    kind: str                         # "planner" or "builtin"
    label: str                        # builtin name, "sweep i/N" or "at <builtin> peak"
    budget_bytes: int | None          # planner: the budget it was planned for
    peak_bytes: int | None            # XLA's peak (None: infeasible)
    flops: float | None               # XLA FLOPs of the step (scan bodies counted per iteration)
    noremat_flops: float
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None   # the planner's cost model, fraction
    verify_rounds: int | None = None
    compiles: int | None = None       # planner: whole-step compiles its plan() call(s) made
    plan: str = ""                    # the plan's top-level segments / the builtin's grouping
    note: str = ""
    min_feasible_bytes: int | None = None     # infeasible planner point: what the error named
    on_frontier: bool = False
    knee: bool = False

    @property
    def feasible(self) -> bool:
        return self.peak_bytes is not None

    @property
    def recompute_flops(self) -> float | None:
        return None if self.flops is None else self.flops - self.noremat_flops

    @property
    def overhead(self) -> float | None:
        """Recompute FLOPs as a fraction of the step without remat (XLA's counts)."""
        return None if self.flops is None else (self.flops - self.noremat_flops) / self.noremat_flops

    def row(self) -> dict:
        pct = lambda x: "" if x is None else f"{100 * x:.4f}"
        return {
            "kind": self.kind, "label": self.label,
            "budget_bytes": "" if self.budget_bytes is None else self.budget_bytes,
            "xla_peak_bytes": "" if self.peak_bytes is None else self.peak_bytes,
            "predicted_peak_bytes": "" if self.predicted_peak_bytes is None
            else self.predicted_peak_bytes,
            "flops": "" if self.flops is None else repr(float(self.flops)),
            "recompute_flops": "" if self.flops is None else repr(float(self.recompute_flops)),
            "overhead_pct": pct(self.overhead),
            "predicted_overhead_pct": pct(self.predicted_overhead),
            "verify_rounds": "" if self.verify_rounds is None else self.verify_rounds,
            "compiles": "" if self.compiles is None else self.compiles,
            "on_frontier": int(self.on_frontier), "knee": int(self.knee),
            "plan": self.plan, "note": self.note,
        }


CSV_COLUMNS = tuple(Point("", "", None, None, None, 1.0).row())


@dataclasses.dataclass
class Comparison:
    """The planner with the budget set to one built-in point's XLA peak."""

    builtin: Point
    planner: Point

    @property
    def relative_recompute(self) -> float | None:
        """(planner recompute - policy recompute) / policy recompute; < 0: planner lower."""
        pol, mine = self.builtin.recompute_flops, self.planner.recompute_flops
        if mine is None or pol is None or pol <= 0:
            return None
        return (mine - pol) / pol

    @property
    def planner_not_worse(self) -> bool | None:
        """Planner peak <= budget and planner recompute <= the policy's."""
        if not self.planner.feasible:
            return False
        return (self.planner.peak_bytes <= self.builtin.peak_bytes
                and self.planner.recompute_flops <= self.builtin.recompute_flops)


@dataclasses.dataclass
class Frontier:
    config: str
    model: dict
    noremat: Point
    points: list[Point]            # planner points, sweep then comparisons
    builtins: list[Point]
    comparisons: list[Comparison]
    seconds: float
    analysis_seconds: float
    per_block_compiles: int = 0    # the planner's per-block plans, compiled once for all points
    per_block_shared: int = 0      # per-block plans whose step is a built-in's (not compiled)
    jax_version: str = jax.__version__
    date: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"))

    @property
    def frontier(self) -> list[Point]:
        """Planner points on the frontier, one per (peak, overhead), by peak ascending."""
        seen = {}
        for p in self.points:
            if p.on_frontier:
                seen.setdefault((p.peak_bytes, p.overhead), p)
        return [seen[k] for k in sorted(seen)]

    @property
    def knee(self) -> Point | None:
        return next((p for p in self.points if p.knee), None)

    def to_dict(self) -> dict:
        return {
            "config": self.config, "model": self.model, "jax_version": self.jax_version,
            "date": self.date, "seconds": round(self.seconds, 1),
            "analysis_seconds": round(self.analysis_seconds, 1),
            "per_block_compiles": self.per_block_compiles,
            "per_block_shared": self.per_block_shared,
            "no_remat": self.noremat.row(),
            "points": [p.row() for p in self.points],
            "builtins": [p.row() for p in self.builtins],
            "comparisons": [{"builtin": c.builtin.label, "budget_bytes": c.builtin.peak_bytes,
                             "policy_overhead_pct": 100 * c.builtin.overhead,
                             "planner_peak_bytes": c.planner.peak_bytes,
                             "planner_overhead_pct": None if c.planner.overhead is None
                             else 100 * c.planner.overhead,
                             "relative_recompute": c.relative_recompute,
                             "planner_not_worse": c.planner_not_worse}
                            for c in self.comparisons],
        }


def sweep_budgets(low: int, high: int, n: int) -> list[int]:
    """n budgets from low to high (both included), geometrically spaced: the overhead
    changes fastest near the smallest feasible budget."""
    if n < 2 or high <= low:
        return [low] * max(n, 1)
    r = math.log(high / low)
    out = [int(round(low * math.exp(r * i / (n - 1)))) for i in range(n)]
    out[0], out[-1] = low, high
    return out


def _plan_point(wl, optimizer, an, budget: int, label: str, noremat_flops: float,
                say, max_compiles: int | None = None) -> Point:
    known = len(an.verified)  # plans XLA measured on this analysis so far
    try:
        p = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                    analysis=an, progress=say, max_compiles=max_compiles)
    except InfeasibleBudgetError as e:
        return Point("planner", label, budget, None, None, noremat_flops,
                     compiles=len(an.verified) - known,
                     note=f"infeasible: smallest feasible {e.min_feasible_bytes:,} bytes",
                     min_feasible_bytes=e.min_feasible_bytes)
    return _point(p, label, budget, noremat_flops,
                  compiles=p.metadata.get("compiles", len(an.verified) - known))


def _point(p, label: str, budget: int, noremat_flops: float, compiles: int | None,
           note: str = "") -> Point:
    return Point("planner", label, budget, p.measured_peak_bytes, p.measured_flops,
                 noremat_flops, predicted_peak_bytes=p.predicted_peak_bytes,
                 predicted_overhead=p.recompute_overhead,
                 verify_rounds=p.metadata.get("verify_rounds"), compiles=compiles,
                 plan=_summary(p.segments), note=note)


def model_error(an, skip) -> int:
    """XLA's peak minus the model's (uncorrected) for the plan last measured on `an`,
    the per-block plans (`skip`) left out: the model overstates whole-block checkpoints,
    and its error on the solver's plans is what the next budget's plan will have
    (gpt2-tiny: +0.53 MB, 3% of the peak, on 9 of the sweep's 12 measured plans)."""
    for (segments, _), m in reversed(list(an.verified.items())):
        if segments in skip:
            continue
        act, _ = pl.simulate(an.chain_for(segments, chain=an.chain), segments)
        return m.peak_bytes - an.predicted_peak(act)
    return 0


def _step(wl, optimizer, an) -> Step:
    """The step the sweep plans: `an`'s (has_aux, sharding) with `wl`'s loss and
    `optimizer`."""
    return an.step.replace(loss_fn=wl.loss_fn, optimizer=optimizer)


def aim(wl, optimizer, an, budget: int, costs=None,
        skip=frozenset()) -> tuple[object, int, bool]:
    """What a sweep point compiles (_shot): the model's plan at `budget` less the model
    error XLA measured on the last plan (model_error), None where the model has none;
    that error; and whether it needs a compile: not where this run measured it already,
    nor where it recomputes less than the cheapest plan XLA measured within `budget` by
    under FLAT_GAIN of the step (both by the model: the frontier is flat there).

    costs: the planner's cost reports the sweep made for `an` (None: the default cost
    model's); skip: the per-block plans (per_block_plans), which model_error leaves out.
    """
    if costs is None:
        costs = pl.PlanCosts(an, pl.resolve_cost_model(None))
    P, B, step = wl.abstract_params, wl.abstract_batch, _step(wl, optimizer, an)
    have = pl.cheapest_verified(an, budget, step, P, B, costs)
    error = max(0, model_error(an, skip))
    try:
        model = pl.plan(wl.loss_fn, P, B, budget - error, optimizer, analysis=an,
                        verify=False)
    except InfeasibleBudgetError:
        return None, error, False
    need = pl.cached_measurement(an, model, step) is None and (
        have is None or have.recompute_overhead - model.recompute_overhead >= FLAT_GAIN)
    return model, error, need


def _settle(wl, optimizer, an, budget: int, label: str, noremat_flops: float, costs,
            model, error: int, made: int) -> Point:
    """A sweep point's result once its plan is measured (or not, `made` 0): the cheapest
    plan XLA measured in this run within `budget`."""
    P, B, step = wl.abstract_params, wl.abstract_batch, _step(wl, optimizer, an)
    best = pl.cheapest_verified(an, budget, step, P, B, costs)
    if best is None:
        lowest = min((m.peak_bytes for m in an.verified.values()), default=budget)
        return Point("planner", label, budget, None, None, noremat_flops, compiles=made,
                     note=f"infeasible: smallest feasible {lowest:,} bytes",
                     min_feasible_bytes=lowest)
    if model is not None and best.segments == model.segments:
        m = pl.cached_measurement(an, model, step)
        p = pl.with_measurement(dataclasses.replace(
            model, budget_bytes=budget, predicted_peak_bytes=model.predicted_peak_bytes + error),
            m, verify_rounds=1)
        return _point(p, label, budget, noremat_flops, compiles=made)
    note = ("flat: plan XLA measured at another budget of this run" if made == 0
            else "plan XLA measured at another budget of this run (this budget's was over)")
    return _point(best, label, budget, noremat_flops, compiles=made, note=note)


def _shot(wl, optimizer, an, budget: int, label: str, noremat_flops: float, costs,
          skip) -> tuple[Point, int]:
    """A sweep point with at most one compile: the plan aim picks, compiled if it needs
    it, then the cheapest plan XLA measured within `budget` (_settle). planner.plan with
    one compile measures the model's plan at the budget itself, which XLA puts over it as
    often as not (gpt2-tiny: 9 of 12 by 0.5-0.8 MB): its compile then serves a larger
    budget only. Returns the point and the compiles made (0 or 1)."""
    model, error, need = aim(wl, optimizer, an, budget, costs, skip)
    if need:
        pl.measure_plan(an, model, _step(wl, optimizer, an), wl.abstract_params,
                         wl.abstract_batch)
    return _settle(wl, optimizer, an, budget, label, noremat_flops, costs, model, error,
                   int(need)), int(need)


def _measure_builtin(name: str, wl, optimizer, programs: dict | None = None):
    """(loss, how it groups, XLA's measurement) of the built-in comparison point `name`;
    its step's program is entered in `programs` (verify.measure)."""
    P, B, step = wl.abstract_params, wl.abstract_batch, Step(wl.loss_fn, optimizer, wl.has_aux)
    loss, how = baselines.builtin_point(name, step, P, B)
    return loss, how, measure_step(step.with_loss(loss), P, B, programs=programs)


def _measure_alone(an, p, wl, optimizer):
    """XLA's figures for plan `p` of `an`'s step, compiled without entering them in
    `an.verified` (a worker thread's compile: the caller enters them, so that what the
    sweep's points see does not depend on when it ends); None for an optimizer that
    cannot be a dict key."""
    try:
        hash((p.segments, optimizer))
    except TypeError:
        return None
    return pl.measure_step(_step(wl, optimizer, an).planned(p), wl.abstract_params,
                           wl.abstract_batch)


def _measure_per_block(wl, optimizer, an, costs,
                       programs: Callable[[], dict] | None = None) -> tuple[int, int]:
    """Measure the planner's per-block plans (planner.per_block_plans: every copy of a
    repeated block checkpointed whole under nothing_saveable, dots_with_no_batch_dims_saveable
    or dots_saveable, the rest stored, replayed like any plan) once, on `an`, so that every
    planner call of the sweep can reuse them (planner.cheaper_verified): what a single
    plan() call probes late, with the compiles the sweep's calls do not have.

    `programs` returns the map from step digests to XLA's measurements that the built-ins
    were measured into (verify.measure; it waits for them: they may still be compiling on
    another thread): a per-block plan whose step is the same program as a built-in's (it is
    the built-in policy per block, replayed) takes that measurement and is not compiled
    again. Returns (compiles made, plans that took a built-in's measurement)."""
    P, B, step = wl.abstract_params, wl.abstract_batch, _step(wl, optimizer, an)
    made = shared = 0
    todo = []
    for segments in pl.per_block_plans(an):
        act, cost = pl.simulate(costs.objective_chain, segments)
        p = pl.make_plan(an, pl.Solution(segments, cost, act), an.noremat.peak_bytes, P, B,
                          0, costs=costs)
        if pl.cached_measurement(an, p, step) is None:
            todo.append(p)
    known = programs() if todo and programs is not None else None
    for p in todo:
        try:
            key = (p.segments, optimizer)
            hash(key)
        except TypeError:  # an optimizer that cannot be a dict key: no reuse
            made += 1
            pl.measure_plan(an, p, step, P, B)
            continue
        before = len(known) if known is not None else 0
        an.verified[key] = measure_step(step.planned(p), P, B, programs=known)
        compiled = known is None or len(known) > before
        made += compiled
        shared += not compiled
    return made, shared


def _reuse_verified(wl, optimizer, an, pts: list[Point], noremat_flops: float) -> None:
    """Give each planner point the plan with the fewest XLA FLOPs among all those XLA
    measured in this run within its budget, when that recomputes less than its own (by
    more than constants.REUSE_TOLERANCE of the step): a plan met at a larger budget may fit
    a smaller one. No compile; a point's figures stay XLA's for the plan it names. A point
    whose plan recomputes nothing keeps it (XLA counts some remat plans below the step
    without remat: that is not less work)."""
    costs = pl.PlanCosts(an, pl.resolve_cost_model(None))
    tol = REUSE_TOLERANCE * noremat_flops
    for i, pt in enumerate(pts):
        if pt.feasible and pt.predicted_overhead == 0.0:
            continue
        p = pl.cheapest_verified(an, pt.budget_bytes, _step(wl, optimizer, an),
                                  wl.abstract_params, wl.abstract_batch, costs)
        if p is None or (pt.feasible and p.measured_flops >= pt.flops - tol):
            continue
        pts[i] = _point(p, pt.label, pt.budget_bytes, noremat_flops, pt.compiles,
                        note="plan XLA measured at another budget of this run")


def _summary(segments) -> str:
    parts = []
    for s in segments:
        text = f"{s.start}-{s.stop - 1}:{s.option}"
        if s.children:
            text += "(" + " ".join(_summary([c]) for c in s.children) + ")"
        parts.append(text)
    return " ".join(parts)


def _low_end(wl, optimizer, an, low: int, high: int, points: int, nf: float, step, say,
             max_compiles: int) -> Point:
    """The sweep's first point, at the model's smallest feasible budget `low`; when XLA
    finds the plan over it, the error names a verified-or-lowest-measured peak to try
    instead (twice at most, below the no-remat peak `high`)."""
    step(f"planning at {fb(low)} (1/{points})")
    label = f"sweep 1/{points}"
    pt = _plan_point(wl, optimizer, an, low, label, nf, say, max_compiles)
    spent = pt.compiles or 0
    for _ in range(2):
        retry = pt.min_feasible_bytes
        if pt.feasible or retry is None or retry <= pt.budget_bytes or retry >= high:
            break
        say(f"XLA's smallest feasible budget is above the model's; trying {fb(retry)}")
        # LOW_END_COMPILES (2) here: the plan XLA measured at `retry` fits it, but the
        # closed loop's second round may find a cheaper one (scanned gpt2-small:
        # 24.57% at 6.09 GB against that plan's 49.46% at 6.12 GB).
        pt = _plan_point(wl, optimizer, an, retry, label, nf, say, LOW_END_COMPILES)
        spent += pt.compiles or 0
    pt.compiles = spent
    return pt


def _shots(wl, optimizer, an, queue, k: int, costs, skip, pool, nf: float, label,
           last) -> list[tuple[int, int, Point]]:
    """The sweep point queue[k - 1] by _shot, and where it compiles and the next point
    of the queue (not `last`, the last sweep point) would compile another plan, that one too,
    aimed with the same state and compiled on `pool`'s worker meanwhile (XLA compiles
    release the GIL): [(kind, i, point)], one or two. The pair's measurements enter
    `an.verified` in queue order, so the points do not depend on which compile ends
    first."""
    budget, kind, i = queue[k - 1]
    model, error, need = aim(wl, optimizer, an, budget, costs, skip)
    pair = None
    if need and k < len(queue) and queue[k] != last:
        budget2, kind2, i2 = queue[k]
        model2, error2, need2 = aim(wl, optimizer, an, budget2, costs, skip)
        if need2 and model2.segments != model.segments:
            pair = (budget2, kind2, i2, model2, error2)
    P, B, step = wl.abstract_params, wl.abstract_batch, _step(wl, optimizer, an)
    later = pool.submit(_measure_alone, an, pair[3], wl, optimizer) if pair else None
    if need:
        pl.measure_plan(an, model, step, P, B)
    out = []
    if later is not None:
        m2 = later.result()
        if m2 is None:  # an optimizer that cannot be a dict key
            pl.measure_plan(an, pair[3], step, P, B)
        else:
            an.verified.setdefault((pair[3].segments, optimizer), m2)
    out.append((kind, i, _settle(wl, optimizer, an, budget, label(kind, i), nf, costs,
                                 model, error, int(need))))
    if pair is not None:
        budget2, kind2, i2, model2, error2 = pair
        out.append((kind2, i2, _settle(wl, optimizer, an, budget2, label(kind2, i2), nf,
                                       costs, model2, error2, 1)))
    return out


def sweep(wl, optimizer, *, points: int = MIN_POINTS, config: str = "",
          step: StepReport | None = None, say: Callable[[str], None] | None = None,
          max_compiles: int = SWEEP_COMPILES) -> Frontier:
    """Measure the frontier of workload `wl`'s step (see the module docstring).

    step(description) is called at the start of each of `total_steps(points)` steps;
    say(message) relays the pipeline's finer progress. The low end and the no-remat end
    are planned by planner.plan with `max_compiles` whole-step compiles (the no-remat
    end's compiled on a worker thread beforehand); the other points compile at most
    `max_compiles` (1: _shot's plan, two consecutive points' side by side), none where
    the frontier is flat (see FLAT_GAIN); the low end's retry at XLA's smallest budget,
    and a point at a built-in's peak whose plan recomputes more than the built-in, get
    LOW_END_COMPILES (2) and constants.MAX_COMPILES (6). The built-ins are measured on a
    worker thread during the analysis, the planner's per-block plans once after it (a
    built-in's measurement where the step is the same program). After the low end, the
    sweep's budgets and the built-ins' peaks are planned in increasing order; at the end
    every point takes the cheapest plan XLA measured in the
    run within its budget.
    """
    if points < MIN_POINTS:
        raise ConfigError(f"--points must be at least {MIN_POINTS}, got {points}")
    step = step or (lambda d: None)
    say = say or (lambda m: None)
    P, B = wl.abstract_params, wl.abstract_batch
    t0 = time.perf_counter()
    # The built-in policies do not depend on the analysis: they are measured on a worker
    # thread meanwhile (XLA compiles release the GIL, so the two overlap where a second
    # core is free), the per-block policies first, each step's program entered in
    # `programs` (_measure_per_block waits for those), then sqrt(n) grouping while the
    # low end is planned.
    pool = ThreadPoolExecutor(max_workers=1) if use_threads() else InlineExecutor()
    try:
        programs: dict = {}  # step digest -> XLA's measurement (verify.measure)
        pending = {name: pool.submit(_measure_builtin, name, wl, optimizer, programs)
                   for name in baselines.POLICIES}
        step("analysing the step (trace, profile, calibrate)")
        an = pl.analyze(wl.loss_fn, P, B, optimizer, progress=say, has_aux=wl.has_aux)
        analysis_seconds = time.perf_counter() - t0
        for name in baselines.NAMES[1:]:
            if name not in pending:
                pending[name] = pool.submit(_measure_builtin, name, wl, optimizer)
        nr = an.noremat
        nf = nr.flops
        low, high = an.min_feasible_budget(), nr.peak_bytes
        # The sweep's last point, the no-remat peak, is planned for sure and its plan
        # recomputes nothing. A plan storing every stage of an unsharded step is the loss
        # as written (apply.apply_plan), so the analysis's no-remat compile is its
        # measurement; otherwise it is compiled on the worker, handed over when planned.
        top = pl.plan(wl.loss_fn, P, B, high, optimizer, analysis=an, verify=False)
        top_new_compile = not (an.sharding is None
                               and all(not s.is_checkpoint for s in top.segments))
        top_m = (pool.submit(_measure_alone, an, top, wl, optimizer) if top_new_compile
                 else InlineExecutor().submit(lambda: nr))
        noremat = Point("builtin", baselines.NO_REMAT, None, nr.peak_bytes, nr.flops, nf,
                        plan="no checkpoint")
        costs = pl.PlanCosts(an, pl.resolve_cost_model(None))

        def builtin_programs() -> dict:
            """The map the per-block built-ins were measured into, once they are."""
            for name in baselines.POLICIES:
                pending[name].result()
            return programs

        step("measuring the planner's per-block plans")
        per_block, shared = _measure_per_block(wl, optimizer, an, costs, builtin_programs)
        skip = set(pl.per_block_plans(an))  # segments model_error leaves out

        # The low end: the model's smallest feasible budget; when XLA finds the plan over
        # it, the error names a verified-or-lowest-measured peak to try instead (twice at
        # most).
        lowest = _low_end(wl, optimizer, an, low, high, points, nf, step, say, max_compiles)
        builtins = [noremat]
        for name in baselines.NAMES[1:]:
            step(f"measuring built-in: {name}")
            _, how, m = pending[name].result()
            builtins.append(Point("builtin", name, None, m.peak_bytes, m.flops, nf, plan=how))
        top_m = top_m.result()

        budgets = sweep_budgets(low, high, points)
        if lowest.feasible and lowest.budget_bytes != low:
            # Respace the rest of the sweep from the verified low end.
            budgets = sweep_budgets(lowest.budget_bytes, high, points)
        # The rest in increasing budget, the built-ins' peaks among the sweep's budgets:
        # each reuses the plans XLA measured at the smaller budgets before it.
        queue = sorted([(budgets[i], 0, i) for i in range(1, points)]
                       + [(b.peak_bytes, 1, j) for j, b in enumerate(builtins[1:])])
        label = lambda kind, i: (f"sweep {i + 1}/{points}" if kind == 0  # noqa: E731
                                 else f"at {builtins[1 + i].label} peak")
        what = lambda budget, kind, i: (  # noqa: E731
            f"planning at {fb(budget)} ({i + 1}/{points})" if kind == 0
            else f"planning at the {builtins[1 + i].label} peak ({fb(budget)})")
        done = {}
        k = 0
        while k < len(queue):
            budget, kind, i = queue[k]
            k += 1
            if kind == 0 and i == points - 1:
                # Measured on the worker: planner.plan finds it measured, the point
                # counts it.
                step(what(budget, kind, i))
                top_new = pl.cached_measurement(an, top, _step(wl, optimizer, an)) is None
                if top_new and top_m is not None:
                    an.verified[(top.segments, optimizer)] = top_m
                pt = _plan_point(wl, optimizer, an, budget, label(kind, i), nf, say,
                                 max_compiles)
                pt.compiles = (pt.compiles or 0) + int(top_new and top_m is not None
                                                       and top_new_compile)
                done[kind, i] = pt
                continue
            step(what(budget, kind, i))
            if max_compiles != 1:
                pts = [(kind, i, _plan_point(wl, optimizer, an, budget, label(kind, i), nf,
                                             say, max_compiles))]
            else:
                pts = _shots(wl, optimizer, an, queue, k, costs, skip, pool, nf, label,
                              (budgets[-1], 0, points - 1))
                if len(pts) == 2:
                    step(what(*queue[k]))
                    k += 1
            for kind_, i_, pt in pts:
                if pt.compiles == 0:
                    say("the frontier is flat here: taking a plan XLA measured at another "
                        "budget of this run")
                if kind_ == 1 and not Comparison(builtins[1 + i_], pt).planner_not_worse:
                    # The comparison is what the frontier is for: where the planner's plan
                    # recomputes more than the built-in at its peak, plan again with
                    # constants.MAX_COMPILES (6; the first round is free now).
                    say(f"the plan at the {builtins[1 + i_].label} peak recomputes more "
                        "than it: planning again with more compiles")
                    again = _plan_point(wl, optimizer, an, pt.budget_bytes, pt.label, nf,
                                        say, MAX_COMPILES)
                    again.compiles += pt.compiles or 0
                    pt = again
                done[kind_, i_] = pt
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    planned = [lowest] + [done[0, i] for i in range(1, points)]
    planned += [done[1, j] for j in range(len(builtins) - 1)]
    _reuse_verified(wl, optimizer, an, planned, nf)
    comparisons = [Comparison(b, pt) for b, pt in zip(builtins[1:], planned[-len(builtins) + 1:])]
    mark_frontier(planned)
    return Frontier(config, {**wl.info, "param_count": wl.param_count}, noremat, planned,
                    builtins, comparisons, time.perf_counter() - t0, analysis_seconds,
                    per_block_compiles=per_block, per_block_shared=shared)


def total_steps(points: int) -> int:
    """Steps sweep() reports: analysis, built-ins but no remat, the per-block plans,
    sweep, comparisons."""
    return 1 + (len(baselines.NAMES) - 1) + 1 + points + (len(baselines.NAMES) - 1)


def mark_frontier(points: Sequence[Point]) -> None:
    """Mark the Pareto-optimal feasible points and the knee among them.

    A point is on the frontier when no other feasible point has a lower-or-equal peak
    with lower overhead, or a lower peak with equal-or-lower overhead (the same plan met
    at several budgets is on the frontier at each).

    The knee is where memory stops being cheap: along the frontier from its top (the
    highest peak), the memory dropped so far, as a share of the frontier's memory range,
    minus the overhead added so far, as a share of its overhead range, is largest there.
    Before the knee each percentage point of overhead buys more memory than the
    frontier's average (range over range), after it less. (The plain ratio "memory drop
    / overhead" is no use as a criterion: it is largest for the first tiny steps near 0%.)
    """
    feasible = [p for p in points if p.feasible]
    for p in points:
        p.on_frontier = p.knee = False
    for p in feasible:
        p.on_frontier = not any(
            (q.peak_bytes <= p.peak_bytes and q.overhead < p.overhead)
            or (q.peak_bytes < p.peak_bytes and q.overhead <= p.overhead) for q in feasible)
    front = [p for p in feasible if p.on_frontier]
    if len(front) < 2:
        return
    knee = max(front, key=lambda p: (knee_score(front, p), -p.peak_bytes))
    if knee_score(front, knee) > 0:
        knee.knee = True


def knee_score(front: Sequence[Point], p: Point) -> float:
    """Memory dropped from the frontier's top minus overhead added, each as a share of
    the frontier's range (see mark_frontier)."""
    top = max(front, key=lambda q: (q.peak_bytes, -q.overhead))
    mem_range = top.peak_bytes - min(q.peak_bytes for q in front)
    ov_range = max(q.overhead for q in front) - top.overhead
    if mem_range <= 0 or ov_range <= 0:
        return 0.0
    return ((top.peak_bytes - p.peak_bytes) / mem_range
            - (p.overhead - top.overhead) / ov_range)


# ---------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------

def write_csv(fr: Frontier, path: str) -> None:
    """Every measured point: the planner's (sweep and at each built-in peak) and the
    built-ins', one row each."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for p in fr.points + fr.builtins:
            w.writerow(p.row())


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def _peak(p: Point, fb=DEFAULT_UNITS.format) -> str:
    return "infeasible" if p.peak_bytes is None else f"{fb(p.peak_bytes)} ({p.peak_bytes:,})"


def markdown(fr: Frontier, command: str = "", units: Units = DEFAULT_UNITS) -> str:
    """frontier.md: sizes in `units` (units.Units; the plot's axis uses the same)."""
    fb = units.format

    def _peak_(p: Point) -> str:
        return _peak(p, fb)

    m = fr.model
    lines = [f"# Memory / recompute frontier: {fr.config}", ""]
    facts = ", ".join(f"{k} {v}" for k, v in m.items())
    lines += [f"- model: {facts}",
              f"- jax {fr.jax_version}, {fr.date}; {fr.seconds:.0f} s in all "
              f"(analysis {fr.analysis_seconds:.0f} s)",
              "- every figure measured in this run: XLA memory_analysis peak (argument + "
              "output - alias + temp) and FLOPs of the donated AdamW step, compiled with "
              "`xla_disable_hlo_passes=cse_barrier_expander`; overhead = extra FLOPs / "
              f"FLOPs without remat ({fr.noremat.flops:.4g})",
              f"- sizes in {units.example.split(' = ')[0]} ({units.example}), as on "
              "frontier.png's x axis; frontier.csv in bytes"]
    if command:
        lines.append(f"- command: `{command}`")
    spent = sum(p.compiles or 0 for p in fr.points)
    shared = (f" ({fr.per_block_shared} more the same XLA program as a built-in's, not "
              "compiled again)" if fr.per_block_shared else "")
    lines.append(f"- whole-step compiles besides the analysis's: {len(fr.builtins) - 1} "
                 f"built-ins, {fr.per_block_compiles} per-block plans{shared}, {spent} by the "
                 f"{len(fr.points)} planner points (`compiles`; a point without one took a "
                 "plan XLA measured at another budget of this run)")
    knee = fr.knee
    if knee is not None:
        lines.append(f"- **knee** (where a further percentage point of overhead starts to "
                     f"buy less memory than the frontier's average): {knee.label}, XLA peak "
                     f"{fb(knee.peak_bytes)} at {_pct(knee.overhead)} overhead")
    lines += ["", "## Planner points", "",
              "| point | budget | XLA peak | predicted peak | overhead (XLA FLOPs) "
              "| predicted overhead | rounds | compiles | frontier | plan |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(fr.points, key=lambda p: (p.budget_bytes or 0)):
        mark = ("**knee**" if p.knee else "yes") if p.on_frontier else ""
        lines.append(
            f"| {p.label} | {fb(p.budget_bytes)} | {_peak_(p)} | "
            f"{'-' if p.predicted_peak_bytes is None else fb(p.predicted_peak_bytes)} | "
            f"{_pct(p.overhead)} | {_pct(p.predicted_overhead)} | {p.verify_rounds or '-'} | "
            f"{'-' if p.compiles is None else p.compiles} | {mark} | {p.plan or p.note} |")
    lines += ["", "## JAX built-in policies (same step, same measurement)", "",
              "| policy | how | XLA peak | overhead (XLA FLOPs) |", "|---|---|---|---|"]
    for p in fr.builtins:
        lines.append(f"| {p.label} | {p.plan} | {_peak_(p)} | {_pct(p.overhead)} |")
    lines += ["", "## Planner with the budget at each built-in policy's XLA peak", "",
              "| built-in | budget = its XLA peak | its overhead | planner XLA peak "
              "| planner overhead | planner recompute vs policy | planner <= policy |",
              "|---|---|---|---|---|---|---|"]
    for c in fr.comparisons:
        rel = c.relative_recompute
        lines.append(
            f"| {c.builtin.label} | {fb(c.builtin.peak_bytes)} | {_pct(c.builtin.overhead)} | "
            f"{_peak_(c.planner)} | {_pct(c.planner.overhead)} | "
            f"{'-' if rel is None else f'{100 * rel:+.1f}%'} | "
            f"{'yes' if c.planner_not_worse else 'no'} |")
    return "\n".join(lines) + "\n"


def write_markdown(fr: Frontier, path: str, command: str = "",
                   units: Units = DEFAULT_UNITS) -> None:
    with open(path, "w") as f:
        f.write(markdown(fr, command, units))


def plot(fr: Frontier, path: str, units: Units = DEFAULT_UNITS) -> None:
    """x = XLA peak (in `units`, the family frontier.md uses: GB, or MB below 1 GB; GiB /
    MiB for binary), y = overhead %: the planner's frontier as a step line (the
    least overhead measured at or below each peak), its other points faint, every built-in
    as a labelled point, the knee starred."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(p.peak_bytes for p in fr.builtins + [q for q in fr.points if q.feasible])
    gb, unit = units.scale(top)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    front = fr.frontier
    xs = [p.peak_bytes / gb for p in front]
    ys = [100 * p.overhead for p in front]
    if front:
        # Step line: at peak x the least overhead is that of the last frontier point at
        # or below x; it extends right to the no-remat peak.
        right = max(fr.noremat.peak_bytes / gb, xs[-1])
        ax.step(xs + [right], ys + [ys[-1]], where="post", color="tab:blue", lw=2,
                label="remat-planner frontier (XLA-verified)")
        ax.plot(xs, ys, "o", color="tab:blue", ms=5)
    off = [p for p in fr.points if p.feasible and not p.on_frontier]
    if off:
        ax.plot([p.peak_bytes / gb for p in off], [100 * p.overhead for p in off], "o",
                color="tab:blue", alpha=0.3, ms=4, label="planner, dominated")
    colors = ["black", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown"]
    for p, c in zip(fr.builtins, colors):
        ax.plot(p.peak_bytes / gb, 100 * p.overhead, "s", color=c, ms=8)
        ax.annotate(p.label, (p.peak_bytes / gb, 100 * p.overhead), textcoords="offset points",
                    xytext=(6, 6), fontsize=8, color=c)
    knee = fr.knee
    if knee is not None:
        ax.plot(knee.peak_bytes / gb, 100 * knee.overhead, "*", color="gold", ms=18,
                markeredgecolor="black", label="knee", zorder=5)
    ax.set_xlabel(f"XLA peak of the training step ({unit})")
    ax.set_ylabel("recompute overhead (% of FLOPs without remat)")
    ax.set_title(f"{fr.config}: memory vs recompute (jax {fr.jax_version})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
