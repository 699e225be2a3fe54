"""BERT-style bidirectional encoder with a masked-LM head (Flax linen). Settings, model and
Workload builder.

Masking is synthetic: each sequence has a fixed fraction of positions (drawn per example
by `synthetic_batch`) replaced by the mask token, and the loss is the cross-entropy of
the original tokens at those positions only. As in BERT pre-training code, the MLM head
runs on the masked positions alone, not on the whole sequence.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.models import Workload, register_model
from remat_planner.models.layers import (
    Dtype,
    abstract_params_of,
    attention,
    check_sizes,
    cross_entropy,
    dtype_field,
    jit_init,
    param_dtype_field,
    scan_layers_field,
    stack_blocks,
)


class BertSettings(BaseModel):
    """The `model:` section of a bert config; defaults are BERT-base (uncased)."""

    # strict ints: a YAML `true` or `12.5` is a mistake, not a size.
    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(30522, gt=0, strict=True, description="Number of token ids.")
    n_layer: int = Field(12, gt=0, strict=True, description="Number of encoder blocks.")
    d_model: int = Field(768, gt=0, strict=True, description="Hidden width.")
    n_head: int = Field(12, gt=0, strict=True, description="Attention heads per block; must divide d_model.")
    ffn_dim: int = Field(3072, gt=0, strict=True, description="Hidden width of the GELU MLP.")
    max_seq_len: int = Field(512, gt=0, strict=True, description="Rows of the position embedding; upper bound on seq_len.")
    mask_fraction: float = Field(0.15, gt=0, le=1, description="Fraction of positions masked and predicted per sequence.")
    mask_token_id: int = Field(103, ge=0, strict=True, description="Token id written at masked positions ([MASK]).")
    norm_eps: float = Field(1e-12, gt=0, description="LayerNorm epsilon.")
    dtype: Dtype = dtype_field()
    param_dtype: Dtype = param_dtype_field()
    scan_layers: bool = scan_layers_field()

    @model_validator(mode="after")
    def _shapes(self) -> BertSettings:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id ({self.mask_token_id}) must be below vocab_size ({self.vocab_size})")
        return self

    def n_masked(self, seq_len: int) -> int:
        """Masked positions per sequence of `seq_len` tokens (at least one)."""
        return max(1, round(self.mask_fraction * seq_len))


class Block(nn.Module):
    """Post-LayerNorm encoder block, as in BERT."""

    settings: BertSettings

    @nn.compact
    def __call__(self, x):
        s = self.settings
        batch, seq, _ = x.shape
        head_dim = s.d_model // s.n_head
        dense = functools.partial(nn.Dense, dtype=s.dtype, param_dtype=s.param_dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype)
        qkv = dense(3 * s.d_model, name="qkv")(x)
        q, k, v = (t.reshape(batch, seq, s.n_head, head_dim) for t in jnp.split(qkv, 3, axis=-1))
        attn = dense(s.d_model, name="attn_out")(attention(q[:, :, :, None], k, v, causal=False))
        x = norm(name="attn_norm")(x + attn)
        h = dense(s.d_model, name="mlp_out")(nn.gelu(dense(s.ffn_dim, name="mlp_in")(x)))
        return norm(name="mlp_norm")(x + h)


class Bert(nn.Module):
    settings: BertSettings

    @nn.compact
    def __call__(self, tokens, positions):
        """Logits [batch, n_masked, vocab] at `positions` [batch, n_masked] of `tokens`."""
        s = self.settings
        embed = functools.partial(nn.Embed, dtype=s.dtype, param_dtype=s.param_dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype)
        words = embed(s.vocab_size, s.d_model, name="word_embed")
        x = words(tokens) + embed(s.max_seq_len, s.d_model, name="pos_embed")(jnp.arange(tokens.shape[1])[None])
        # one segment per sequence: every token has type 0 (the row is still a parameter)
        x = x + embed(2, s.d_model, name="type_embed")(jnp.zeros((1, 1), jnp.int32))
        x = norm(name="embed_norm")(x)
        x = stack_blocks(Block, s.n_layer, x, scan=s.scan_layers, name="layers", settings=s)
        # masked-LM head, on the masked positions only
        h = jnp.take_along_axis(x, positions[..., None], axis=1)
        h = norm(name="head_norm")(nn.gelu(nn.Dense(s.d_model, dtype=s.dtype, param_dtype=s.param_dtype,
                                                    name="head_transform")(h)))
        bias = self.param("head_bias", nn.initializers.zeros, (s.vocab_size,), s.param_dtype)
        return words.attend(h) + bias.astype(s.dtype)  # decoder tied to the word embeddings


def mlm_loss(model: Bert, mask_token_id: int, params, tokens, positions):
    """Cross-entropy of the original `tokens` at `positions`, with those positions masked."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    labels = tokens[rows, positions]
    logits = model.apply({"params": params}, tokens.at[rows, positions].set(mask_token_id), positions)
    return cross_entropy(logits, labels)


@register_model("bert", config_cls=BertSettings)
def build_bert(settings: BertSettings, batch_size: int, seq_len: int) -> Workload:
    """Build a masked-LM Workload for a BERT-style encoder.

    Args:
        settings: Validated model settings.
        batch_size: Sequences per step.
        seq_len: Tokens per sequence.

    Returns:
        A Workload whose batch is `(tokens, positions)`: tokens int32 [batch_size, seq_len],
        positions int32 [batch_size, n_masked], distinct masked positions per sequence.

    Raises:
        ConfigError: If batch_size/seq_len are not positive or seq_len > max_seq_len.
    """
    check_sizes(batch_size, seq_len, settings.max_seq_len)
    model = Bert(settings)
    n_masked = settings.n_masked(seq_len)
    init_params = jit_init(model, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))

    def synthetic_batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_tokens, k_mask = jax.random.split(key)
        tokens = jax.random.randint(k_tokens, (batch_size, seq_len), 0, settings.vocab_size, dtype=jnp.int32)
        order = jax.vmap(lambda k: jax.random.permutation(k, seq_len))(jax.random.split(k_mask, batch_size))
        positions = jnp.sort(order[:, :n_masked], axis=1).astype(jnp.int32)
        return tokens, positions

    abstract_params, param_count = abstract_params_of(init_params)
    return Workload(
        name=f"bert-{settings.n_layer}l-{settings.d_model}d",
        loss_fn=functools.partial(mlm_loss, model, settings.mask_token_id),
        abstract_params=abstract_params,
        abstract_batch=(jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32),
                        jax.ShapeDtypeStruct((batch_size, n_masked), jnp.int32)),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        param_count=param_count,
        info={
            "type": "bert",
            "dtype": settings.dtype,
            "param_dtype": settings.param_dtype,
            "scan_layers": settings.scan_layers,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "masked_per_sequence": n_masked,
            "n_layer": settings.n_layer,
            "d_model": settings.d_model,
            "n_head": settings.n_head,
            "ffn_dim": settings.ffn_dim,
            "vocab_size": settings.vocab_size,
            "param_count": param_count,
        },
    )
