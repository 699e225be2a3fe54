"""The chain DP against brute force over every plan (random small chains, and the chains
the planner makes of small traced DAGs), and against Revolve's binomial optimum."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from remat_planner.graph import build_cost_graph
from remat_planner.memory import (ChainModel, KeepOption, StageProfile, leaf_bwd_peak,
                                  leaf_fwd_peak, profile_stages, region_fwd_peak, segment_keep,
                                  simulate, timeline, with_index_arrays)
from remat_planner.plan import DOTS, NOTHING, STORE, Plan, Segment, StageInfo, validate_segments
from remat_planner.solve import ChainSolver, brute_force, enumerate_plans
from remat_planner.trace import trace


@st.composite
def chains(draw, max_stages: int = 4) -> ChainModel:
    n = draw(st.integers(1, max_stages))
    stages = []
    for i in range(n):
        flops = draw(st.integers(1, 30))
        full = draw(st.integers(1, 12))
        options = [KeepOption(STORE, (), full, 0.0),
                   KeepOption(NOTHING, (), draw(st.integers(0, 3)), float(flops))]
        if draw(st.booleans()):
            options.append(KeepOption(DOTS, (100 + i,), draw(st.integers(0, full)),
                                      float(draw(st.integers(0, flops)))))
        stages.append(StageProfile(f"s{i}", float(flops), tuple(options),
                                   draw(st.integers(0, 4)), draw(st.integers(0, 4))))
    boundary = [0] + [draw(st.integers(1, 5)) for _ in range(n - 1)] + [0]
    return ChainModel(tuple(stages), tuple(boundary))


@st.composite
def skip_chains(draw, max_stages: int = 4) -> ChainModel:
    """Chains whose activations may pass over stages: each stage's output is used by the
    next stage and maybe later ones, and boundary, overlap and inputs are tabled from
    these values as profile_stages does. `nothing` keeps the stage's inputs, or those
    and a pinned value (named in `saved`). Shaped so that regions whose first child
    shares the region's input are often the optimum: a nonzero step input (x_0, as in
    uniform_chain), little workspace, some stages too dear to store."""
    n = draw(st.integers(2, max_stages))
    # (defining stage, using stages, bytes); -1: the step's input, an activation like
    # Revolve's x_0 (uniform_chain) when it has bytes, free as in the planner when not.
    values = [(d, sorted({d + 1} | draw(st.sets(st.integers(d + 1, n - 1), max_size=2))),
               draw(st.integers(0 if d < 0 else 1, 3))) for d in range(-1, n - 1)]
    crosses = lambda v, k: v[0] < k <= v[1][-1]  # cut k starts stage k
    boundary = tuple(sum(v[2] for v in values if crosses(v, k)) for k in range(n + 1))
    overlap = tuple(tuple(sum(v[2] for v in values if crosses(v, a) and crosses(v, b))
                          for b in range(n + 1)) for a in range(n + 1))
    first_use = lambda v, a: min(u for u in v[1] if u >= a)
    inputs = tuple(tuple(sum(v[2] for v in values if crosses(v, a) and first_use(v, a) < b)
                         if a < b else 0 for b in range(n + 1)) for a in range(n + 1))
    stages = []
    for i in range(n):
        flops = draw(st.integers(1, 30))
        own_inputs = inputs[i][i + 1]
        pinned = draw(st.sampled_from([0, 0, 0, 2]))
        tape = draw(st.sampled_from([0, 3, 8, 100]))  # 100: never stored, like Revolve's
        options = [KeepOption(STORE, (), own_inputs + tape, 0.0),
                   KeepOption(NOTHING, (200 + i,) if pinned else (), own_inputs + pinned,
                              float(flops))]
        if draw(st.booleans()):
            options.append(KeepOption(DOTS, (100 + i,), draw(st.integers(0, 8)),
                                      float(draw(st.integers(0, flops)))))
        temps = st.sampled_from([0, 0, 1])  # mostly none: the keeps decide the peaks
        stages.append(StageProfile(f"s{i}", float(flops), tuple(options), draw(temps),
                                   draw(temps)))
    return ChainModel(tuple(stages), boundary, overlap, inputs)


def store_all(chain: ChainModel):
    return [Segment(i, i + 1, STORE) for i in range(chain.n)]


def brute_frontier(chain: ChainModel) -> list[tuple[int, float]]:
    """(peak, recompute) of every plan of a small chain, by explicit simulation."""
    return [simulate(chain, p) for p in enumerate_plans(chain)]


def best_within(frontier, budget: int) -> float | None:
    costs = [cost for peak, cost in frontier if peak <= budget]
    return min(costs) if costs else None


def _check_dp_against_brute_force(chain: ChainModel) -> None:
    frontier = brute_frontier(chain)
    top = max(simulate(chain, store_all(chain))[0], max(peak for peak, _ in frontier))
    solver = ChainSolver(chain, top + 3, resolution=top + 3)  # quantum 1: exact in bytes
    assert solver.quantum == 1
    # The optimum only changes at a plan's peak: each peak and the byte below it (and
    # every budget, on small chains) check every budget.
    budgets = ({p for p, _ in frontier} | {p - 1 for p, _ in frontier} | {0, top + 2}
               | (set(range(top + 3)) if top < 64 else set()))
    for budget in sorted(budgets):
        dp, bf = solver.solve(budget), best_within(frontier, budget)
        assert (dp is None) == (bf is None), budget
        if dp is None:
            continue
        assert math.isclose(dp.recompute_flops, bf, abs_tol=1e-9), budget
        peak, cost = simulate(chain, dp.segments)
        assert peak <= budget
        assert math.isclose(cost, dp.recompute_flops, abs_tol=1e-9)
        validate_segments(dp.segments, chain.n)


@settings(max_examples=60, deadline=None)
@given(chains())
def test_dp_equals_brute_force_at_every_budget(chain):
    _check_dp_against_brute_force(chain)


@st.composite
def timed_chains(draw) -> ChainModel:
    """Chains with gradients left out of fixed memory and charged where they exist
    (grads_live): none in the step's own forward, more as the backward proceeds (an update
    holding every gradient) or all of it through the backward. The forward, the
    recomputations and the backward then need different amounts above what is live
    (memory.forward_need, backward_need). Some also generate random bits, held in the
    step's own forward from its start until their stage runs (ahead_pending), and some
    hold pooling index arrays from there to their stage's backward where it is not stored
    (memory.with_index_arrays).
    """
    chain = draw(st.one_of(chains(max_stages=4), skip_chains(max_stages=4)))
    held = [draw(st.integers(0, 6)) for _ in range(chain.n)]
    timed = sum(held) + draw(st.integers(0, 4))
    live = tuple(timed - sum(held[:k]) for k in range(chain.n + 1))
    bits = [draw(st.sampled_from([0, 0, 2, 7])) for _ in range(chain.n)]
    pending = tuple(sum(bits[k:]) for k in range(chain.n + 1))
    chain = dataclasses.replace(chain, grads_live=live,
                                ahead_pending=pending if any(bits) else ())
    index = [draw(st.sampled_from([0, 0, 0, 3, 8])) for _ in range(chain.n)]
    return with_index_arrays(chain, index) if any(index) else chain


@settings(max_examples=80, deadline=None)
@given(timed_chains())
def test_dp_equals_brute_force_with_gradients_along_the_step(chain):
    _check_dp_against_brute_force(chain)


def test_random_bits_are_charged_ahead_in_the_forward_only():
    """The random bits of the stages not yet run are live in the step's own forward (XLA
    generates them at its start: docs/jax-facts.md, fact 8), inside a top-level region's
    forward too, and nowhere in the backward or a recomputation."""
    stage = StageProfile("s", 1.0, (KeepOption(STORE, (), 10, 0.0),
                                    KeepOption(NOTHING, (), 1, 1.0)), 20, 5)
    chain = ChainModel((stage,) * 3, (0, 1, 1, 0))
    bits = dataclasses.replace(chain, ahead_pending=(12, 9, 4, 0))  # 3, 5, 4 per stage
    stored = tuple(Segment(i, i + 1, STORE) for i in range(3))
    points = lambda c, plan: {(p.phase, p.start): p.live_bytes  # noqa: E731
                              for p in timeline(c, plan)}
    plain, ahead = points(chain, stored), points(bits, stored)
    assert {k: ahead[k] - plain[k] for k in plain} == {
        ("forward", 0): 9, ("forward", 1): 4, ("forward", 2): 0,
        ("backward", 2): 0, ("backward", 1): 0, ("backward", 0): 0}
    # A region over stages 0-1 at top level. Its forward without bits: max(0 + 1 + 20 at
    # stage 0, 1 + 1 + 20 at stage 1) = 22. With them: stage 0 runs with stage 1's bits
    # ahead (5), stage 1 with none of the region's: max(21 + 5, 22) = 26, and stage 2's
    # (4) past the region on top (forward_need). Its recomputation generates none ahead.
    inner = (Segment(0, 1, STORE), Segment(1, 2, STORE))
    region = (Segment(0, 2, NOTHING, (), inner), Segment(2, 3, STORE))
    assert region_fwd_peak(chain, 0, 2) == region_fwd_peak(bits, 0, 2) == 22
    assert region_fwd_peak(bits, 0, 2, top=True) == 26
    plain, ahead = points(chain, region), points(bits, region)
    assert ahead[("forward", 0)] - plain[("forward", 0)] == 26 + 4 - 22
    assert ahead[("recompute", 0)] == plain[("recompute", 0)]
    assert ahead[("recompute", 1)] == plain[("recompute", 1)]


def test_gradients_are_charged_from_the_backward_on():
    """Timed gradients add nothing to the step's own forward, and in the backward those
    computed by then (ChainModel.grads_live)."""
    stage = StageProfile("s", 1.0, (KeepOption(STORE, (), 10, 0.0),
                                    KeepOption(NOTHING, (), 1, 1.0)), 20, 5)
    chain = ChainModel((stage, stage), (0, 1, 0))
    plan = (Segment(0, 1, STORE), Segment(1, 2, STORE))
    points = lambda c: {(p.phase, p.start): p.live_bytes for p in timeline(c, plan)}  # noqa: E731
    plain = points(chain)
    assert plain[("forward", 1)] == 10 + 1 + 10 + 20  # kept, boundary, its keep, workspace
    assert plain[("backward", 1)] == 10 + 2 * 1 + 5
    timed = points(dataclasses.replace(chain, grads_live=(8, 4, 0)))
    assert timed[("forward", 1)] == plain[("forward", 1)]
    assert timed[("backward", 1)] == plain[("backward", 1)] + 4
    assert timed[("backward", 0)] == plain[("backward", 0)] + 8
    # recomputed: a region over both stages recomputes stage 0 with stage 1's gradients
    region = (Segment(0, 2, NOTHING, (), plan),)
    rec = {(p.phase, p.start): p.live_bytes
           for p in timeline(dataclasses.replace(chain, grads_live=(8, 4, 0)), region)}
    assert rec[("recompute", 0)] == {(p.phase, p.start): p.live_bytes
                                     for p in timeline(chain, region)}[("recompute", 0)] + 4


@settings(max_examples=60, deadline=None)
@given(skip_chains(max_stages=5))
def test_dp_equals_brute_force_with_skips_and_pins(chain):
    """Region inputs smaller than the cut (skips pass over), overlapping cuts, and
    `nothing` leaves that keep more than their inputs (pinned values): the first child's
    shared bytes (ChainModel.first_child_shared_bytes) depend on all of them."""
    _check_dp_against_brute_force(chain)


@settings(max_examples=30, deadline=None)
@given(chains(max_stages=6))
def test_frontier_is_monotone_and_min_feasible_is_tight(chain):
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top, resolution=top)
    costs = [solver.solve(b) for b in range(top + 1)]
    finite = [c.recompute_flops for c in costs if c is not None]
    assert finite == sorted(finite, reverse=True)  # more memory never costs more
    assert costs[top].recompute_flops == 0.0       # no-remat peak: nothing recomputed
    m = solver.min_feasible_bytes()
    assert costs[m] is not None and (m == 0 or costs[m - 1] is None)


def test_rounding_up_to_units_stays_feasible_in_bytes():
    stages = tuple(StageProfile(f"s{i}", 10.0, (KeepOption(STORE, (), 1003, 0.0),
                                                 KeepOption(NOTHING, (), 7, 10.0)), 5, 11)
                   for i in range(5))
    chain = ChainModel(stages, (0, 7, 7, 7, 7, 0))
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top, resolution=50)  # coarse units
    for budget in range(0, top + 1, 97):
        sol = solver.solve(budget)
        if sol is not None:
            assert simulate(chain, sol.segments)[0] <= budget


def test_plan_space_nests_regions():
    chain = ChainModel(tuple(StageProfile(f"s{i}", 1.0, (KeepOption(STORE, (), 1, 0.0),
                                                          KeepOption(NOTHING, (), 0, 1.0)), 0, 0)
                             for i in range(4)), (0, 1, 1, 1, 0))
    plans = list(enumerate_plans(chain))
    depths = {max(s.depth() for s in p) for p in plans}
    assert {0, 1, 2, 3} <= depths
    # a region is never the only child of a region over the same stages
    for p in plans:
        for s in p:
            if s.children:
                assert not (len(s.children) == 1 and s.children[0].children
                            and (s.children[0].start, s.children[0].stop) == (s.start, s.stop))


def test_nested_regions_trade_recompute_for_memory():
    """On a uniform chain, two-level nesting reaches budgets one level cannot."""
    n = 8
    stages = tuple(StageProfile(f"s{i}", 1.0, (KeepOption(STORE, (), 10, 0.0),
                                                KeepOption(NOTHING, (), 1, 1.0)), 0, 0)
                   for i in range(n))
    chain = ChainModel(stages, (0,) + (1,) * (n - 1) + (0,))
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top, resolution=top)
    one_level = simulate(chain, [Segment(i, i + 1, NOTHING) for i in range(n)])[0]
    tight = solver.solve(solver.min_feasible_bytes())
    assert solver.min_feasible_bytes() < one_level
    assert max(s.depth() for s in tight.segments) >= 2


@pytest.mark.parametrize("budget", [-1, 0])
def test_no_plan_below_min(budget):
    chain = ChainModel((StageProfile("s", 1.0, (KeepOption(STORE, (), 4, 0.0),), 1, 1),),
                       (0, 0))
    assert ChainSolver(chain, 100).solve(budget) is None


def _three_stage_chain(store_keeps=(7, 11, 2), temps=(1, 2, 20)) -> ChainModel:
    """s0 -> s1 -> s2, boundaries 5 and 3; `nothing` keeps a stage's input."""
    stages = tuple(StageProfile(f"s{i}", f, (KeepOption(STORE, (), k, 0.0),
                                              KeepOption(NOTHING, (), b, f)), t, t)
                   for i, (f, k, b, t) in enumerate(zip((10.0, 20.0, 30.0), store_keeps,
                                                        (0, 5, 3), temps)))
    return ChainModel(stages, (0, 5, 3, 0))


