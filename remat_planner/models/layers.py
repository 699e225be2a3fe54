"""Pieces shared by the sample transformers: settings common to all of them, a stack of
blocks (unrolled or `nn.scan`), attention, losses and the Workload bookkeeping."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from pydantic import Field

from remat_planner.errors import ConfigError

Dtype = Literal["float32", "bfloat16"]


def dtype_field() -> Any:
    """The `dtype` setting of every sample model: activations and compute."""
    return Field("float32", description="Activation/compute dtype.")


def param_dtype_field() -> Any:
    """The `param_dtype` setting of every sample model."""
    return Field("float32", description="Parameter dtype; gradients and optimizer state follow it.")


def scan_layers_field() -> Any:
    """The `scan_layers` setting of every sample transformer."""
    return Field(False, description="Stack the blocks with flax.linen.scan (one block traced "
                                    "once, params stacked on a leading axis) instead of unrolling them.")


# ---------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------

@functools.cache
def _scan_body(block_cls: type[nn.Module]) -> type[nn.Module]:
    """`block_cls` with the `(carry, x) -> (carry, y)` signature nn.scan wants; the
    residual stream is the carry."""

    class ScanBody(block_cls):  # type: ignore[misc, valid-type]
        def __call__(self, x, _):
            return block_cls.__call__(self, x), None

    ScanBody.__name__ = ScanBody.__qualname__ = block_cls.__name__
    return ScanBody


def stack_blocks(block_cls: type[nn.Module], n_layer: int, x: jax.Array, *, scan: bool,
                 name: str, **kwargs: Any) -> jax.Array:
    """Apply `n_layer` blocks `block_cls(**kwargs)` to `x`, inside a compact method.

    Unrolled, the blocks are named `{name}_0` .. `{name}_{n-1}` (module paths end in
    `_<n>`, which `apply.block_ranges` reads as repeated blocks); scanned, one module
    `{name}` holds params stacked on a leading axis of length n_layer.
    """
    if not scan:
        for i in range(n_layer):
            x = block_cls(**kwargs, name=f"{name}_{i}")(x)
        return x
    scanned = nn.scan(_scan_body(block_cls), variable_axes={"params": 0},
                      split_rngs={"params": True}, length=n_layer)
    x, _ = scanned(**kwargs, name=name)(x, None)
    return x


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
    """Softmax attention with grouped queries.

    Args:
        q: [batch, q_len, kv_heads, group, head_dim] (group = query heads per kv head).
        k, v: [batch, kv_len, kv_heads, head_dim].
        causal: mask keys after each query position.

    Returns:
        [batch, q_len, kv_heads * group * head_dim]; the softmax runs in float32.
    """
    batch, q_len, kv_heads, group, head_dim = q.shape
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    if causal:
        mask = jnp.tril(jnp.ones((q_len, k.shape[1]), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v)
    return out.reshape(batch, q_len, kv_heads * group * head_dim)


# ---------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------

def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer `labels` under `logits` [..., classes], in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def causal_lm_loss(model: nn.Module, params, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy of a causal LM `model(tokens) -> logits` on tokens [batch, seq + 1]."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:])


# ---------------------------------------------------------------------------------------
# Workload bookkeeping
# ---------------------------------------------------------------------------------------

def check_sizes(batch_size: int, seq_len: int, max_seq_len: int | None = None) -> None:
    """Raise ConfigError if the batch shape is not positive or longer than the model allows."""
    if batch_size <= 0 or seq_len <= 0:
        raise ConfigError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ConfigError(
            f"field 'seq_len': {seq_len} exceeds model.max_seq_len {max_seq_len}; "
            "lower seq_len or raise model.max_seq_len"
        )


def jit_init(model: nn.Module, *dummy_inputs: jax.Array) -> Callable[[jax.Array], Any]:
    """A jitted `key -> params` for `model`, initialised on small dummy inputs (params do
    not depend on batch size or length)."""

    @jax.jit
    def init_params(key: jax.Array) -> Any:
        return model.init(key, *dummy_inputs)["params"]

    return init_params


def abstract_params_of(init_params: Callable[[jax.Array], Any]) -> tuple[Any, int]:
    """Shape-only params (nothing allocated) and their number of scalars."""
    abstract = jax.eval_shape(init_params, jax.eval_shape(jax.random.key, 0))
    return abstract, sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract))


def token_lm_workload(kind: str, settings: Any, batch_size: int, seq_len: int,
                      loss_fn: Callable, init_params: Callable[[jax.Array], Any],
                      info_keys: tuple[str, ...], abstract_params: Any = None) -> Any:
    """The Workload of a language model trained on token batches `(tokens,)`, tokens
    int32 [batch_size, seq_len + 1] drawn uniformly from the vocabulary.

    kind: the registered type (and name prefix); info_keys: the settings shown in the
    report after dtype, param_dtype, batch_size and seq_len. abstract_params defaults to
    the shapes `init_params` produces.
    """
    from remat_planner.models import Workload

    def synthetic_batch(key: jax.Array) -> tuple[jax.Array]:
        return (jax.random.randint(key, (batch_size, seq_len + 1), 0, settings.vocab_size,
                                   dtype=jnp.int32),)

    if abstract_params is None:
        abstract_params, param_count = abstract_params_of(init_params)
    else:
        param_count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    info = {"type": kind, "dtype": settings.dtype, "param_dtype": settings.param_dtype}
    if hasattr(settings, "scan_layers"):
        info["scan_layers"] = settings.scan_layers
    info.update(batch_size=batch_size, seq_len=seq_len)
    info.update({k: getattr(settings, k) for k in info_keys})
    info["param_count"] = param_count
    return Workload(
        name=f"{kind}-{settings.n_layer}l-{settings.d_model}d",
        loss_fn=loss_fn,
        abstract_params=abstract_params,
        abstract_batch=(jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32),),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        param_count=param_count,
        info=info,
    )
