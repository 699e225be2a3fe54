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

from .constants import SOLVER_RESOLUTION
from .memory import (ChainModel, backward_need, forward_need, last_child_forward_flops,
                     leaf_bwd_peak, leaf_fwd_peak, region_fwd_peak, simulate)
from .plan import NOTHING, STORE, Segment, Store

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

    def __init__(self, chain: ChainModel, max_bytes: int,
                 resolution: int = SOLVER_RESOLUTION):
        self.chain = chain
        self.n = chain.n
        self.quantum = max(1, math.ceil(max_bytes / resolution))
        self.units = max_bytes // self.quantum
        u = self._units
        n = self.n
        self.x = [u(b) for b in chain.boundary]
        # whether the forward's and the recomputations' needs differ (memory.forward_need):
        # gradients live in a recomputation; random bits and pooling indices made
        # ahead in the forward, which a region keeps for its recomputation; carried
        # values (masks) made in the forward, dead in the backward once read
        self.top_differs = (any(chain.grads_live) or any(chain.ahead_pending)
                            or chain.carried_fwd != chain.carried_bwd)
        # per stage a: (stop, option, keep, need, cost) of the leaves starting at a: the
        # stage's own options, then those of the spans (whole block copies) from a. The
        # need is the leaf's peak above what is live before it: its forward's and its
        # backward's, each with the gradients (and, in the step's own forward, the random
        # bits and pooling indices made ahead) live by then (memory.forward_need,
        # backward_need); keyed by `top`: run in the step's own forward, else recomputed,
        # where its region's input holds its pooling indices
        # (memory.leaf_fwd_peak; the same tables where neither differs: top_differs).
        def leaves(i: int, top: bool) -> list:
            profiles = [(i + 1, chain.stages[i]), *chain.spans_from(i)]
            return [(c, o, u(o.keep_bytes),
                     max(u(forward_need(chain, leaf_fwd_peak(chain, i, o, c, top), c, top)),
                         u(backward_need(chain, leaf_bwd_peak(chain, i, o, c, top), i, c))),
                     o.recompute_flops) for c, p in profiles for o in p.options]

        top_leaves = [leaves(i, True) for i in range(n)]
        self.leaf: dict[bool, list] = {
            True: top_leaves,
            False: [leaves(i, False) for i in range(n)] if self.top_differs else top_leaves}
        self.flops_prefix = np.concatenate([[0.0], np.cumsum([s.flops for s in chain.stages])])
        # Tables over [a, b): per budget m (units), the least recompute FLOPs, INF where
        # nothing fits. What differs is what is live when the list starts, and what its
        # forward costs:
        #   P: a top-level list (its forward is the step's own: free).
        #   Q: the rest of a region's body after its first child (each child's forward
        #      is recomputed); it may be one region over [a, b).
        #   B: the body of the region over [a, b) (b - a >= 2): like Q, but not that
        #      region itself, and the first child does not keep the region's input,
        #      live already, a second time (memory.segment_keep with its region).
        #   R: the region over [a, b) as a segment that is not a first child, keyed by
        #      whether its forward is the step's own (top) or recomputed.
        self.P: dict[tuple[int, int], np.ndarray] = {}
        self.Q: dict[tuple[int, int], np.ndarray] = {}
        self.B: dict[tuple[int, int], np.ndarray] = {}
        self.R: dict[bool, dict[tuple[int, int], np.ndarray]] = {True: {}, False: {}}
        # units a region's forward needs (region_fwd_peak, memory.forward_need), by top
        self.fwd_need: dict[tuple[int, int, bool], int] = {}
        for length in range(1, n + 1):
            for a in range(0, n - length + 1):
                self._fill(a, a + length)
        # Rounding every size up to units makes the DP miss the plan that keeps everything
        # at a budget of exactly its peak (a budget set to the step's own peak without
        # remat): that plan is checked in exact bytes.
        self.store_all: Solution | None = None
        if all(any(isinstance(o.kind, Store) for o in s.options) for s in chain.stages):
            segments = tuple(Segment(i, i + 1, STORE) for i in range(n))
            peak, cost = simulate(chain, segments)
            self.store_all = Solution(segments, cost, peak)

    def _region_keep(self, a: int, c: int) -> int:
        """Units a checkpointed region over [a, c) keeps (its inputs)."""
        return self._units(self.chain.region_input_bytes(a, c))

    def _units(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.quantum)

    def _shift(self, arr: np.ndarray, k: int) -> np.ndarray:
        """arr needing k units more (arr itself when k is 0: callers must not modify it)."""
        if k == 0:
            return arr
        out = np.full(self.units + 1, INF)
        if k <= self.units:
            out[k:] = arr[: self.units + 1 - k]
        return out

    def _need(self, need: int) -> np.ndarray:
        out = np.full(self.units + 1, INF)
        if need <= self.units:
            out[need:] = 0.0
        return out

    def _region(self, a: int, c: int, keep: int, top: bool) -> np.ndarray:
        """The region over [a, c) as a segment: its forward's peak (`top`: in the step's
        own forward, else recomputed), then its body run on top of the `keep` units its
        input adds to what is live (less than its input as a first child,
        memory.run_chain)."""
        if (a, c, top) not in self.fwd_need:
            self.fwd_need[(a, c, top)] = self._units(forward_need(
                self.chain, region_fwd_peak(self.chain, a, c, top), c, top))
        out = self._shift(self.B[(a, c)], keep).copy()
        out[:self.fwd_need[(a, c, top)]] = INF  # the budgets its forward does not fit
        return out

    def _first_segments(self, a: int, b: int, mode: str):
        """Candidate first segments of a list over [a, b) in table `mode` ("top": P,
        "rest": Q, "body": B): (segment spec, stop, keep, base), keep being the units the
        segment adds to what is live for the segments after it, base its need mask + cost
        array (a region's including its body's). Order fixes tie-breaking."""
        chain, body, top = self.chain, mode == "body", mode == "top"
        for c, opt, keep, need, cost in self.leaf[top][a]:
            if c > b or (body and c == b and c > a + 1):
                continue  # past the list, or a span as its region's only child
            if body:  # the region's first child: what it keeps of the region's input is live
                keep = self._units(opt.keep_bytes
                                   - chain.first_child_shared_bytes(a, b, c, opt))
            yield ("leaf", opt), c, keep, self._need(need) + cost
        for c in range(a + 2, b + 1):
            if body:
                if c == b:
                    continue  # a region is never its own only child
                # A nested first region: its input is (part of) its parent's, live already.
                keep = self._units(chain.region_input_bytes(a, c)
                                   - chain.first_child_shared_bytes(a, b, c, None))
                yield ("region", None), c, keep, self._region(a, c, keep, top=False)
            elif (a, c) in self.R[top]:  # absent only for [a, b) itself while being filled
                yield ("region", None), c, self._region_keep(a, c), self.R[top][(a, c)]

    def _value(self, mode: str, kind: str, opt, a: int, b: int, c: int, keep: int,
               base: np.ndarray, m: int | None = None):
        """The list's cost with this first segment: an array over budgets, or its value at
        budget m (the same sum up to rounding: recovery compares with a tolerance)."""
        at = (lambda arr: arr) if m is None else (lambda arr: arr[m])
        if c == b:  # the segment is the whole list
            if mode == "top" or kind == "region":  # a last region child costs no forward
                return at(base)
            # The last child of a recomputation runs only the forward its kept values need.
            return at(base) + last_child_forward_flops(self.chain.leaf_profile(a, c), opt.name)
        rest = (self.P if mode == "top" else self.Q)[(c, b)]  # run on top of `keep`
        fwd = 0.0 if mode == "top" else self.flops_prefix[c] - self.flops_prefix[a]
        if m is not None:
            return INF if m < keep else base[m] + fwd + rest[m - keep]
        out = np.empty(self.units + 1)
        out[:keep] = INF  # the rest does not fit under what this segment keeps
        if keep <= self.units:  # out[m] = base[m] + fwd + rest[m - keep], in place
            np.add(base[keep:], rest[: self.units + 1 - keep], out=out[keep:])
            if fwd:
                out[keep:] += fwd
        return out

    def _fill(self, a: int, b: int) -> None:
        p, q = np.full(self.units + 1, INF), np.full(self.units + 1, INF)
        # P and Q start with the same segments, differing in what follows and its cost,
        # and, where the step's own forward holds other bytes than a recomputation
        # (top_differs: timed gradients, random bits ahead), in their forwards' needs.
        for (kind, opt), c, keep, base in self._first_segments(a, b, "top"):
            np.minimum(p, self._value("top", kind, opt, a, b, c, keep, base), out=p)
            if not self.top_differs:
                np.minimum(q, self._value("rest", kind, opt, a, b, c, keep, base), out=q)
        if self.top_differs:
            for (kind, opt), c, keep, base in self._first_segments(a, b, "rest"):
                np.minimum(q, self._value("rest", kind, opt, a, b, c, keep, base), out=q)
        if b - a >= 2:
            body = np.full(self.units + 1, INF)
            for (kind, opt), c, keep, base in self._first_segments(a, b, "body"):
                np.minimum(body, self._value("body", kind, opt, a, b, c, keep, base), out=body)
            self.B[(a, b)] = body
            for top, arr in ((True, p), (False, q)):
                region = self._region(a, b, self._region_keep(a, b), top)
                self.R[top][(a, b)] = region
                np.minimum(arr, region, out=arr)
        self.P[(a, b)], self.Q[(a, b)] = p, q

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
        segments = tuple(self._recover(0, self.n, m, "top"))
        peak, cost = simulate(self.chain, segments)
        return Solution(segments, cost, peak)

    def _recover(self, a: int, b: int, m: int, mode: str) -> list[Segment]:
        target = {"top": self.P, "rest": self.Q, "body": self.B}[mode][(a, b)][m]
        for (kind, opt), c, keep, base in self._first_segments(a, b, mode):
            val = self._value(mode, kind, opt, a, b, c, keep, base, m)
            if np.isfinite(val) and math.isclose(val, target, rel_tol=1e-9, abs_tol=1e-6):
                if kind == "leaf":
                    seg = Segment(a, c, opt.name, () if isinstance(opt.kind, Store) else opt.saved)
                else:  # its body runs on top of the `keep` units it added
                    seg = Segment(a, c, NOTHING, (), tuple(self._recover(a, c, m - keep, "body")))
                rest = [] if c == b else self._recover(c, b, m - keep,
                                                         "top" if mode == "top" else "rest")
                return [seg, *rest]
        raise AssertionError(f"DP recovery failed at [{a}, {b}) m={m}")  # tables inconsistent


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
    spans = dict(chain.spans_from(a))
    for c in range(a + 1, b + 1):
        if c == a + 1:
            firsts = [Segment(a, c, o.name, () if isinstance(o.kind, Store) else o.saved)
                      for o in chain.stages[a].options]
        else:
            if exclude_single_region and c == b:
                continue
            firsts = [Segment(a, c, NOTHING, (), tuple(ch))
                      for ch in enumerate_plans(chain, a, c, exclude_single_region=True)]
            firsts += [Segment(a, c, o.name, o.saved) for o in spans[c].options] \
                if c in spans else []
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