def test_region_input_is_held_once_by_its_first_nothing_child():
    """Hand-computed: s0 stored, then a region over [s1, s2] whose recomputation runs s1
    with `nothing` (keeping s1's input, the region's input: one 5-byte array) and s2
    stored. Its peak is s2's backward in the recomputation: s0's 7 kept bytes, the
    region's input 5 once (not 5 more for s1's keep), and s2's backward, 2 x 3 + 0 + 20
    (leaf_bwd_peak). Recompute: s1's forward (20) and s2's as the last child (30, all
    its backward needs), and s1's `nothing` recompute (20)."""
    chain = _three_stage_chain()
    region = Segment(1, 3, NOTHING, (), (Segment(1, 2, NOTHING), Segment(2, 3, STORE)))
    plan = [Segment(0, 1, STORE), region]
    assert simulate(chain, plan) == (7 + 5 + 2 * 3 + 0 + 20, 70.0)
    # The timeline shows the region's input once under every step of its recomputation.
    points = [p for p in timeline(chain, plan) if p.phase != "forward"]
    assert [(p.phase, p.start, p.kept_bytes, p.live_bytes) for p in points] == [
        ("recompute", 1, 12, 12 + (5 + 3 + 5 + 2)),  # s1's own keep is its transient only
        ("recompute", 2, 12, 12 + (3 + 0 + 2 + 20)),
        ("backward", 2, 12, 12 + 2 * 3 + 0 + 20),  # the peak: s2's keep is in its temp
        ("backward", 1, 12, 12 + 2 * 5 + 3 + 2),
        ("backward", 0, 0, 0 + 2 * 0 + 5 + 1)]
    # Its forward at the top level: its input once, also at s1 whose input it is
    # (region_fwd_peak: max(5 + 3 + 2 at s1, 5 + 3 + 0 + 20 at s2)).
    assert region_fwd_peak(chain, 1, 3) == 28
    # The DP prices that plan the same: at exactly its peak it finds it (or one as cheap).
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top, resolution=top)
    for budget in range(top + 1):
        dp, bf = solver.solve(budget), brute_force(chain, budget)
        assert (dp is None) == (bf is None)
        assert dp is None or math.isclose(dp.recompute_flops, bf.recompute_flops)
    assert solver.solve(38).recompute_flops <= 70.0


