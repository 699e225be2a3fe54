"""A block made of smaller repeated units (graph.unit_groups): structure alone cannot tell
which of the two the user wraps in `nn.remat`, so both are blocks of the plan space.

The model is a DenseNet written for this test, unlike the zoo and the corpus: every
layer reads the concatenation of all earlier features (the stream widens at every
layer, so no layer boundary crosses as little as the dense block's input), with a
transition between two dense blocks of three layers. find_blocks takes the dense block
(three layers, twice, equal up to shapes); before unit_groups, the first dense block was
one stage and the smallest feasible plan was 21.38 MB against 12.43 MB for
`nn.remat(DenseLayer, policy=nothing_saveable)` (measured on a batch of 4 at 32 x 32).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import remat_planner as rp
import image_classifier
from remat_planner.graph import build_cost_graph, find_blocks, unit_groups
from remat_planner.planner import per_block_plans
from remat_planner.trace import trace


class DenseLayer(nn.Module):
    growth: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.GroupNorm(num_groups=4)(x))
        h = nn.Conv(4 * self.growth, (1, 1))(h)
        h = nn.relu(nn.GroupNorm(num_groups=4)(h))
        h = nn.Conv(self.growth, (3, 3))(h)
        return jnp.concatenate([x, h], -1)


class DenseNet(nn.Module):
    layers: int = 6
    policy: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(32, (3, 3))(x)
        cls = DenseLayer if self.policy is None else nn.remat(DenseLayer, policy=self.policy)
        for i in range(self.layers):
            x = cls(16, name=f"dense_{i}")(x)
            if i == self.layers // 2 - 1:
                x = nn.avg_pool(nn.Conv(x.shape[-1] // 2, (1, 1))(x), (2, 2), (2, 2))
        return nn.Dense(10)(x.mean((1, 2)))


def _workload(policy=None):
    return image_classifier.workload(DenseNet, policy)


def _layer_of(program, lo: int, hi: int) -> set[str]:
    return {p for i in range(lo, hi) for p in program.eqns[i].module_path.split("/")
            if p.startswith("dense_")}


def test_every_dense_layer_is_a_block_of_its_own():
    """find_blocks takes the three-layer dense block; its units, the layers, are a group
    too, each layer starts a stage, and a per-block plan checkpoints each layer alone."""
    loss_fn, params, batch = _workload()
    program = trace(loss_fn, params, *batch)
    groups = find_blocks(program)
    main = max(groups, key=lambda g: len(g.starts) * g.length)
    assert [_layer_of(program, lo, hi) for lo, hi in main.ranges] == [
        {"dense_0", "dense_1", "dense_2"}, {"dense_3", "dense_4", "dense_5"}]
    units = unit_groups(program, groups, _flops(program))
    assert len(units) == 1 and units[0].length * 3 == main.length
    assert [_layer_of(program, lo, hi) for lo, hi in units[0].ranges] == [
        {f"dense_{i}"} for i in range(6)]
    cost = build_cost_graph(program)
    starts = {s.start for s in cost.stages}
    assert {lo for lo, _ in units[0].ranges} <= starts
    per_layer = [tuple((lo, hi) for lo, hi in g) for g in cost.blocks]
    layer_stages = [[_layer_of(program, cost.stages[a].start, cost.stages[c - 1].stop)
                     for a, c in g] for g in per_layer]
    assert [{f"dense_{i}"} for i in range(6)] in layer_stages


def _flops(program):
    from remat_planner.graph import build_graph
    graph = build_graph(program)
    return [graph.nodes[("eqn", i)]["flops"] for i in range(len(program.eqns))]


@pytest.mark.slow
def test_fits_where_nothing_saveable_per_layer_fits():
    """At the XLA peak of `nn.remat(DenseLayer, policy=nothing_saveable)`, one fresh
    rp.plan call fits and recomputes no more."""
    loss_fn, params, batch = _workload()
    opt = optax.adamw(1e-3)
    builtin_loss, _, _ = _workload(jax.checkpoint_policies.nothing_saveable)
    base = rp.measure(loss_fn, params, batch, opt)
    builtin = rp.measure(builtin_loss, params, batch, opt)
    assert builtin.peak_bytes < 0.6 * base.peak_bytes
    plan = rp.plan(loss_fn, params, batch, builtin.peak_bytes, opt)
    assert plan.measured_peak_bytes <= builtin.peak_bytes
    assert plan.measured_flops <= builtin.flops * (1 + 1e-3)


def test_analysis_has_a_plan_per_layer():
    """The per-block plans include nothing_saveable on each dense layer alone."""
    loss_fn, params, batch = _workload()
    an = rp.analyze(loss_fn, params, batch, optax.adamw(1e-3), calibrate=False)
    program = an.program
    layers = [[_layer_of(program, an.cost.stages[s.start].start, an.cost.stages[s.stop - 1].stop)
               for s in p if s.option == "nothing"] for p in per_block_plans(an)]
    assert [{f"dense_{i}"} for i in range(6)] in layers
