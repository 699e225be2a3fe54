"""The planner on models written unlike remat_planner/models/ (tests/corpus.py): blocks
named by number and nested deep, masks and position ids passed into every block, dropout
keys, plain JAX, nnx, nn.scan, BatchNorm, a U-Net, tied embeddings.

Per model, at the XLA peak of each built-in policy applied per block in the model's own
source (`nn.remat(Block, policy=...)`, as a user writes it), one fresh `rp.plan` call must
fit (XLA's peak within the budget) and recompute no more than the built-in (XLA's FLOPs,
within REUSE_TOLERANCE of the step's, below which XLA's fusion decides). The plan at the
tightest of those budgets must give the unplanned step's gradients. And the memory
model, uncalibrated, must predict XLA's peak within 3% on every plan of
tests/error_plans.py, but for the plans MODEL_ERROR_OUT lists with their measured error.
Those compile dozens of steps per model and run in CI's slow part (`-m slow`); the stage
finder's check runs always. Where the planner does not yet meet the never-worse rule, the
case is a strict xfail whose reason gives the measured figures (KNOWN_MISSES), so that a
fix shows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import corpus
import error_plans
import remat_planner as rp
from remat_planner.apply import block_ranges
from remat_planner.baselines import POLICIES  # JAX's built-in policies, name -> policy
from remat_planner.graph import build_cost_graph, find_blocks
from remat_planner.planner import REUSE_TOLERANCE, per_block_plans
from remat_planner.trace import trace


# Models whose blocks are identical copies (a U-Net's and a CNN's change width).
UNIFORM_BLOCKS = ("hf_gpt2", "selfattn_gpt", "bert_encoder", "plain_jax", "nnx_lm", "mlp_mixer",
                  "vit", "llama_rope", "albert_shared")


def _measure(m: corpus.CorpusModel, loss_fn) -> rp.Measurement:
    return rp.measure(loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)


# (model, built-in) cases where one fresh rp.plan call does not yet fit the built-in's
# peak and recompute no more, with what was measured (jax 0.10.2, 2-core CPU).
KNOWN_MISSES: dict[tuple[str, str], str] = {}
# (none since the replay binds the nested calls a range holds whole, trace.steps: the one
# before, llama_rope under dots_saveable, 2.76% against 2.36% at the built-in's peak,
# came from the planner's flat replay of the embedding's jnp.take, 3,072 B more temp)
# The slow checks of these models run from tests/test_corpus_b.py, a file of its own so
# that `pytest -n 2 --dist loadfile` runs the two halves side by side (measured at
# b2f479d, seconds of slow test time per model: hf_gpt2 333, bert_encoder 228,
# selfattn_gpt 197, unet 194, plain_jax 160, mlp_mixer 129, cnn_bn 125, nnx_lm 121,
# scan_lm 94, resnet_maxpool 86; and at 9be9143, vit 181, llama_rope 125, albert_shared 118,
# t5_encdec with three blocks a side 247, plain_scan 55).
SECOND_HALF = ("bert_encoder", "selfattn_gpt", "mlp_mixer", "nnx_lm", "resnet_maxpool", "vit",
               "t5_encdec", "plain_scan")


def half(second: bool) -> list[str]:
    """The corpus models whose slow checks run in this file (False) or test_corpus_b.py."""
    return [m for m in corpus.MODELS if (m in SECOND_HALF) == second]


def cases(second: bool) -> list:
    """(model, built-in) cases of one half, a strict xfail where KNOWN_MISSES names it."""
    return [pytest.param(model, policy, id=f"{model}-{policy}",
                         marks=[pytest.mark.xfail(strict=True,
                                                  reason=KNOWN_MISSES[model, policy])]
                         if (model, policy) in KNOWN_MISSES else [])
            for model in half(second) for policy in POLICIES]


@functools.cache
def fresh_plan(name: str, budget: int) -> rp.Plan:
    """One fresh rp.plan call (its own analysis) at `budget`, kept for the checks of the
    same process that need the same plan: the never-worse check at the lowest built-in's
    peak and the gradient check there."""
    m = corpus.get(name)
    return rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, has_aux=m.has_aux)


@functools.cache
def analysis(name: str) -> rp.Analysis:
    """The model's calibrated analysis, shared by the five-budget and prediction checks."""
    m = corpus.get(name)
    return rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)


@functools.cache
def measured(name: str):
    """The model, XLA's figures without remat, and with each built-in policy per block."""
    m = corpus.get(name)
    base = _measure(m, m.loss_fn)
    builtins = {policy: _measure(m, m.make_remat_loss((fn,) * m.n_blocks))
                for policy, fn in POLICIES.items()} if m.n_blocks else {}
    return m, base, builtins