def test_first_child_shared_bytes_counts_only_the_same_arrays():
    """What a region's first child keeps that the region holds already: all of a nested
    region's input, all of a `nothing` leaf's (its inputs), none of a stored leaf's (not
    measured) or of a `nothing` leaf's with pinned values. With a skip over the region
    its input is less than the cut; min() guards a child keeping more than that."""
    chain = _three_stage_chain()
    s1 = chain.stages[1]
    assert chain.first_child_shared_bytes(1, 3, 2, s1.option(NOTHING)) == 5
    assert chain.first_child_shared_bytes(1, 3, 2, s1.option(STORE)) == 0
    pinned = KeepOption(NOTHING, (42,), 9, 20.0)
    assert chain.first_child_shared_bytes(1, 3, 2, pinned) == 0
    # Cut 1 carries 5 + 4 bytes, the 4 used by s2 only: s1's inputs are 5 bytes.
    stages = chain.stages
    skip = ChainModel(stages, (0, 9, 7, 0),
                      ((0,) * 4, (0, 4, 4, 0), (0, 4, 4, 0), (0,) * 4),
                      ((0,) * 4, (0, 0, 5, 9), (0, 0, 0, 7), (0,) * 4))
    big = KeepOption(NOTHING, (), 8, 20.0)  # more than s1's inputs: not all of it shared
    assert skip.first_child_shared_bytes(1, 3, 2, big) == 5
    assert skip.first_child_shared_bytes(1, 2, 2, big) == 5
    assert segment_keep(skip, Segment(1, 2, NOTHING), region=(1, 3)) == 0
    assert segment_keep(skip, Segment(1, 2, NOTHING)) == 5


