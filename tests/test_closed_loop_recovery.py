"""The closed loop's recovery paths, driven on purpose with a memory model made wrong by a
set amount (issue 19, point 6).

`rp.analyze` returns a frozen `Analysis`; `dataclasses.replace` gives a copy whose memory
model (every activation byte of the chain, whole-block spans included) is scaled by a
factor, so that the model under- or overstates what XLA will measure by a known amount,
while XLA's own figures stay the truth every plan is held to. Each test gets its own
copy with an empty `verified` cache (`dataclasses.replace` would otherwise share the
dict), so no test depends on plans another test measured.

Model: the corpus's plain JAX transformer (tests/corpus.py), float32, AdamW; one
analysis (two compiles) and at most four verification compiles per `rp.plan` call.

Checked to fail with the recovery switched off, at dd3c3e8 on a copy of the tree: with
`break` before the over-budget branch of `planner.plan`'s loop re-solves, the re-solve,
suggested-budget and reuse tests fail (InfeasibleBudgetError: every plan over); with
`cheaper_verified` returning its `best`, the reuse test fails; with `_probe_cheaper` and
`_probe_per_block` returning theirs, the probe test fails.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

import corpus
import remat_planner as rp
from remat_planner.memory import ChainModel, scale_chain, simulate
from remat_planner.plan import STORE, Segment

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow

UNDER = 0.6  # the model counts 60% of every activation byte: XLA finds its plans over
OVER = 1.3   # the model counts 130%: its plans fit with slack that the probes may spend


@pytest.fixture(scope="module")
def plain():
    m = corpus.get("plain_jax")
    return m, rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer)


def fresh(an: rp.Analysis) -> rp.Analysis:
    """A copy of `an` that has measured no plan yet."""
    return dataclasses.replace(an, verified={})


def wrong(an: rp.Analysis, factor: float, verified: dict | None = None) -> rp.Analysis:
    """`an` with every activation byte of its memory model times `factor` (stages, whole-
    block spans, cuts); calibration offset and fixed memory unchanged."""
    chain = scale_chain(an.chain, factor)
    spans = tuple((a, c, scale_chain(ChainModel((p,), (0, 0)), factor).stages[0])
                  for a, c, p in an.chain.spans)
    chain = dataclasses.replace(chain, spans=spans)
    act, _ = simulate(chain, [Segment(i, i + 1, STORE) for i in range(chain.n)])
    return dataclasses.replace(an, chain=chain, noremat_activation_bytes=act,
                               verified={} if verified is None else verified)


def _plan(m, budget, an, **kw) -> rp.Plan:
    return rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, analysis=an, **kw)


def _suggested(err: rp.InfeasibleBudgetError) -> int:
    """The budget the error's message tells the user to raise --budget to."""
    found = re.search(r"raise --budget to at least (\S+) (\S+)", str(err))
    assert found, str(err)
    return rp.parse_budget(found.group(1) + found.group(2))


def test_the_wrong_model_is_wrong_by_the_set_amount(plain):
    """The premise of the tests below: the scaled model's no-remat prediction is off from
    XLA's by the scale on the activations (fixed memory and offset unchanged), give or
    take one stage's gradients: those are not activations, are not scaled, and can move
    the peak to another stage's backward (measured at 60%: 2,034,294 B of activations
    at the peak, 17,400 B over 60% of 3,361,490, the peak moving from the head's
    backward to the stage before it, whose 66,048 B of gradients are then live). The
    gradients at the peak are not scaled either: the loss head, one stage, holds its
    weight's gradient at the peak (65,536 B), so 130% puts the peak 0.3 x that under
    130% of the activations."""
    _, an = plain
    grads = max(s.grad_bytes for s in an.chain.stages)
    rounding = an.chain.n  # scale_chain rounds each byte count
    for factor in (UNDER, OVER):
        w = wrong(an, factor)
        act = an.noremat_activation_bytes
        below = rounding + max(factor - 1, 0) * grads
        assert factor * act - below <= w.noremat_activation_bytes <= factor * act + grads
        error = w.noremat_predicted_peak - an.noremat.peak_bytes
        assert (factor - 1) * act - below <= error <= (factor - 1) * act + grads


def test_plan_xla_finds_over_is_re_solved_until_it_fits(plain):
    """The model understates every plan by 40% of its activations: the first plan it
    solves at 63% of the no-remat peak is over by XLA (measured: 4,874,112 B against
    3,893,916), the loop lowers its target by the excess and re-solves, and the plan
    returned fits by XLA (3,860,864 B). With the re-solve switched off no plan of this
    call fits (the per-block probe measures 3,953,152 B) and InfeasibleBudgetError is
    raised. (At 60%, 3,708,492 B, the right model's plans measure over too since stored
    stages are charged what XLA keeps: its lowest, 3,713,408 B.)"""
    m, an = plain
    budget = an.noremat.peak_bytes * 63 // 100
    w = wrong(an, UNDER)
    p = _plan(m, budget, w)
    over = [v.peak_bytes for v in w.verified.values() if v.peak_bytes > budget]
    assert over, "the wrong model's first plan should be over the budget by XLA"
    assert p.measured_peak_bytes <= budget and p.fits()
    assert rp.measure(p.apply(m.loss_fn), m.params, m.batch,
                      m.optimizer).peak_bytes == p.measured_peak_bytes
    assert not p.metadata.get("verified_at_another_budget")  # this call's own re-solve
    assert p.metadata["compiles"] <= 4


