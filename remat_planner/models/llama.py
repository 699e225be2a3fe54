"""LLaMA-style causal language model (Flax linen): RMSNorm, rotary position embeddings,
SwiGLU MLP and grouped-query attention. Settings, model and Workload builder."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.models import Workload, register_model
from remat_planner.models.layers import (
    Dtype,
    token_lm_workload,
    attention,
    causal_lm_loss,
    check_sizes,
    dtype_field,
    jit_init,
    param_dtype_field,
    scan_layers_field,
    stack_blocks,
)


class LlamaSettings(BaseModel):
    """The `model:` section of a llama config; defaults are the Llama-3.2-1B shape."""

    # strict ints: a YAML `true` or `12.5` is a mistake, not a size.
    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(128256, gt=0, strict=True, description="Number of token ids.")
    n_layer: int = Field(16, gt=0, strict=True, description="Number of decoder blocks.")
    d_model: int = Field(2048, gt=0, strict=True, description="Residual stream width.")
    n_head: int = Field(32, gt=0, strict=True, description="Query heads per block; must divide d_model.")
    n_kv_head: int = Field(8, gt=0, strict=True, description="Key/value heads (grouped-query attention); must divide n_head.")
    ffn_dim: int = Field(8192, gt=0, strict=True, description="Hidden width of the SwiGLU MLP.")
    max_seq_len: int = Field(131072, gt=0, strict=True, description="Longest sequence the model accepts.")
    rope_theta: float = Field(500000.0, gt=0, description="Base of the rotary embedding frequencies.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(True, description="Output head shares the token embedding matrix.")
    dtype: Dtype = dtype_field()
    param_dtype: Dtype = param_dtype_field()
    scan_layers: bool = scan_layers_field()

    @model_validator(mode="after")
    def _head_shapes(self) -> LlamaSettings:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"head dim d_model / n_head ({self.d_model // self.n_head}) must be even for rotary embeddings")
        return self


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of `x` [batch, seq, ..., head_dim] (rotate-half layout)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]  # [seq, head_dim/2]
    shape = (1, seq) + (1,) * (x.ndim - 3) + (head_dim // 2,)
    cos, sin = (f(angles).reshape(shape).astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nn.Module):
    settings: LlamaSettings

    @nn.compact
    def __call__(self, x):
        s = self.settings
        batch, seq, _ = x.shape
        head_dim = s.d_model // s.n_head
        group = s.n_head // s.n_kv_head
        dense = functools.partial(nn.Dense, use_bias=False, dtype=s.dtype, param_dtype=s.param_dtype)
        q = dense(s.n_head * head_dim, name="q_proj")(x).reshape(batch, seq, s.n_kv_head, group, head_dim)
        k = dense(s.n_kv_head * head_dim, name="k_proj")(x).reshape(batch, seq, s.n_kv_head, head_dim)
        v = dense(s.n_kv_head * head_dim, name="v_proj")(x).reshape(batch, seq, s.n_kv_head, head_dim)
        out = attention(rotary(q, s.rope_theta), rotary(k, s.rope_theta), v, causal=True)
        return dense(s.d_model, name="o_proj")(out)


class MLP(nn.Module):
    settings: LlamaSettings

    @nn.compact
    def __call__(self, x):
        s = self.settings
        dense = functools.partial(nn.Dense, use_bias=False, dtype=s.dtype, param_dtype=s.param_dtype)
        gate = dense(s.ffn_dim, name="gate_proj")(x)
        up = dense(s.ffn_dim, name="up_proj")(x)
        return dense(s.d_model, name="down_proj")(nn.silu(gate) * up)


class Block(nn.Module):
    settings: LlamaSettings

    @nn.compact
    def __call__(self, x):
        s = self.settings
        norm = functools.partial(nn.RMSNorm, epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype)
        x = x + Attention(s, name="attn")(norm(name="attn_norm")(x))
        return x + MLP(s, name="mlp")(norm(name="mlp_norm")(x))


class Llama(nn.Module):
    settings: LlamaSettings

    @nn.compact
    def __call__(self, tokens):
        s = self.settings
        embed = nn.Embed(s.vocab_size, s.d_model, dtype=s.dtype, param_dtype=s.param_dtype, name="embed")
        x = stack_blocks(Block, s.n_layer, embed(tokens), scan=s.scan_layers, name="layers", settings=s)
        x = nn.RMSNorm(epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype, name="norm")(x)
        if s.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(s.vocab_size, use_bias=False, dtype=s.dtype, param_dtype=s.param_dtype,
                        name="lm_head")(x)


@register_model("llama", config_cls=LlamaSettings)
def build_llama(settings: LlamaSettings, batch_size: int, seq_len: int) -> Workload:
    """Build a next-token-prediction Workload for a LLaMA-style decoder.

    Args:
        settings: Validated model settings.
        batch_size: Sequences per step.
        seq_len: Tokens per sequence fed to the model (the batch holds seq_len + 1 for labels).

    Returns:
        A Workload whose batch is `(tokens,)`, tokens int32 [batch_size, seq_len + 1].

    Raises:
        ConfigError: If batch_size/seq_len are not positive or seq_len > max_seq_len.
    """
    check_sizes(batch_size, seq_len, settings.max_seq_len)
    model = Llama(settings)
    init_params = jit_init(model, jnp.zeros((1, 1), jnp.int32))

    return token_lm_workload("llama", settings, batch_size, seq_len,
                             functools.partial(causal_lm_loss, model), init_params,
                             ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim",
                              "vocab_size"))