# ------------------------------------------------------------------------------------------
# Small DAGs: traced JAX functions with random skip connections, linearised into a chain
# ------------------------------------------------------------------------------------------

_ACTIVATIONS = (jnp.tanh, jnp.sin, jax.nn.gelu)


def _dag_loss(skips: tuple[tuple[int, ...], ...], acts: tuple[int, ...]):
    """h_{i+1} = act_i(h_i @ w_i + sum of the earlier h_j in skips[i]); loss = mean(h_n^2)."""
    def loss_fn(ws, x):
        hs = [x]
        for i, (w, skip) in enumerate(zip(ws, skips)):
            h = hs[-1] @ w
            for j in skip:
                h = h + hs[j]
            hs.append(_ACTIVATIONS[acts[i]](h))
        return jnp.mean(hs[-1] ** 2)
    return loss_fn


@st.composite
def dags(draw):
    layers = draw(st.integers(2, 5))
    skips = tuple(tuple(sorted(draw(st.sets(st.integers(1, i - 1), max_size=2)))) if i > 1
                  else () for i in range(layers))  # h_0 is the input: free, no skip cost
    acts = tuple(draw(st.integers(0, len(_ACTIVATIONS) - 1)) for _ in range(layers))
    rows, width = draw(st.sampled_from([(4, 8), (8, 8), (4, 16)]))
    max_stages = draw(st.integers(3, 6))  # brute force stays small: at most 6 stages
    seed = draw(st.integers(0, 2**16))
    return skips, acts, rows, width, max_stages, seed