def test_every_plan_over_raises_with_xla_lowest_peak(plain):
    """At the understating model's own smallest feasible budget no plan fits by XLA: the
    loop, the probes and the verified plans all fail, and the error says so, naming XLA's
    lowest measured peak (above the budget) as the smallest feasible budget: the lowest
    of every plan measured on the analysis, not only the loop's rounds (the corpus ViT at
    its model's smallest budget, 9.10 MiB: the rounds' lowest 9,965,296 B, above every
    block under nothing_saveable, 9,912,136 B; the calibration's plan, 9,805,208 B)."""
    m, an = plain
    w = wrong(an, UNDER)
    budget = w.min_feasible_budget()
    assert budget < an.min_feasible_budget()  # the premise: the model is wrong here
    with pytest.raises(rp.InfeasibleBudgetError,
                       match="XLA measured every plan tried over the budget") as info:
        _plan(m, budget, w)
    err = info.value
    lowest = min(v.peak_bytes for v in w.verified.values())
    assert err.min_feasible_bytes == lowest > budget
    assert err.exit_code == 3 and "\n" not in str(err)


def test_budget_suggested_after_xla_measured_every_plan_over_fits(plain):
    """The error above suggests a budget from XLA's lowest measured peak: a new `rp.plan`
    call there, as a user rerunning with that budget makes (the correct model, analysed
    afresh), fits by XLA. Its analysis measured the plan checkpointing every stage for
    the calibration (3,677,592 B), which the call may return. Without that measurement
    (the analysis of the fixture with no plan measured) the correct model's most frugal
    plan was 3,728,264 B by XLA, 0.2% over the 3.72 MB named: near its smallest budget
    the model put this model's plans 5-8% under XLA then (scripts/model_error.py; within
    1.7% since its loss head is one stage, docs/jax-facts.md, fact 13), so its most
    frugal plan was not XLA's."""
    m, an = plain
    w = wrong(an, UNDER)
    with pytest.raises(rp.InfeasibleBudgetError) as info:
        _plan(m, w.min_feasible_budget(), w)
    suggested = _suggested(info.value)
    assert suggested >= info.value.min_feasible_bytes
    p = _plan(m, suggested, None)
    assert p.measured_peak_bytes <= suggested


def test_budget_suggested_for_a_far_too_small_budget_fits(plain):
    """`rp.plan` at 1 MB names the smallest feasible budget; planned there, the plan fits.
    (Before planner.plan measured the most frugal plan first, it named the model's
    3.51 MB, which XLA did not fit: 3,704,704 B.)"""
    m, an = plain
    with pytest.raises(rp.InfeasibleBudgetError) as info:
        _plan(m, "1MB", fresh(an))
    suggested = _suggested(info.value)
    p = _plan(m, suggested, fresh(an))
    assert p.measured_peak_bytes <= suggested


def test_probes_spend_the_slack_of_an_overstating_model(plain):
    """The model overstates every plan by 30% of its activations: with one round, its plan
    fits with slack; the probes (per-block plans and the cheaper frontier points, shifted
    by the error measured on that plan) compile cheaper plans and the cheapest that XLA
    fits is returned. With the probes off, the round's own plan would be returned."""
    m, an = plain
    budget = an.noremat.peak_bytes * 3 // 4
    alone = _plan(m, budget, wrong(an, OVER), max_rounds=1, max_compiles=1)
    probed = _plan(m, budget, wrong(an, OVER), max_rounds=1)
    assert alone.measured_peak_bytes <= budget and probed.measured_peak_bytes <= budget
    assert probed.metadata["compiles"] > 1
    assert probed.measured_flops < alone.measured_flops, (probed.measured_flops,
                                                          alone.measured_flops)


def test_cheaper_plan_verified_at_another_budget_is_reused(plain):
    """A plan XLA fitted earlier on the same analysis (here by the correct model) is taken
    instead of a dearer one the overstating model finds with its single compile, without
    compiling it again."""
    m, an = plain
    shared = fresh(an)
    budget = an.noremat.peak_bytes * 8 // 10
    good = _plan(m, budget, shared)
    overstating = wrong(shared, OVER, verified=shared.verified)
    p = _plan(m, budget, overstating, max_rounds=1, max_compiles=1)
    assert p.metadata["compiles"] == 1  # the overstating model's own plan was compiled ...
    assert len(shared.verified) > 1
    assert p.segments == good.segments  # ... and the cheaper verified one returned
    assert p.metadata.get("verified_at_another_budget") is True
    assert p.measured_peak_bytes == good.measured_peak_bytes <= budget


def test_per_block_plan_measured_before_calling_a_budget_infeasible(plain):
    """At the peak of nothing_saveable per block a model overstating every activation byte
    twice finds no plan (its smallest feasible budget is above it): before calling the
    budget infeasible, the
    most frugal plan and then the per-block plans are measured, and the per-block plan,
    which is the built-in, fits. With the per-block plans left out of that path, the
    most frugal plan came back (XLA fits it too, 237.2e6 FLOPs against the built-in's
    175.4e6)."""
    import jax
    m, an = plain
    builtin = rp.measure(m.make_remat_loss((jax.checkpoint_policies.nothing_saveable,)
                                           * m.n_blocks), m.params, m.batch, m.optimizer)
    w = wrong(an, 2.0)
    assert w.min_feasible_budget() > builtin.peak_bytes  # the premise: the model says no
    p = _plan(m, builtin.peak_bytes, w)
    assert p.measured_peak_bytes <= builtin.peak_bytes
    assert p.measured_flops <= builtin.flops * (1 + 1e-4)
    assert p.metadata["compiles"] <= 4
