"""A differentiated value that every copy of a block reads (memory.shared_differentiated):
one buffer in the step, not one per stage reading it.

The model is a Perceiver written for this test, unlike the zoo and the corpus: 32 learned
latents cross-attend, in every block, to one input array (4 x 1024 x 64 float32,
1,048,576 B) made by a Dense layer from the pixels, so differentiated. Profiled as every
cross-attention stage's input, it was counted in each stage's keep (the `nothing` keep
of each: 1,081,344 B, the array and the latents); XLA's live set at the stored plan's
peak holds it once. Before, the model put the per-block `dots_saveable` plan 7.60% over
XLA, and at that plan's XLA peak (24,434,720 B) `rp.plan` recomputed 7.44% of the step
against the built-in's 0.98%.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_planner as rp
import image_classifier
from remat_planner.constants import REUSE_TOLERANCE
from remat_planner.graph import build_cost_graph
from remat_planner.memory import shared_differentiated
from remat_planner.trace import trace


class PerceiverBlock(nn.Module):
    d: int

    @nn.compact
    def __call__(self, latents, inputs):
        latents = latents + nn.MultiHeadDotProductAttention(num_heads=2)(
            nn.LayerNorm()(latents), inputs)
        h = nn.LayerNorm()(latents)
        latents = latents + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
        h = nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(latents))))
        return latents + h


class Perceiver(nn.Module):
    blocks: int = 4
    d: int = 64
    policy: object = None

    @nn.compact
    def __call__(self, images):
        inputs = nn.Dense(self.d)(images.reshape(images.shape[0], -1, images.shape[-1]))
        init = self.param("latents", nn.initializers.normal(0.02), (32, self.d))
        latents = jnp.broadcast_to(init, (images.shape[0], 32, self.d))
        cls = PerceiverBlock if self.policy is None else nn.remat(PerceiverBlock,
                                                                  policy=self.policy)
        for i in range(self.blocks):
            latents = cls(self.d, name=f"layers_{i}")(latents, inputs)
        return nn.Dense(10)(latents.mean(1))


def _workload(policy=None):
    return image_classifier.workload(Perceiver, policy)


def test_the_input_array_is_one_shared_value():
    """The input array is the one differentiated value the blocks share: read from the
    first block's stage to the last's, 1,048,576 B."""
    loss_fn, params, batch = _workload()
    program = trace(loss_fn, params, *batch)
    cost = build_cost_graph(program)
    shared = shared_differentiated(program, cost)
    assert [(program.avals[v].shape, b) for v, (*_, b) in shared.items()] == [
        ((4, 1024, 64), 1_048_576)]
    (defined, first, last, _), = shared.values()
    assert defined < first < last
    names = {cost.stages[k].name.split("/")[1].split("[")[0] for k in (first, last)}
    assert names == {"layers_0", "layers_3"}


def test_no_stage_keeps_it():
    """Carried once, it is in no stage's keep and no boundary: each cross-attention
    stage's `nothing` keep is the latents alone."""
    loss_fn, params, batch = _workload()
    an = rp.analyze(loss_fn, params, batch, optax.adamw(1e-3), calibrate=False)
    cross = [s for s in an.chain.stages if "MultiHeadDotProductAttention_0" in s.name]
    assert len(cross) == 4
    assert {s.option("nothing").keep_bytes for s in cross} == {4 * 32 * 64 * 4}
    assert max(an.chain.boundary[2:]) < 1_048_576


@pytest.mark.slow
def test_never_worse_than_dots_saveable_per_block():
    """At the XLA peak of `nn.remat(PerceiverBlock, policy=dots_saveable)`, one fresh
    rp.plan call fits and recomputes no more."""
    loss_fn, params, batch = _workload()
    opt = optax.adamw(1e-3)
    builtin_loss, _, _ = _workload(jax.checkpoint_policies.dots_saveable)
    base = rp.measure(loss_fn, params, batch, opt)
    builtin = rp.measure(builtin_loss, params, batch, opt)
    plan = rp.plan(loss_fn, params, batch, builtin.peak_bytes, opt)
    assert plan.measured_peak_bytes <= builtin.peak_bytes
    assert plan.measured_flops <= builtin.flops + REUSE_TOLERANCE * base.flops