def _plan_for(program, cost, segments) -> Plan:
    return Plan(tuple(segments), tuple(StageInfo(s.start, s.stop, s.name) for s in cost.stages),
                program.fingerprint(), 0, 0, 0.0, 0, 0.0)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(dags())
@example((((), (), (), (1,), (1, 2)), (0, 1, 2, 0, 1), 4, 8, 6, 0))  # skips over several cuts
def test_dp_equals_brute_force_on_traced_dags_and_plans_are_exact(dag):
    """The planner's own chain of a DAG (skip tensors count at every cut they cross):
    ChainSolver's optimum equals the best of every plan at every budget, and each
    plan it returns, replayed with its checkpoints, gives the unplanned gradients."""
    skips, acts, rows, width, max_stages, seed = dag
    loss_fn = _dag_loss(skips, acts)
    keys = jax.random.split(jax.random.key(seed), len(skips) + 1)
    ws = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[1:]]
    x = jax.random.normal(keys[0], (rows, width))
    program = trace(loss_fn, ws, x)
    cost = build_cost_graph(program, max_stages=max_stages)
    chain = profile_stages(program, cost, measure_xla=False)
    assert 1 <= chain.n <= max_stages
    assume(chain.n >= 2)

    frontier = brute_frontier(chain)
    top = max(peak for peak, _ in frontier)
    solver = ChainSolver(chain, top + 1, resolution=top + 1)
    assert solver.quantum == 1  # exact in bytes
    # The optimum only changes at a plan's peak: checking each peak and the byte below it
    # checks every budget.
    budgets = sorted({0, top + 1} | {p for p, _ in frontier} | {p - 1 for p, _ in frontier})
    plans = {}
    for budget in budgets:
        dp, bf = solver.solve(budget), best_within(frontier, budget)
        assert (dp is None) == (bf is None), budget
        if dp is None:
            continue
        assert math.isclose(dp.recompute_flops, bf, rel_tol=1e-9, abs_tol=1e-9), budget
        peak, recompute = simulate(chain, dp.segments)
        assert peak <= budget and math.isclose(recompute, dp.recompute_flops, abs_tol=1e-9)
        validate_segments(dp.segments, chain.n)
        plans[dp.segments] = budget

    loss0, g0 = jax.value_and_grad(loss_fn)(ws, x)
    for segments in plans:
        planned = _plan_for(program, cost, segments).apply(loss_fn)
        loss1, g1 = jax.value_and_grad(planned)(ws, x)
        np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
        for a, b in zip(g1, g0):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------