@pytest.mark.parametrize("name", UNIFORM_BLOCKS)
def test_blocks_found_from_dataflow(name):
    """Every copy of the repeated block is found whatever its module path, and cut off
    from its neighbours: the stages start at every copy's first equation."""
    m = corpus.get(name)
    program = trace(m.loss_fn, m.params, *m.batch, has_aux=m.has_aux)
    groups = find_blocks(program)
    assert max(len(g.starts) for g in groups) == m.n_blocks
    (group,) = [g for g in groups if len(g.starts) == m.n_blocks]
    starts = {s.start for s in build_cost_graph(program).stages}
    assert set(group.starts) <= starts
    assert len(block_ranges(program)) == m.n_blocks


def _module_ranges(program, prefixes) -> list[tuple[int, int]]:
    """The equation range under each module path prefix (the user's blocks, by name)."""
    out = []
    for prefix in prefixes:
        inside = [i for i, e in enumerate(program.eqns)
                  if (e.module_path + "/").startswith(prefix + "/")]
        assert inside == list(range(inside[0], inside[-1] + 1)), prefix
        out.append((inside[0], inside[-1] + 1))
    return out


@pytest.mark.parametrize("name,blocks", [
    ("unet", [f"UNet/{b}" for b in ("down_0", "down_1", "bottleneck", "up_0", "up_1")]),
    # the first block of stage 1 changes the width and has a projection shortcut: the
    # same block class with a branch added, which nn.remat(ResBlock) wraps too
    ("cnn_bn", [f"SmallResNet/stages_{s}/layers_{l}" for s, l in ((0, 0), (0, 1), (1, 0),
                                                                  (1, 1))]),
])
def test_blocks_at_other_widths_found(name, blocks):
    """A block repeated at several widths, with other layers between its copies (a U-Net's
    conv blocks around pooling and upsampling; a ResNet's blocks on either side of the
    block that changes the width, and that block itself, whose shortcut has a projection)
    is found as one group from the dataflow, each copy cut off as stages, and the
    per-block plans checkpoint exactly those copies."""
    m = corpus.get(name)
    program = trace(m.loss_fn, m.params, *m.batch, has_aux=m.has_aux)
    expected = _module_ranges(program, blocks)
    group = max(find_blocks(program), key=lambda g: len(g.starts) * g.length)
    assert list(group.ranges) == expected
    cost = build_cost_graph(program)
    bounds = {s.start for s in cost.stages} | {cost.stages[-1].stop}
    assert {c for r in expected for c in r} <= bounds
    an = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux,
                    measure_xla=False)
    checkpointed = [{(an.cost.stages[s.start].start, an.cost.stages[s.stop - 1].stop)
                     for s in plan if s.option != "store"} for plan in per_block_plans(an)]
    assert set(expected) in checkpointed


@pytest.mark.slow
@pytest.mark.parametrize("name,policy", cases(second=False))
def test_never_worse_than_a_builtin_policy(name, policy):
    check_never_worse(name, policy)


