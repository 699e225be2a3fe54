"""The largest batch size whose step fits a budget: planned, without remat, and with each
built-in policy (baselines.py), every answer measured by XLA.

A probe at a batch size builds the workload at that size. For the planner it runs a
fresh calibrated analysis and the closed-loop plan (the probe fits when XLA verifies a
plan within the budget); for a built-in it compiles the step (fits when XLA's peak is
within the budget). `largest_fitting` searches: from the starting size it doubles (or
halves; after two probes it jumps to where the line through them crosses the budget)
until the answer changes, then narrows the bracket, probing where the line
through the two nearest probes' memory needs crosses the budget (memory is close to
affine in the batch size), and bisecting whenever that guess does not halve the
bracket. It ends with a size that fits and the next size probed and not fitting.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from . import baselines
from . import planner as pl
from .constants import MAX_BATCH
from .errors import InfeasibleBudgetError
from .step import Step



@dataclasses.dataclass(frozen=True)
class Probe:
    batch: int
    fits: bool
    need_bytes: int | None    # memory the step needs at this batch (for the next guess)
    peak_bytes: int | None    # XLA's peak of what was measured (None: nothing compiled fits)
    flops: float | None = None
    noremat_flops: float | None = None  # planner probes: the step's FLOPs without remat
    seconds: float = 0.0
    plan: object = None       # planner probes that fit: the verified Plan

    @property
    def overhead(self) -> float | None:
        if self.flops is None or not self.noremat_flops:
            return None
        return (self.flops - self.noremat_flops) / self.noremat_flops


@dataclasses.dataclass
class Search:
    """A finished search: `best` is the largest probe that fits (None: not even batch 1)."""

    name: str
    budget_bytes: int
    probes: list[Probe]

    @property
    def best(self) -> Probe | None:
        fits = [p for p in self.probes if p.fits]
        return max(fits, key=lambda p: p.batch) if fits else None

    @property
    def batch(self) -> int:
        return self.best.batch if self.best else 0

    def probe(self, batch: int) -> Probe | None:
        return next((p for p in self.probes if p.batch == batch), None)


def _guess(a: Probe, b: Probe, budget: int) -> int | None:
    """Batch where the line through two probes' needs crosses the budget."""
    if a.need_bytes is None or b.need_bytes is None or a.batch == b.batch:
        return None
    slope = (b.need_bytes - a.need_bytes) / (b.batch - a.batch)
    if slope <= 0:
        return None
    return int(a.batch + (budget - a.need_bytes) // slope)


def largest_fitting(probe: Callable[[int], Probe], start: int, budget: int, name: str = "",
                    on_probe: Callable[[Probe], None] | None = None) -> Search:
    """Search batch sizes for the largest whose probe fits (see the module docstring)."""
    search = Search(name, budget, [])
    seen: dict[int, Probe] = {}

    def run(b: int) -> Probe:
        if b not in seen:
            seen[b] = probe(b)
            search.probes.append(seen[b])
            if on_probe:
                on_probe(seen[b])
        return seen[b]

    p = run(max(1, start))
    lo = p if p.fits else None       # largest size known to fit
    hi = None if p.fits else p       # smallest size known not to fit
    # Exponential phase, guided by the line through the last two probes once there are two.
    while lo is None or hi is None:
        last = search.probes[-2:]
        g = _guess(*last, budget) if len(last) == 2 else None
        if lo is None:           # nothing fits yet: go down
            if hi.batch == 1:
                return search
            nxt = max(1, hi.batch // 2)
            if g is not None:
                nxt = max(1, min(g, hi.batch - 1))   # the guess, however far down
        else:                     # everything fits so far: go up
            if lo.batch >= MAX_BATCH:
                return search
            nxt = min(MAX_BATCH, lo.batch * 2)
            if g is not None:
                # One past the guess, to close the bracket; at most 16x per step in case
                # the line is far off.
                nxt = min(MAX_BATCH, lo.batch * 16, max(g, lo.batch) + 1)
        p = run(nxt)
        if p.fits:
            lo = p if lo is None or p.batch > lo.batch else lo
        else:
            hi = p if hi is None or p.batch < hi.batch else hi
    # Narrowing: interpolate; bisect next whenever a step did not halve the bracket.
    interpolate = True
    while hi.batch - lo.batch > 1:
        width = hi.batch - lo.batch
        g = _guess(lo, hi, budget) if interpolate else None
        if g is not None:
            g = min(max(g, lo.batch + 1), hi.batch - 1)
        nxt = g if g is not None else (lo.batch + hi.batch) // 2
        p = run(nxt)
        lo, hi = (p, hi) if p.fits else (lo, p)
        if p.fits and nxt == g and hi.batch - lo.batch > 1:
            # The guess fits: the boundary is most likely right above it.
            p = run(nxt + 1)
            lo, hi = (p, hi) if p.fits else (lo, p)
        interpolate = hi.batch - lo.batch <= width / 2
    return search


# ---------------------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------------------

def planner_probe(make_workload: Callable[[int], object], optimizer, budget: int,
                  say: Callable[[str], None] | None = None) -> Callable[[int], Probe]:
    """A probe that analyses the step at a batch size and plans it for `budget`."""
    say = say or (lambda m: None)

    def probe(batch: int) -> Probe:
        t0 = time.perf_counter()
        wl = make_workload(batch)
        say(f"batch {batch}: analysing")
        an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer,
                        progress=lambda m: say(f"batch {batch}: {m}"), has_aux=wl.has_aux)
        need = an.min_feasible_budget()
        nf = an.noremat.flops
        try:
            plan = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                           analysis=an, progress=lambda m: say(f"batch {batch}: {m}"))
        except InfeasibleBudgetError as e:
            return Probe(batch, False, max(need, e.min_feasible_bytes), None, None, nf,
                         time.perf_counter() - t0)
        return Probe(batch, True, need, plan.measured_peak_bytes, plan.measured_flops, nf,
                     time.perf_counter() - t0, plan)
    return probe