# Uniform chains against Revolve's binomial optimum (Griewank & Walther 2000)
# ------------------------------------------------------------------------------------------

def binomial_extra_steps(n: int, slots: int) -> int:
    """Forward steps a reversal of n steps with `slots` checkpoints (x_0 in one of them)
    spends beyond the first sweep's n-1: t(n, c) - (n - 1), with Griewank's
    t(n, c) = r n - beta(c + 1, r - 1), beta(c, r) = C(c + r, c), r minimal with
    beta(c, r) >= n."""
    if n <= 1:
        return 0
    r = 0
    while math.comb(slots + r, slots) < n:
        r += 1
    return r * n - math.comb(slots + r, slots + 1) - (n - 1)


def _revolve_recursion(n: int, slots: int) -> int:
    """The same optimum by its defining recursion (advance m steps, store, reverse the
    rest with one slot less, then the first m with all slots)."""
    @functools.lru_cache(maxsize=None)
    def t(l: int, c: int) -> float:
        if l <= 1:
            return 0
        if c == 0:
            return math.inf
        return min(m + t(l - m, c - 1) + t(m, c) for m in range(1, l))
    return int(t(n, slots)) - (n - 1)


def uniform_chain(n: int, state: int = 1) -> ChainModel:
    """n identical steps of one FLOP, every state (x_0 and the output included) `state`
    bytes, no workspace. `nothing` keeps the step's input state and recomputes the step
    (the taped forward of Revolve's adjoint step); `store` keeps a tape larger than any
    budget below, so plans hold states only, as Revolve's do."""
    tape = 10**6
    stages = tuple(StageProfile(f"s{i}", 1.0, (KeepOption(STORE, (), tape, 0.0),
                                                KeepOption(NOTHING, (), state, 1.0)), 0, 0)
                   for i in range(n))
    return ChainModel(stages, (state,) * (n + 1))


def revolve_budget(slots: int, state: int = 1) -> int:
    """The activation budget that allows `slots` checkpoints in memory.simulate.

    On `uniform_chain` every step simulate walks peaks at the same transient, 3 states:
    a leaf's forward holds its input, its output and the kept input (leaf_fwd_peak); a
    leaf's backward twice its input and its output (leaf_bwd_peak); a region's forward
    its input and one stage's input and output (region_fwd_peak: 2 states at its first
    stage, whose input is the region's, 3 at the next; a region spans two stages at
    least). All else live is the kept inputs of segments whose backward has not run,
    each state once - a region's first child keeps the region's input, the same array,
    and adds nothing to it (memory.segment_keep) -: checkpoint slots. So c slots need
    (c + 3) states. Check: n leaves each keeping its input (no recompute beyond the
    taped steps) peak at (n - 1 + 3) states, and Revolve needs c = n - 1.
    """
    return (slots + 3) * state


def test_binomial_formula_matches_its_recursion():
    for n in range(1, 16):
        for c in range(1, 8):
            assert binomial_extra_steps(n, c) == _revolve_recursion(n, c), (n, c)


def test_revolve_budget_is_the_flat_plans_peak():
    for n in range(1, 10):
        chain = uniform_chain(n)
        flat = [Segment(i, i + 1, NOTHING) for i in range(n)]
        assert simulate(chain, flat) == (revolve_budget(n - 1), float(n))


def _extra_steps(chain: ChainModel, budget: int) -> int | None:
    """The DP's extra forward steps: its recompute minus the n taped steps."""
    solver = ChainSolver(chain, budget, resolution=budget)
    sol = solver.solve(budget)
    return None if sol is None else int(sol.recompute_flops) - chain.n


def _revolve_mismatches(max_n: int) -> list[tuple[int, int, int | None, int]]:
    bad = []
    for n in range(1, max_n + 1):
        chain = uniform_chain(n)
        for c in range(1, n + 1):
            got, want = _extra_steps(chain, revolve_budget(c)), binomial_extra_steps(n, c)
            if got != want:
                bad.append((n, c, got, want))
    return bad


def test_revolve_binomial_optimum_on_uniform_chains():
    """The DP's optimum at c checkpoint slots is Revolve's: the plan space holds its
    schedules, and a region's input is counted once while the region recomputes (its
    first child keeps the same array: memory.segment_keep)."""
    assert _revolve_mismatches(10) == []


