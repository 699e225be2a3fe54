"""GPT-2 style causal language model (Flax linen), sized by config."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_planner.models.layers import causal_lm_loss, stack_blocks


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    max_seq_len: int = 1024
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False


class CausalSelfAttention(nn.Module):
    n_head: int
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_head
        qkv = nn.Dense(3 * d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(batch, seq, self.n_head, head_dim)
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(self.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(self.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
        return nn.Dense(d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="c_proj")(out)


class MLP(nn.Module):
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        h = nn.Dense(4 * d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="c_fc")(x)
        h = nn.gelu(h)
        return nn.Dense(d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="c_proj")(h)


class Block(nn.Module):
    n_head: int
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        norm = lambda name: nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        x = x + CausalSelfAttention(self.n_head, self.dtype, self.param_dtype, name="attn")(norm("ln_1")(x))
        x = x + MLP(self.dtype, self.param_dtype, name="mlp")(norm("ln_2")(x))
        return x


class GPT2(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype, name="wte")
        wpe = nn.Embed(cfg.max_seq_len, cfg.d_model, dtype=dtype, param_dtype=param_dtype, name="wpe")
        positions = jnp.arange(tokens.shape[1])[None, :]
        x = wte(tokens) + wpe(positions)
        x = stack_blocks(Block, cfg.n_layer, x, scan=cfg.scan_layers, name="h",
                         n_head=cfg.n_head, dtype=dtype, param_dtype=param_dtype)
        x = nn.LayerNorm(dtype=dtype, param_dtype=param_dtype, name="ln_f")(x)
        return wte.attend(x)  # tied embeddings, as in GPT-2


def lm_loss(model: GPT2, params, tokens):
    """Next-token cross-entropy of a causal LM on `tokens` [batch, seq + 1]."""
    return causal_lm_loss(model, params, tokens)