def builtin_probe(name: str, make_workload: Callable[[int], object], optimizer, budget: int
                  ) -> Callable[[int], Probe]:
    """A probe that compiles the step with built-in point `name` at a batch size."""

    def probe(batch: int) -> Probe:
        t0 = time.perf_counter()
        wl = make_workload(batch)
        m = baselines.measure_builtin(name, Step(wl.loss_fn, optimizer, wl.has_aux),
                                      wl.abstract_params, wl.abstract_batch)
        return Probe(batch, m.peak_bytes <= budget, m.peak_bytes, m.peak_bytes, m.flops, None,
                     time.perf_counter() - t0)
    return probe


@dataclasses.dataclass
class MaxBatch:
    budget_bytes: int
    planner: Search
    builtins: dict[str, Search]
    seconds: float

    def to_dict(self) -> dict:
        def s(x: Search) -> dict:
            b = x.best
            return {"batch_size": x.batch,
                    "xla_peak_bytes": b.peak_bytes if b else None,
                    "overhead": b.overhead if b else None,
                    "probes": [{"batch_size": p.batch, "fits": p.fits,
                                "xla_peak_bytes": p.peak_bytes, "need_bytes": p.need_bytes,
                                "seconds": round(p.seconds, 1)} for p in x.probes]}
        return {"budget_bytes": self.budget_bytes, "planner": s(self.planner),
                "builtin_policies": {k: s(v) for k, v in self.builtins.items()},
                "seconds": round(self.seconds, 1)}


def max_batch(make_workload: Callable[[int], object], optimizer, budget: int, start: int, *,
              say: Callable[[str], None] | None = None,
              step: Callable[[str], None] | None = None,
              builtins: tuple[str, ...] = baselines.NAMES) -> MaxBatch:
    """The largest batch that fits `budget` planned, and with each built-in point named
    in `builtins` (baselines.NAMES by default).

    Raises InfeasibleBudgetError when no plan fits even at batch size 1.
    """
    say = say or (lambda m: None)
    step = step or (lambda m: None)
    t0 = time.perf_counter()
    step("planner")
    planner = largest_fitting(planner_probe(make_workload, optimizer, budget, say), start,
                              budget, "remat-planner",
                              on_probe=lambda p: say(f"batch {p.batch}: "
                                                     f"{'fits' if p.fits else 'does not fit'}"))
    if planner.best is None:
        one = planner.probe(1)
        raise InfeasibleBudgetError(budget, one.need_bytes if one else budget,
                                    "even at batch size 1 (searched by --max-batch)")
    # Built-ins: the planner's answer bounds theirs, so start from a fraction of it.
    found = {}
    for name in builtins:
        step(name)
        found[name] = largest_fitting(builtin_probe(name, make_workload, optimizer, budget),
                                         max(1, min(start, planner.batch)), budget, name,
                                         on_probe=lambda p, n=name: say(
                                             f"{n} batch {p.batch}: "
                                             f"{'fits' if p.fits else 'does not fit'}"))
    # Overheads of the built-ins' answers need the no-remat FLOPs at their batch sizes:
    # reuse what the probes compiled, compile the rest.
    known = {p.batch: p.noremat_flops for p in planner.probes if p.noremat_flops}
    if baselines.NO_REMAT in found:
        known.update({p.batch: p.flops for p in found[baselines.NO_REMAT].probes})
    for srch in found.values():
        b = srch.best
        if b is None:
            continue
        if b.batch not in known:
            say(f"measuring the step without remat at batch {b.batch} (for overheads)")
            wl = make_workload(b.batch)
            known[b.batch] = baselines.measure_builtin(
                baselines.NO_REMAT, Step(wl.loss_fn, optimizer, wl.has_aux), wl.abstract_params,
                wl.abstract_batch).flops
        srch.probes[srch.probes.index(b)] = dataclasses.replace(b, noremat_flops=known[b.batch])
    return MaxBatch(budget, planner, found, time.perf_counter() - t0)