def _simulate_input_held_once(chain: ChainModel, segments, live: int = 0,
                              inside: bool = False) -> tuple[int, float]:
    """memory.simulate written out for `uniform_chain`, where a region's first child (a
    `nothing` leaf keeping the region's input, or a region over the same input) holds
    nothing beyond what the region holds: an independent check of memory.simulate's
    bookkeeping."""
    peak, cost, kept = live, 0.0, []
    for idx, seg in enumerate(segments):
        kept.append(live)
        step = (region_fwd_peak(chain, seg.start, seg.stop) if seg.children else
                leaf_fwd_peak(chain, seg.start, chain.stages[seg.start].option(seg.option)))
        peak = max(peak, live + step)
        held = inside and idx == 0 and (seg.children or seg.option == NOTHING)
        live += 0 if held else segment_keep(chain, seg)
        if inside:
            cost += _forward_in_recompute(chain, seg, last=idx == len(segments) - 1)
    for idx in reversed(range(len(segments))):
        seg, before = segments[idx], kept[idx]
        if seg.children:
            held = inside and idx == 0
            sub_peak, sub_cost = _simulate_input_held_once(
                chain, seg.children, before + (0 if held else chain.boundary[seg.start]), True)
            peak, cost = max(peak, sub_peak), cost + sub_cost
        else:
            peak = max(peak, before + leaf_bwd_peak(chain, seg.start))
            cost += chain.stages[seg.start].option(seg.option).recompute_flops
    return peak, cost


def _forward_in_recompute(chain: ChainModel, seg, last: bool) -> float:
    """FLOPs a region's recomputation spends on child `seg`'s forward, written out for
    `uniform_chain`: a child that is not last runs its whole forward (the next child reads
    its output); the last runs only what its kept values need (JAX's partial evaluation
    drops the rest): nothing for a region, which keeps only its input, and for a stage
    the forward its backward needs (what `nothing` recomputes) less what its own option
    recomputes in the backward anyway."""
    if not last:
        return sum(chain.stages[j].flops for j in range(seg.start, seg.stop))
    if seg.children:
        return 0.0
    stage = chain.stages[seg.start]
    return max(0.0, stage.option(NOTHING).recompute_flops
               - stage.option(seg.option).recompute_flops)


def test_plan_space_holds_revolve_schedules():
    """Every plan of a small uniform chain: simulate equals the reference above, and the
    best of them reaches Revolve's optimum at every slot count (the plan space and the
    recompute costing - a region's last child costs no forward - are Revolve's)."""
    for n in range(1, 7):
        chain = uniform_chain(n)
        frontier = []
        for plan in enumerate_plans(chain):
            frontier.append(simulate(chain, plan))
            assert frontier[-1] == _simulate_input_held_once(chain, plan), plan
        assert best_within(frontier, revolve_budget(n - 1)) == n  # nothing beyond taped steps
        for c in range(1, n + 1):
            best = best_within(frontier, revolve_budget(c))
            assert best is not None and int(best) - n == binomial_extra_steps(n, c), (n, c)


def test_no_recompute_at_the_no_remat_peak_with_default_resolution():
    """Sizes rounded up to the quantum used to put the store-all plan over a budget of
    exactly its peak, so the DP recomputed there (gpt2-tiny: 231168 FLOPs at its no-remat
    peak); the solver checks that plan in exact bytes."""
    n = 10
    stages = tuple(StageProfile(f"s{i}", 10.0, (KeepOption(STORE, (), 100_003, 0.0),
                                                 KeepOption(NOTHING, (), 7_001, 10.0)),
                                5_003, 11_007) for i in range(n))
    chain = ChainModel(stages, (0,) + (7_001,) * (n - 1) + (0,))
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top)  # the planner's default resolution
    assert solver.quantum > 1
    assert solver.solve(top).recompute_flops == 0.0
    assert solver.solve(top).segments == tuple(store_all(chain))
    assert solver.solve(top - 1).recompute_flops > 0.0  # one byte less does not fit it


@st.composite
def span_chains(draw):
    """Chains (random, with or without skips) with spans: stage ranges [a, c) that can
    also run as one checkpoint under a keep rule (a block copy checkpointed whole, as
    nn.remat per block does), each with its own keep, recompute and workspaces."""
    chain = draw(st.one_of(chains(max_stages=4), skip_chains(max_stages=4)))
    spans, a = [], 0
    while a + 2 <= chain.n:
        c = draw(st.integers(a + 2, min(a + 3, chain.n)))
        if draw(st.booleans()):
            flops = sum(s.flops for s in chain.stages[a:c])
            options = [KeepOption(NOTHING, (), chain.region_input_bytes(a, c), flops)]
            if draw(st.booleans()):
                options.append(KeepOption(DOTS, (300 + a,), draw(st.integers(0, 10)),
                                          float(draw(st.integers(0, int(flops))))))
            temps = st.integers(0, 4)
            spans.append((a, c, StageProfile(f"span{a}", flops, tuple(options), draw(temps),
                                             draw(temps))))
        a = c
    return dataclasses.replace(chain, spans=tuple(spans))