@pytest.mark.slow
@pytest.mark.parametrize("name", half(second=False))
def test_planned_gradients_equal_unplanned(name):
    check_planned_gradients(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", half(second=False))
def test_five_budgets_fit_and_beat_every_builtin_that_fits(name):
    check_five_budgets(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", half(second=False))
def test_model_predicts_xla_within_tolerance(name):
    check_model_error(name)


# (model, plan of tests/error_plans.py) whose uncalibrated prediction is not yet within
# error_plans.TOLERANCE (3%) of XLA's peak, with the error measured at 126fab2 (jax 0.10.2,
# scripts/model_error.py). The other plans of each model are within it.
MODEL_ERROR_OUT: dict[tuple[str, str], str] = {
    # in the forward, the random-bit loops' buffers XLA keeps besides the bits (fact 8)
    # and 168,208 B of temp allocated but not live at the peak
    ("hf_gpt2", "ckpt"): "-5.21%",
    ("hf_gpt2", "block0"): "-5.13%",
    ("hf_gpt2", "solve0"): "-5.21%",
    ("hf_gpt2", "solve0.25"): "-6.51%",
    ("hf_gpt2", "solve0.5"): "-5.75%",
    ("bert_encoder", "block1"): "-6.54%",
    ("bert_encoder", "block2"): "-3.79%",
    ("scan_lm", "solve0.25"): "-4.50%",
    ("scan_lm", "solve0.5"): "-5.62%",
    # a stored residual conv-BatchNorm block's input, recomputed by XLA from the block
    # before's buffers instead of held, is charged in full (docs/jax-facts.md, fact 18:
    # the four blocks' inputs are 917,504 B of the stored plan's 1,176,840 B over)
    ("cnn_bn", "store"): "+17.24%",
    ("cnn_bn", "ckpt"): "+5.34%",
    ("cnn_bn", "block1"): "+3.89%",
    ("cnn_bn", "solve0.25"): "+7.37%",
    ("cnn_bn", "solve0.5"): "+5.92%",
    ("cnn_bn", "solve0.75"): "+14.35%",
    ("cnn_bn", "solve0.95"): "+15.82%",
    # measured once the conv blocks' units are cut too (graph.unit_groups): the first
    # block stored as one stage kept 820,672 B, as two units 689,600 B, less by the
    # 131,072 B activation between them; the stored plan went from +2.02% to -5.13%
    # against the same XLA peak. Its smallest feasible plan went from 3,086,572 B to
    # 2,825,132 B
    ("unet", "store"): "-5.13%",
    ("unet", "block2"): "-5.29%",
    ("unet", "block3"): "-6.86%",
    ("unet", "block6"): "-5.29%",
    ("unet", "solve0.5"): "-7.38%",
    ("unet", "solve0.75"): "-8.06%",
    ("unet", "solve0.95"): "-5.67%",
    ("mlp_mixer", "ckpt"): "-3.11%",
    ("resnet_maxpool", "store"): "+4.02%",
    ("resnet_maxpool", "block0"): "-3.27%",
    ("resnet_maxpool", "block1"): "-3.28%",
    ("resnet_maxpool", "solve0.25"): "+4.51%",
    ("resnet_maxpool", "solve0.5"): "+4.51%",
    ("resnet_maxpool", "solve0.75"): "+4.51%",
    ("resnet_maxpool", "solve0.95"): "+4.51%",
    # the models added since, measured when they were added (the planner had not seen them)
    ("vit", "ckpt"): "+3.54%",
    ("vit", "block1"): "-9.72%",
    ("vit", "block2"): "-5.09%",
    # XLA copies Lion's momentum and parameters into temp at the step's start
    ("llama_rope", "ckpt"): "-15.01%",
    ("llama_rope", "block0"): "-9.95%",
    ("llama_rope", "block1"): "+6.69%",
    ("llama_rope", "block2"): "+8.26%",
    ("llama_rope", "solve0"): "-25.31%",
    ("llama_rope", "solve0.5"): "+6.33%",
    ("llama_rope", "solve0.75"): "+3.37%",
    ("albert_shared", "store"): "+9.21%",
    ("albert_shared", "block0"): "-6.29%",
    ("albert_shared", "block1"): "-8.49%",
    ("albert_shared", "solve0"): "-13.00%",
    ("albert_shared", "solve0.75"): "+3.40%",
    ("albert_shared", "solve0.95"): "+7.65%",
    # measured once the encoder output every decoder block reads counts once
    # (memory.shared_differentiated): each plan 2-4% lower than when every reading
    # stage kept it (ckpt -10.77%, block0 +3.62%, solve0 -4.25% then)
    ("t5_encdec", "ckpt"): "-13.02%",
    ("t5_encdec", "block3"): "-11.16%",
    ("t5_encdec", "block5"): "-8.01%",
    ("t5_encdec", "block6"): "-6.52%",
    ("t5_encdec", "block8"): "-4.96%",
    ("t5_encdec", "solve0"): "-7.67%",
    ("t5_encdec", "solve0.25"): "-5.90%",
    ("t5_encdec", "solve0.5"): "-4.59%",
    ("plain_scan", "solve0.25"): "-4.00%",
    ("plain_scan", "solve0.5"): "-3.01%",
}


def check_model_error(name: str) -> None:
    """Every plan of tests/error_plans.py, compiled: the uncalibrated memory model within
    3% of XLA's peak, except the plans MODEL_ERROR_OUT names, which must still be outside
    it (so that a fix, or a change in which plans the solver picks, shows)."""
    _, rows = error_plans.measure(name, analysis(name))
    errors = {row.label: row.raw for row in rows}
    report = ", ".join(f"{label} {e:+.2%}" for label, e in errors.items())
    out = {label for label, e in errors.items() if abs(e) > error_plans.TOLERANCE}
    known = {label for model, label in MODEL_ERROR_OUT if model == name}
    assert out <= known, f"{name}: outside 3% of XLA: {sorted(out - known)}; all: {report}"
    assert known <= out, (f"{name}: now within 3% of XLA (take them out of MODEL_ERROR_OUT): "
                          f"{sorted(known - out)}; all: {report}")


def check_never_worse(name: str, policy: str) -> None:
    """At the built-in's XLA peak, one fresh rp.plan call fits and recomputes no more."""
    m, base, builtins = measured(name)
    builtin = builtins[policy]
    budget = builtin.peak_bytes
    plan = fresh_plan(name, budget)
    report = (f"{name} at {policy}'s peak {budget}: plan {plan.measured_peak_bytes} B "
              f"{plan.measured_flops / base.flops - 1:.4%} vs {builtin.flops / base.flops - 1:.4%}")
    assert plan.measured_peak_bytes <= budget, report
    assert plan.measured_flops <= builtin.flops + REUSE_TOLERANCE * base.flops, report


# Models whose smallest feasible budget is checked against the lowest built-in's peak
# (one rp.plan call at the model's smallest budget, up to six compiles: CI's time keeps
# it to one model; run from tests/test_corpus_b.py). The corpus ViT, at its model's
# smallest budget (9.10 MiB), once named 9,965,296 B, the lowest of the closed loop's
# rounds, above every block under nothing_saveable (9,912,136 B, measured by the same
# call's per-block probe); the calibration's plan checkpointing every stage, measured on
# the same analysis, fits 9,805,208 B.
SMALLEST_CHECKED = ("vit",)


def check_smallest_feasible(name: str) -> None:
    """At the model's smallest feasible budget, rp.plan fits or names a budget, and either
    is no higher than the lowest built-in's XLA peak."""
    m, base, builtins = measured(name)
    lowest = min(b.peak_bytes for b in builtins.values())
    an = analysis(name)
    an = dataclasses.replace(an, verified=dict(an.verified))  # the shared one unchanged
    budget = an.min_feasible_budget()
    try:
        smallest = rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer,
                           has_aux=m.has_aux, analysis=an).measured_peak_bytes
    except rp.InfeasibleBudgetError as err:
        smallest = err.min_feasible_bytes
    assert smallest <= lowest, f"{name}: smallest feasible {smallest} B > {lowest} B"


def check_planned_gradients(name: str) -> None:
    """The plan at the lowest built-in peak gives the unplanned step's loss and gradients."""
    m, base, builtins = measured(name)
    budget = min(b.peak_bytes for b in builtins.values())
    plan = fresh_plan(name, budget)
    assert plan.measured_peak_bytes <= budget
    params, batch = m.init(jax.random.key(0))
    planned = plan.apply(m.loss_fn)
    if m.has_aux:
        (l0, a0), g0 = jax.value_and_grad(m.loss_fn, has_aux=True)(params, *batch)
        (l1, a1), g1 = jax.value_and_grad(planned, has_aux=True)(params, *batch)
        for x, y in zip(jax.tree.leaves(a1), jax.tree.leaves(a0)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    else:
        l0, g0 = jax.value_and_grad(m.loss_fn)(params, *batch)
        l1, g1 = jax.value_and_grad(planned)(params, *batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert jax.tree.structure(g1) == jax.tree.structure(g0)
    # a leaf's own scale, but not below 1e-3 of the largest gradient: some gradients are
    # zero up to rounding (an attention key bias's: the corpus ViT's are ~1e-9 of 0.5)
    largest = max(float(np.abs(np.asarray(y)).max()) for y in jax.tree.leaves(g0))
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        y = np.asarray(y)
        scale = max(float(np.abs(y).max()), 1e-3 * largest) or 1.0
        np.testing.assert_allclose(np.asarray(x), y, rtol=m.gradient_rtol,
                                   atol=m.gradient_rtol * scale)


def check_five_budgets(name: str) -> None:
    """At five budgets from the lowest built-in peak to the step's own peak without remat
    (geometric), planned smallest first on one analysis of the model, as a sweep of your
    own would: XLA's peak within the budget, and no more recompute than any built-in per
    block whose XLA peak fits the same budget. A built-in
    that XLA counts below the step without remat (its fusion of the replayed forward;
    the plain-JAX transformer under dots_saveable: -1.39%) recomputes nothing, which is
    what it is held to."""
    m, base, builtins = measured(name)
    lo = min(b.peak_bytes for b in builtins.values())
    an = analysis(name)
    failures = []
    for budget in np.geomspace(lo, base.peak_bytes, 5).astype(np.int64):
        budget = int(budget)
        plan = rp.plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, analysis=an)
        ours = plan.measured_flops / base.flops - 1
        if plan.measured_peak_bytes > budget:
            failures.append(f"at {budget}: XLA peak {plan.measured_peak_bytes}")
        for policy, b in builtins.items():
            theirs = max(b.flops / base.flops - 1, 0.0)
            if b.peak_bytes <= budget and ours > theirs + REUSE_TOLERANCE:
                failures.append(f"at {budget}: {ours:.4%} against {policy}'s {theirs:.4%}")
    assert not failures, failures
