"""The `dots_narrow` keep rule: attention's probs @ v kept, its scores recomputed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.baselines import measure_builtin
from remat_planner.step import Step
from remat_planner.plan import DOTS, DOTS_NARROW, DOTS_NO_BATCH, STORE, Segment
from remat_planner.policies import dot_is_narrow, dot_output_size
from test_pipeline import tiny  # noqa: F401  (gpt2-tiny workload, optimizer, analysis)

# (batch, heads) as batch dims; q, k, v: (2, 4, T=16, dh=8)
SCORES = ((2, 4, 16, 8), (2, 4, 16, 8), (((3,), (3,)), ((0, 1), (0, 1))))
MIX = ((2, 4, 16, 16), (2, 4, 16, 8), (((3,), (2,)), ((0, 1), (0, 1))))
PROJ = ((32, 64), (64, 256), (((1,), (0,)), ((), ())))


def test_dot_output_size():
    assert dot_output_size(*SCORES) == 2 * 4 * 16 * 16
    assert dot_output_size(*MIX) == 2 * 4 * 16 * 8
    assert dot_output_size(*PROJ) == 32 * 256


def test_narrow_rule_keeps_projections_and_mix_not_scores():
    assert dot_is_narrow(*PROJ)        # no batch dims: kept even though it grows
    assert dot_is_narrow(*MIX)         # (B, H, T, dh) from (B, H, T, T): shrinks
    assert not dot_is_narrow(*SCORES)  # (B, H, T, T) from (B, H, T, dh): grows


def _attention(x, w):
    q, k, v = jnp.einsum("btd,de->bte", x, w), x, x
    q, k, v = (a.reshape(2, 16, 4, 8).transpose(0, 2, 1, 3) for a in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    return jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s), v) ** 2)


def test_policy_saves_the_mix_and_recomputes_less():
    """As a jax.checkpoint policy: the same gradients, fewer recomputed FLOPs than
    dots_with_no_batch_dims_saveable, and the scores are not among the residuals."""
    x, w = jnp.ones((2, 16, 32)) * 0.1, jnp.eye(32)

    def residual_shapes(policy):
        f = jax.checkpoint(_attention, policy=policy)
        _, vjp = jax.vjp(f, x, w)
        return sorted(tuple(l.shape) for l in jax.tree.leaves(vjp) if hasattr(l, "shape"))

    narrow = residual_shapes(rp.dots_narrow_saveable)
    dnb = residual_shapes(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    assert (2, 4, 16, 8) in narrow and (2, 4, 16, 8) not in dnb
    assert (2, 4, 16, 16) not in narrow
    g_narrow = jax.grad(jax.checkpoint(_attention, policy=rp.dots_narrow_saveable))(x, w)
    np.testing.assert_allclose(g_narrow, jax.grad(_attention)(x, w), rtol=1e-6)


def test_attention_stages_get_the_option_mlp_stages_do_not(tiny):
    _, _, an = tiny
    attention = [s for s in an.chain.stages if DOTS_NARROW in {o.name for o in s.options}]
    assert attention, "no stage has a dots_narrow option"
    for s in attention:
        dnb, narrow, dots = s.option(DOTS_NO_BATCH), s.option(DOTS_NARROW), s.option(DOTS)
        assert set(dnb.saved) < set(narrow.saved) < set(dots.saved)
        assert dnb.keep_bytes < narrow.keep_bytes < dots.keep_bytes
        assert dots.recompute_flops < narrow.recompute_flops < dnb.recompute_flops
    # an MLP has no batched dot: its narrow keep set is dots_no_batch's, not offered twice
    assert len(attention) < an.chain.n - 1


def test_dots_narrow_plan_gradients_exact_and_cheaper_than_builtin(tiny):
    wl, opt, an = tiny
    key = jax.random.key(0)
    params, batch = wl.init_params(key), wl.synthetic_batch(jax.random.fold_in(key, 1))
    segments = []
    for i, s in enumerate(an.chain.stages):
        names = {o.name for o in s.options}
        rule = DOTS_NARROW if DOTS_NARROW in names else DOTS_NO_BATCH if DOTS_NO_BATCH in names else STORE
        o = s.option(rule)
        segments.append(Segment(i, i + 1, o.name, o.saved if rule != STORE else ()))
    plan = pl.plan_from_segments(an, segments, 0, 0, params, batch)
    planned = plan.apply(wl.loss_fn)
    loss0, g0 = jax.value_and_grad(wl.loss_fn)(params, *batch)
    loss1, g1 = jax.jit(jax.value_and_grad(planned))(params, *batch)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # XLA agrees: fewer FLOPs than JAX's dots_with_no_batch_dims_saveable per block
    P, B = wl.abstract_params, wl.abstract_batch
    ours = rp.measure(plan.apply(wl.loss_fn), P, B, opt)
    builtin = measure_builtin("dots_with_no_batch_dims_saveable", Step(wl.loss_fn, opt), P, B)
    assert ours.flops < builtin.flops
