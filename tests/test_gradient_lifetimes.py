"""Gradient lifetimes: which optimizers update each parameter from its own gradient alone,
and which stage's backward each gradient belongs to."""

import jax
import jax.numpy as jnp
import optax
import pytest

from remat_planner.graph import build_cost_graph
from remat_planner.memory import per_parameter_update, stage_gradient_bytes
from remat_planner.trace import trace

PARAMS = {"w1": jax.ShapeDtypeStruct((64, 64), jnp.float32),
          "w2": jax.ShapeDtypeStruct((64, 64), jnp.float32)}


@pytest.mark.parametrize("opt,expected", [
    (optax.sgd(0.1), True), (optax.adamw(1e-3), True),
    (optax.chain(optax.add_decayed_weights(1e-4), optax.adam(1e-3)), True),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False),
])
def test_per_parameter_update(opt, expected):
    assert per_parameter_update(opt, PARAMS) is expected


def test_stage_gradient_bytes_follow_parameter_use():
    """A weight used by one stage is charged to it; the tied one, used by the first and
    the last stage, stays in fixed memory."""
    params = {"tied": jax.ShapeDtypeStruct((64, 64), jnp.float32),
              "w": [jax.ShapeDtypeStruct((64, 64), jnp.float32) for _ in range(4)]}

    def loss(p, x):
        x = jnp.tanh(x @ p["tied"])
        for w in p["w"]:
            x = jnp.tanh(x @ w)
        return jnp.mean(x @ p["tied"].T)

    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    program = trace(loss, params, x)
    cost = build_cost_graph(program)
    per_stage = stage_gradient_bytes(program, cost)
    assert len(cost.stages) >= 3
    assert sum(per_stage) == 4 * 64 * 64 * 4
    assert per_stage[0] == per_stage[-1] == 0  # the stages using the tied weight