@settings(max_examples=20, deadline=None)
@given(span_chains())
def test_dp_equals_brute_force_with_spans(chain):
    """Spans are leaves like any other: the DP still finds brute force's optimum."""
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top + 3, resolution=top + 3)
    for budget in range(0, top + 3):
        dp, bf = solver.solve(budget), brute_force(chain, budget)
        assert (dp is None) == (bf is None), budget
        if dp is None:
            continue
        assert math.isclose(dp.recompute_flops, bf.recompute_flops, abs_tol=1e-9), budget
        peak, cost = simulate(chain, dp.segments)
        assert peak <= budget and math.isclose(cost, dp.recompute_flops, abs_tol=1e-9)
        validate_segments(dp.segments, chain.n)


def test_a_span_is_one_checkpoint_over_its_stages():
    """simulate charges a span leaf its own profile: keep, workspaces and recompute."""
    stage = lambda i: StageProfile(f"s{i}", 10.0, (KeepOption(STORE, (), 50, 0.0),
                                                   KeepOption(NOTHING, (), 4, 10.0)), 1, 1)
    span = StageProfile("block", 20.0, (KeepOption(DOTS, (7,), 9, 5.0),), 2, 3)
    chain = ChainModel((stage(0), stage(1), stage(2)), (0, 4, 4, 0), spans=((0, 2, span),))
    segments = (Segment(0, 2, DOTS, (7,)), Segment(2, 3, STORE))
    peak, cost = simulate(chain, segments)
    # forward of the span: its in (0) and out (4) boundaries, its keep 9, its workspace 2
    # = 15; then stage 2 stored on top: 9 + 4 + 0 + 50 + 1 = 64; its backward
    # 9 + 2*4 + 0 + 1 = 18; the span's backward 0 + 4 + 3 = 7.
    assert (peak, cost) == (64, 5.0)


def test_pooling_indices_are_held_from_the_start_to_the_backward_unless_stored():
    """A stage's pooling index arrays (memory.with_index_arrays; docs/jax-facts.md, fact
    9) are live from the step's start: made ahead in the forward until their stage runs;
    past it, to their argmax: in the stage's forward where it is stored, else in its
    backward, or its region's backward where a region checkpoints it. The stage's
    backward workspace (forward and backward compiled together) holds them, its
    forward's (compiled alone) does not: counted once either way."""
    stage = StageProfile("s", 1.0, (KeepOption(STORE, (), 10, 0.0),
                                    KeepOption(NOTHING, (), 1, 1.0)), 20, 5)
    chain = ChainModel((stage,) * 3, (0, 1, 1, 0))
    held = with_index_arrays(chain, [0, 6, 0])  # stage 1 pools: 6 bytes of indices
    points = lambda c, plan: {(p.phase, p.start): p.live_bytes  # noqa: E731
                              for p in timeline(c, plan)}

    def more(plan):
        plain, index = points(chain, plan), points(held, plan)
        return {k: index[k] - plain[k] for k in plain if index[k] != plain[k]}

    stored = tuple(Segment(i, i + 1, STORE) for i in range(3))
    # stored: ahead of stage 1 in stage 0's forward, and in stage 1's forward (its argmax)
    assert more(stored) == {("forward", 0): 6, ("forward", 1): 6}
    # stage 1 checkpointed: also from its forward to its backward
    ckpt = (Segment(0, 1, STORE), Segment(1, 2, NOTHING), Segment(2, 3, STORE))
    assert more(ckpt) == {("forward", 0): 6, ("forward", 1): 6, ("forward", 2): 6,
                          ("backward", 2): 6}
    # a region over stages 0-1: in the region's forward from its start (its peak moves
    # from stage 1's 1 + 1 + 20 = 22 to 28), kept by the region to its backward (stage
    # 2's points), and its recomputation holds them from its start to its end (the
    # region's kept input): an upper bound in stage 0's backward, where XLA has freed
    # them after stage 1's
    inner = (Segment(0, 1, STORE), Segment(1, 2, STORE))
    region = (Segment(0, 2, NOTHING, (), inner), Segment(2, 3, STORE))
    assert region_fwd_peak(chain, 0, 2, top=True) == 22
    assert region_fwd_peak(held, 0, 2, top=True) == 28
    assert more(region) == {("forward", 0): 6, ("forward", 2): 6, ("backward", 2): 6,
                            ("recompute", 0): 6, ("recompute", 1): 6, ("backward", 0): 6}
