"""Settings schema and Workload builder for the GPT-2 model in gpt2.py."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.models import Workload, register_model
from remat_planner.models.gpt2 import GPT2, GPT2Config, lm_loss
from remat_planner.models.layers import (
    Dtype,
    token_lm_workload,
    check_sizes,
    dtype_field,
    jit_init,
    param_dtype_field,
    scan_layers_field,
)


class GPT2Settings(BaseModel):
    """The `model:` section of a gpt2 config; defaults are GPT-2 small (124M)."""

    # strict ints: a YAML `true` or `12.5` is a mistake, not a size.
    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(50257, gt=0, strict=True, description="Number of token ids.")
    n_layer: int = Field(12, gt=0, strict=True, description="Number of transformer blocks.")
    n_head: int = Field(12, gt=0, strict=True, description="Attention heads per block; must divide d_model.")
    d_model: int = Field(768, gt=0, strict=True, description="Residual stream width.")
    max_seq_len: int = Field(1024, gt=0, strict=True, description="Rows of the position embedding; upper bound on seq_len.")
    dtype: Dtype = dtype_field()
    param_dtype: Dtype = param_dtype_field()
    scan_layers: bool = scan_layers_field()

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPT2Settings:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


@register_model("gpt2", config_cls=GPT2Settings)
def build_gpt2(settings: GPT2Settings, batch_size: int, seq_len: int) -> Workload:
    """Build a next-token-prediction Workload for GPT-2.

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
    model = GPT2(GPT2Config(**settings.model_dump()))
    init_params = jit_init(model, jnp.zeros((1, 1), jnp.int32))

    return token_lm_workload("gpt2", settings, batch_size, seq_len,
                             functools.partial(lm_loss, model), init_params,
                             ("n_layer", "n_head", "d_model", "vocab_size"))
