"""The chain DP against brute force over every plan, on random small chains."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat_planner.memory import ChainModel, KeepOption, StageProfile, simulate
from remat_planner.plan import DOTS, NOTHING, STORE, Segment, validate_segments
from remat_planner.solve import ChainSolver, brute_force, enumerate_plans


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


def store_all(chain: ChainModel):
    return [Segment(i, i + 1, STORE) for i in range(chain.n)]


@settings(max_examples=60, deadline=None)
@given(chains())
def test_dp_equals_brute_force_at_every_budget(chain):
    top = simulate(chain, store_all(chain))[0]
    solver = ChainSolver(chain, top + 3, resolution=top + 3)  # quantum 1: exact in bytes
    assert solver.quantum == 1
    for budget in range(0, top + 3):
        dp, bf = solver.solve(budget), brute_force(chain, budget)
        assert (dp is None) == (bf is None), budget
        if dp is None:
            continue
        assert math.isclose(dp.recompute_flops, bf.recompute_flops, abs_tol=1e-9), budget
        peak, cost = simulate(chain, dp.segments)
        assert peak <= budget
        assert math.isclose(cost, dp.recompute_flops, abs_tol=1e-9)
        validate_segments(dp.segments, chain.n)


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
