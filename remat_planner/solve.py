"""Stage 4: solvers - the cheapest plan whose modelled peak fits a byte budget.

`solve_chain` is an exact dynamic program over the chain of stages (Rotor-style, memory
discretised into `resolution` units, sizes rounded up so a plan that fits in units fits
in bytes). A plan is a list of segments; a segment is one stage with a keep option, or a
checkpointed region over several stages whose recomputation runs its own nested list
of segments. `brute_force` enumerates every plan of a small chain and is the reference
the DP is tested against. Both optimise exactly `memory.simulate`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from .memory import (ChainModel, last_child_forward_flops, leaf_bwd_peak, leaf_fwd_peak,
                     region_fwd_peak, simulate)
from .plan import NOTHING, STORE, Segment

INF = math.inf


@dataclasses.dataclass(frozen=True)
class Solution:
    """The solver's answer for one activation budget."""

    segments: tuple[Segment, ...]
    recompute_flops: float
    activation_peak_bytes: int  # by memory.simulate, exact bytes


class ChainSolver:
    """DP tables for one chain model, reusable across budgets up to `max_bytes`.

    Args:
      chain: the per-stage model.
      max_bytes: the largest activation budget to be asked (above it nothing is saved).
      resolution: number of memory units; sizes are rounded up to max_bytes/resolution.
    """

    def __init__(self, chain: ChainModel, max_bytes: int, resolution: int = 16000):
        self.chain = chain
        self.n = chain.n
        self.quantum = max(1, math.ceil(max_bytes / resolution))
        self.units = max_bytes // self.quantum
        u = self._units
        n = self.n
        self.x = [u(b) for b in chain.boundary]
        self.leaf = []  # per stage: list of (option, keep, need, cost)
        for i, s in enumerate(chain.stages):
            self.leaf.append([(o, u(o.keep_bytes),
                               max(u(leaf_fwd_peak(chain, i, o)), u(leaf_bwd_peak(chain, i, o))),
                               o.recompute_flops) for o in s.options])
        self.flops_prefix = np.concatenate([[0.0], np.cumsum([s.flops for s in chain.stages])])
        self.P: dict[tuple[int, int], np.ndarray] = {}
        self.Q: dict[tuple[int, int], np.ndarray] = {}
        self.Qx: dict[tuple[int, int], np.ndarray] = {}  # Q without the single-region list
        self.R: dict[tuple[int, int], np.ndarray] = {}   # a region over [a, b) as a segment
        for length in range(1, n + 1):
            for a in range(0, n - length + 1):
                self._fill(a, a + length)
        # Rounding every size up to units makes the DP miss the plan that keeps everything
        # at a budget of exactly its peak (a budget set to the step's own peak without
        # remat): that plan is checked in exact bytes.
        self.store_all: Solution | None = None
        if all(any(o.name == STORE for o in s.options) for s in chain.stages):
            segments = tuple(Segment(i, i + 1, STORE) for i in range(n))
            peak, cost = simulate(chain, segments)
            self.store_all = Solution(segments, cost, peak)

    def _region_keep(self, a: int, c: int) -> int:
        """Units a checkpointed region over [a, c) keeps (its inputs)."""
        return self._units(self.chain.region_input_bytes(a, c))

    def _units(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.quantum)

    def _shift(self, arr: np.ndarray, k: int) -> np.ndarray:
        out = np.full(self.units + 1, INF)
        if k <= self.units:
            out[k:] = arr[: self.units + 1 - k]
        return out

    def _need(self, need: int) -> np.ndarray:
        out = np.full(self.units + 1, INF)
        if need <= self.units:
            out[need:] = 0.0
        return out

    def _first_segments(self, a: int, b: int):
        """Candidate first segments of a list over [a, b): (segment spec, stop, keep,
        need-mask + cost array, is_region). Order fixes tie-breaking."""
        for opt, keep, need, cost in self.leaf[a]:
            yield ("leaf", opt), a + 1, keep, self._need(need) + cost
        for c in range(a + 2, b + 1):
            if (a, c) in self.R:  # absent only for [a, b) itself while it is being filled
                yield ("region", None), c, self._region_keep(a, c), self.R[(a, c)]

    def _fill(self, a: int, b: int) -> None:
        fsum = lambda lo, hi: self.flops_prefix[hi] - self.flops_prefix[lo]
        q_excl = np.full(self.units + 1, INF)
        p = np.full(self.units + 1, INF)
        for (kind, opt), c, keep, base in self._first_segments(a, b):
            if c == b:
                last_cost = (last_child_forward_flops(self.chain.stages[a], opt.name)
                             if opt is not None else 0.0)
                q_excl = np.minimum(q_excl, base + last_cost)
                p = np.minimum(p, base)
            else:
                q_excl = np.minimum(q_excl, base + fsum(a, c) + self._shift(self.Q[(c, b)], keep))
                p = np.minimum(p, base + self._shift(self.P[(c, b)], keep))
        self.Qx[(a, b)] = q_excl
        if b - a >= 2:
            region = self._shift(q_excl, self._region_keep(a, b)) + self._need(self._units(
                region_fwd_peak(self.chain, a, b)))
            self.R[(a, b)] = region
            self.Q[(a, b)] = np.minimum(q_excl, region)  # a last region child costs 0 forward
            p = np.minimum(p, region)
        else:
            self.Q[(a, b)] = q_excl
        self.P[(a, b)] = p

    # -- queries -----------------------------------------------------------------------

    def min_feasible_units(self) -> int | None:
        finite = np.flatnonzero(np.isfinite(self.P[(0, self.n)]))
        return int(finite[0]) if finite.size else None

    def min_feasible_bytes(self) -> int | None:
        """Smallest activation budget the DP finds a plan for (rounded up to units)."""
        m = self.min_feasible_units()
        return None if m is None else m * self.quantum

    def frontier(self) -> list[tuple[int, float]]:
        """(activation budget bytes, least recompute FLOPs) at every step of the curve."""
        arr = self.P[(0, self.n)]
        points, last = [], None
        for m in range(self.units + 1):
            if np.isfinite(arr[m]) and (last is None or arr[m] < last):
                points.append((m * self.quantum, float(arr[m])))
                last = arr[m]
        return points

    def solve(self, activation_budget: int) -> Solution | None:
        """Cheapest plan whose modelled activation peak fits; None if none does."""
        if self.store_all is not None and self.store_all.activation_peak_bytes <= activation_budget:
            return self.store_all
        m = min(self.units, max(-1, activation_budget // self.quantum))
        if m < 0 or not np.isfinite(self.P[(0, self.n)][m]):
            return None
        segments = tuple(self._recover(0, self.n, m, top=True, exclude_region=False))
        peak, cost = simulate(self.chain, segments)
        return Solution(segments, cost, peak)

    def _recover(self, a: int, b: int, m: int, top: bool, exclude_region: bool) -> list[Segment]:
        target = (self.P if top else (self.Qx if exclude_region else self.Q))[(a, b)][m]
        fsum = lambda lo, hi: self.flops_prefix[hi] - self.flops_prefix[lo]
        for (kind, opt), c, keep, base in self._first_segments(a, b):
            if kind == "region" and c == b and exclude_region:
                continue
            if c == b:
                extra = 0.0
                if not top and opt is not None:
                    extra = last_child_forward_flops(self.chain.stages[a], opt.name)
                val = base[m] + extra
            else:
                if m - keep < 0:
                    continue
                rest = (self.P if top else self.Q)[(c, b)][m - keep]
                val = base[m] + rest + (0.0 if top else fsum(a, c))
            if np.isfinite(val) and math.isclose(val, target, rel_tol=1e-9, abs_tol=1e-6):
                seg = self._make_segment(kind, opt, a, c, m)
                rest_list = [] if c == b else self._recover(c, b, m - keep, top, False)
                return [seg, *rest_list]
        raise AssertionError(f"DP recovery failed at [{a}, {b}) m={m}")  # tables inconsistent

    def _make_segment(self, kind, opt, a: int, c: int, m: int) -> Segment:
        if kind == "leaf":
            return Segment(a, a + 1, opt.name, opt.saved if opt.name != STORE else ())
        children = self._recover(a, c, m - self._region_keep(a, c), top=False, exclude_region=True)
        return Segment(a, c, NOTHING, (), tuple(children))


# ---------------------------------------------------------------------------------------
# Brute force (the reference for tests)
# ---------------------------------------------------------------------------------------

def enumerate_plans(chain: ChainModel, a: int = 0, b: int | None = None,
                    exclude_single_region: bool = False) -> Iterator[tuple[Segment, ...]]:
    """Every plan over stages [a, b): lists of leaves (any option) and regions (length
    >= 2) whose children are again plans, a region never being its own only child."""
    b = chain.n if b is None else b
    if a == b:
        yield ()
        return
    for c in range(a + 1, b + 1):
        if c == a + 1:
            firsts = [Segment(a, c, o.name, o.saved if o.name != STORE else ())
                      for o in chain.stages[a].options]
        else:
            if exclude_single_region and c == b:
                continue
            firsts = [Segment(a, c, NOTHING, (), tuple(ch))
                      for ch in enumerate_plans(chain, a, c, exclude_single_region=True)]
        for first in firsts:
            for rest in enumerate_plans(chain, c, b):
                yield (first, *rest)


def brute_force(chain: ChainModel, activation_budget: int) -> Solution | None:
    """The cheapest plan over all plans by explicit simulation (small chains only)."""
    best = None
    for segments in enumerate_plans(chain):
        peak, cost = simulate(chain, segments)
        if peak <= activation_budget and (best is None or cost < best.recompute_flops - 1e-9):
            best = Solution(segments, cost, peak)
    return best
