"""The closed loop's inputs and bounds on corpus models (tests/corpus.py): whole-block
checkpoints predicted from XLA's own measurement of the block, the number of whole-step
compiles one `rp.plan` call makes, and the calibration of a model whose blocks are one
`nn.scan`."""

from __future__ import annotations

import pytest

import corpus
import remat_planner as rp
from remat_planner.memory import simulate
from remat_planner.planner import MAX_COMPILES, MAX_VERIFY_COMPILES, per_block_plans

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plain_jax():
    m = corpus.get("plain_jax")
    return m, rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer)


def test_whole_block_checkpoints_predicted_within_3pct(plain_jax):
    """Each of the per-block plans (every block checkpointed whole under nothing /
    dots_with_no_batch_dims / dots, what nn.remat(Block, policy=...) runs) is predicted
    within 3% of XLA's peak: the block's workspaces are XLA's for the whole block, not
    scaled by the fit on single stages (planner._scaled)."""
    m, an = plain_jax
    plans = per_block_plans(an.chain)
    assert len(plans) == 3
    for segments in plans:
        predicted = an.predicted_peak(simulate(an.chain, segments)[0])
        loss = rp.Plan(segments=segments, stages=an.stage_infos,
                       fingerprint=an.program.fingerprint(), budget_bytes=0,
                       predicted_peak_bytes=predicted, recompute_flops=0.0,
                       fixed_bytes=an.fixed.total, step_flops=an.step_flops).apply(m.loss_fn)
        xla = rp.measure(loss, m.params, m.batch, m.optimizer).peak_bytes
        assert abs(predicted / xla - 1) < 0.03, (segments[1].option, predicted, xla)


def test_a_plan_call_compiles_at_most_max_compiles(plain_jax):
    """A fresh call: the analysis's two calibration compiles and at most
    MAX_VERIFY_COMPILES to verify, MAX_COMPILES in all; with the analysis given, the same
    verification budget, so the plan does not depend on how the analysis was made."""
    m, an = plain_jax
    assert an.calibration_compiles + MAX_VERIFY_COMPILES == MAX_COMPILES == 6
    budget = (an.noremat.peak_bytes * 6) // 10
    fresh = rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer)
    assert fresh.measured_peak_bytes <= budget
    assert 1 <= fresh.metadata["compiles"] <= MAX_VERIFY_COMPILES
    reused = rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, analysis=an)
    assert reused.segments == fresh.segments
    assert reused.measured_peak_bytes == fresh.measured_peak_bytes


@pytest.fixture(scope="module")
def scan_lm():
    m = corpus.get("scan_lm")
    return m, rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer)


def test_a_layer_stack_scan_is_calibrated(scan_lm):
    """Blocks stacked by nn.scan (the MaxText / levanter layout): the analysis calibrates
    on the checkpointed stack, whose scheme need not be on the stack's frontier (it was
    looked up there, a KeyError), and a flat scheme is predicted within 3% of XLA."""
    m, an = scan_lm
    assert an.scan_chain is not None and an.calibration_compiles == 2
    k = an.scan_chain.stage
    flat = [o.name for o in an.chain.stages[k].options
            if o.name.startswith("scan:") and not any(c in o.name for c in ";*/")
            and o.name != an.chain.stages[k].options[0].name]
    assert flat
    segments = tuple(rp.Segment(i, i + 1, flat[0] if i == k else "store")
                     for i in range(an.chain.n))
    predicted = an.predicted_peak(simulate(an.chain_for(segments), segments)[0])
    loss = rp.Plan(segments=segments, stages=an.stage_infos,
                   fingerprint=an.program.fingerprint(), budget_bytes=0,
                   predicted_peak_bytes=predicted, recompute_flops=0.0,
                   fixed_bytes=an.fixed.total, step_flops=an.step_flops).apply(m.loss_fn)
    xla = rp.measure(loss, m.params, m.batch, m.optimizer).peak_bytes
    assert abs(predicted / xla - 1) < 0.03, (flat[0], predicted, xla)


@pytest.mark.xfail(strict=True, reason="on an nn.scan stack whose parameters are the scan's "
                   "xs, the model's error on a scheme grows with the layers per iteration g: "
                   "within 3% at g = 1, 8-12% under XLA at g = 2, 7-11% at g = 3, 31-38% at "
                   "g = 6 (scan_lm: 'scan:6x2*[dots_narrow];4*nothing|dots_no_batch' 5.72 MB "
                   "modelled, 9.20 MB by XLA, above the 7.70 MB of the step without remat), so "
                   "the closed loop finds no plan under 85% of the step without remat")
def test_a_layer_stack_scan_is_planned(scan_lm):
    m, an = scan_lm
    budget = (an.noremat.peak_bytes * 85) // 100
    p = rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, analysis=an)
    assert p.measured_peak_bytes <= budget
