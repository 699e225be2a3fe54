"""GPT-style causal language model written with `flax.nnx`, sized by config.

The same job as gpt2.py in NNX's object style, to show NNX models plan too: the
parameters are the `nnx.State` of the model (a pytree, split off with `nnx.split`), and
the loss rebuilds the model with `nnx.merge(graphdef, state)` on every call, so it is a
plain function of that pytree. NNX does not name scopes the way linen does; the model
opens `jax.named_scope`s (`NNXGPT/Block_3/attn`, ...) so equations carry module paths
as they do for linen.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.models.layers import check_sizes, token_lm_workload
from remat_planner.models import Workload, register_model


class NNXGPTSettings(BaseModel):
    """The `model:` section of an nnx-gpt config; defaults are a small 6-layer GPT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(8192, gt=0, strict=True, description="Number of token ids.")
    n_layer: int = Field(6, gt=0, strict=True, description="Number of transformer blocks.")
    n_head: int = Field(8, gt=0, strict=True, description="Attention heads per block; must divide d_model.")
    d_model: int = Field(512, gt=0, strict=True, description="Residual stream width.")
    max_seq_len: int = Field(1024, gt=0, strict=True, description="Rows of the position embedding; upper bound on seq_len.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Activation/compute dtype.")
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter (and optimizer state) dtype.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> NNXGPTSettings:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, d_model: int, n_head: int, dtype, param_dtype, rngs: nnx.Rngs):
        self.n_head = n_head
        self.dtype = dtype
        self.qkv = nnx.Linear(d_model, 3 * d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(d_model, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_head
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        split = lambda t: t.reshape(batch, seq, self.n_head, head_dim)
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(self.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(self.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
        return self.proj(out)


class MLP(nnx.Module):
    def __init__(self, d_model: int, dtype, param_dtype, rngs: nnx.Rngs):
        self.fc = nnx.Linear(d_model, 4 * d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(4 * d_model, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dtype, param_dtype, rngs: nnx.Rngs):
        norm = functools.partial(nnx.LayerNorm, d_model, epsilon=1e-5, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        self.ln_1, self.ln_2 = norm(), norm()
        self.attn = Attention(d_model, n_head, dtype, param_dtype, rngs)
        self.mlp = MLP(d_model, dtype, param_dtype, rngs)

    def __call__(self, x):
        with jax.named_scope("ln_1"):
            h = self.ln_1(x)
        with jax.named_scope("attn"):
            x = x + self.attn(h)
        with jax.named_scope("ln_2"):
            h = self.ln_2(x)
        with jax.named_scope("mlp"):
            return x + self.mlp(h)


class NNXGPT(nnx.Module):
    """Token + position embeddings, `n_layer` blocks, final LayerNorm, tied output head."""

    def __init__(self, settings: NNXGPTSettings, rngs: nnx.Rngs):
        s = settings
        dtype, param_dtype = jnp.dtype(s.dtype), jnp.dtype(s.param_dtype)
        self.wte = nnx.Embed(s.vocab_size, s.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wpe = nnx.Embed(s.max_seq_len, s.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List([Block(s.d_model, s.n_head, dtype, param_dtype, rngs)
                                for _ in range(s.n_layer)])
        self.ln_f = nnx.LayerNorm(s.d_model, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens):
        with jax.named_scope("NNXGPT"):
            with jax.named_scope("embed"):
                x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1])[None, :])
            for i, block in enumerate(self.blocks):
                with jax.named_scope(f"Block_{i}"):
                    x = block(x)
            with jax.named_scope("head"):
                return self.wte.attend(self.ln_f(x))


def lm_loss(graphdef, state, tokens):
    """Next-token cross-entropy of the NNX model `nnx.merge(graphdef, state)` on tokens."""
    model = nnx.merge(graphdef, state)
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


@register_model("nnx-gpt", config_cls=NNXGPTSettings)
def build_nnx_gpt(settings: NNXGPTSettings, batch_size: int, seq_len: int) -> Workload:
    """Build a next-token-prediction Workload for the NNX GPT.

    Args:
        settings: Validated model settings.
        batch_size: Sequences per step.
        seq_len: Tokens per sequence fed to the model (the batch holds seq_len + 1).

    Returns:
        A Workload whose params are the model's `nnx.State` and whose batch is
        `(tokens,)`, tokens int32 [batch_size, seq_len + 1].

    Raises:
        ConfigError: If batch_size/seq_len are not positive or seq_len > max_seq_len.
    """
    check_sizes(batch_size, seq_len, settings.max_seq_len)
    # Shape-only model: its graphdef is static, its state the abstract params.
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: NNXGPT(settings, nnx.Rngs(0))))

    @jax.jit
    def init_params(key: jax.Array) -> Any:
        return nnx.split(NNXGPT(settings, nnx.Rngs(params=key)))[1]

    return token_lm_workload("nnx-gpt", settings, batch_size, seq_len,
                             functools.partial(lm_loss, graphdef), init_params,
                             ("n_layer", "n_head", "d_model", "vocab_size"),
                             abstract_params=abstract_params)
