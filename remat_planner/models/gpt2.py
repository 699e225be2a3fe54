"""GPT-2 style causal language model (Flax linen), sized by config."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    max_seq_len: int = 1024
    dtype: str = "float32"


class CausalSelfAttention(nn.Module):
    n_head: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_head
        qkv = nn.Dense(3 * d_model, dtype=self.dtype, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(batch, seq, self.n_head, head_dim)
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(self.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(self.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
        return nn.Dense(d_model, dtype=self.dtype, name="c_proj")(out)


class MLP(nn.Module):
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        d_model = x.shape[-1]
        h = nn.Dense(4 * d_model, dtype=self.dtype, name="c_fc")(x)
        h = nn.gelu(h)
        return nn.Dense(d_model, dtype=self.dtype, name="c_proj")(h)


class Block(nn.Module):
    n_head: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = x + CausalSelfAttention(self.n_head, self.dtype, name="attn")(
            nn.LayerNorm(dtype=self.dtype, name="ln_1")(x))
        x = x + MLP(self.dtype, name="mlp")(nn.LayerNorm(dtype=self.dtype, name="ln_2")(x))
        return x


class GPT2(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, name="wte")
        wpe = nn.Embed(cfg.max_seq_len, cfg.d_model, dtype=dtype, name="wpe")
        positions = jnp.arange(tokens.shape[1])[None, :]
        x = wte(tokens) + wpe(positions)
        for i in range(cfg.n_layer):
            x = Block(cfg.n_head, dtype, name=f"h_{i}")(x)
        x = nn.LayerNorm(dtype=dtype, name="ln_f")(x)
        return wte.attend(x)  # tied embeddings, as in GPT-2


def lm_loss(model: GPT2, params, tokens):
    """Next-token cross-entropy of a causal LM on `tokens` [batch, seq]."""
    logits = model.apply({"params": params}, tokens[:, :-1])
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)
    return -jnp.mean(picked)
