"""The small float32 MLP the per-module tests (test_apply, test_memory, test_verify) plan:
`depth` layers x <- tanh(x @ w) on a (rows, width) batch, then mean(x ** 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def loss_with_aux(params, x):
    """`loss`, and the last activation as aux (rows x width float32)."""
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2), x


def abstract(depth: int, width: int, rows: int):
    """Abstract parameters (depth width x width matrices) and batch (one rows x width)."""
    return ([jax.ShapeDtypeStruct((width, width), jnp.float32)] * depth,
            (jax.ShapeDtypeStruct((rows, width), jnp.float32),))
