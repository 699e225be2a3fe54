"""Vision Transformer (ViT) image classifier (Flax linen): patch embedding, class token,
pre-LayerNorm encoder, classification head. Settings, model and Workload builder.

The config's `seq_len` is the image side in pixels (images are seq_len x seq_len x
channels), as for the other image models; it must be a multiple of the patch size.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.errors import ConfigError
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


class ViTSettings(BaseModel):
    """The `model:` section of a vit config; defaults are ViT-B/16."""

    # strict ints: a YAML `true` or `12.5` is a mistake, not a size.
    model_config = ConfigDict(extra="forbid", frozen=True)

    patch_size: int = Field(16, gt=0, strict=True, description="Side of the square patches, in pixels.")
    channels: int = Field(3, gt=0, strict=True, description="Input image channels.")
    n_classes: int = Field(1000, gt=0, strict=True, description="Classes of the classification head.")
    n_layer: int = Field(12, gt=0, strict=True, description="Number of encoder blocks.")
    d_model: int = Field(768, gt=0, strict=True, description="Hidden width.")
    n_head: int = Field(12, gt=0, strict=True, description="Attention heads per block; must divide d_model.")
    mlp_dim: int = Field(3072, gt=0, strict=True, description="Hidden width of the GELU MLP.")
    norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon.")
    dtype: Dtype = dtype_field()
    param_dtype: Dtype = param_dtype_field()
    scan_layers: bool = scan_layers_field()

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ViTSettings:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        return self


class Block(nn.Module):
    """Pre-LayerNorm encoder block."""

    settings: ViTSettings

    @nn.compact
    def __call__(self, x):
        s = self.settings
        batch, seq, _ = x.shape
        head_dim = s.d_model // s.n_head
        dense = functools.partial(nn.Dense, dtype=s.dtype, param_dtype=s.param_dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype)
        qkv = dense(3 * s.d_model, name="qkv")(norm(name="attn_norm")(x))
        q, k, v = (t.reshape(batch, seq, s.n_head, head_dim) for t in jnp.split(qkv, 3, axis=-1))
        x = x + dense(s.d_model, name="attn_out")(attention(q[:, :, :, None], k, v, causal=False))
        h = nn.gelu(dense(s.mlp_dim, name="mlp_in")(norm(name="mlp_norm")(x)))
        return x + dense(s.d_model, name="mlp_out")(h)


class ViT(nn.Module):
    settings: ViTSettings

    @nn.compact
    def __call__(self, images):
        """Class logits [batch, n_classes] of `images` [batch, side, side, channels]."""
        s = self.settings
        x = nn.Conv(s.d_model, (s.patch_size, s.patch_size), strides=s.patch_size, padding="VALID",
                    dtype=s.dtype, param_dtype=s.param_dtype, name="patch_embed")(images.astype(s.dtype))
        batch, rows, cols, _ = x.shape
        x = x.reshape(batch, rows * cols, s.d_model)
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, s.d_model), s.param_dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(s.dtype), (batch, 1, s.d_model)), x], axis=1)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, rows * cols + 1, s.d_model),
                         s.param_dtype)
        x = stack_blocks(Block, s.n_layer, x + pos.astype(s.dtype), scan=s.scan_layers, name="layers",
                         settings=s)
        x = nn.LayerNorm(epsilon=s.norm_eps, dtype=s.dtype, param_dtype=s.param_dtype, name="norm")(x[:, 0])
        return nn.Dense(s.n_classes, dtype=s.dtype, param_dtype=s.param_dtype, name="head")(x)


def classification_loss(model: ViT, params, images, labels):
    """Cross-entropy of integer `labels` [batch] under the model's logits for `images`."""
    return cross_entropy(model.apply({"params": params}, images), labels)


@register_model("vit", config_cls=ViTSettings)
def build_vit(settings: ViTSettings, batch_size: int, seq_len: int) -> Workload:
    """Build an image-classification Workload for a ViT.

    Args:
        settings: Validated model settings.
        batch_size: Images per step.
        seq_len: Image side in pixels (a multiple of patch_size).

    Returns:
        A Workload whose batch is `(images, labels)`: images float32
        [batch_size, seq_len, seq_len, channels], labels int32 [batch_size].

    Raises:
        ConfigError: If the sizes are not positive or the image side is not a multiple of
            the patch size.
    """
    check_sizes(batch_size, seq_len)
    if seq_len % settings.patch_size:
        raise ConfigError(
            f"field 'seq_len' (the image side, {seq_len} px) must be a multiple of "
            f"model.patch_size ({settings.patch_size})"
        )
    model = ViT(settings)
    image_shape = (batch_size, seq_len, seq_len, settings.channels)
    # The position embedding has one row per patch, so init sees one full-size image.
    init_params = jit_init(model, jnp.zeros((1,) + image_shape[1:], jnp.float32))

    def synthetic_batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_images, k_labels = jax.random.split(key)
        images = jax.random.normal(k_images, image_shape, jnp.float32)
        labels = jax.random.randint(k_labels, (batch_size,), 0, settings.n_classes, dtype=jnp.int32)
        return images, labels

    abstract_params, param_count = abstract_params_of(init_params)
    return Workload(
        name=f"vit-{settings.n_layer}l-{settings.d_model}d-p{settings.patch_size}",
        loss_fn=functools.partial(classification_loss, model),
        abstract_params=abstract_params,
        abstract_batch=(jax.ShapeDtypeStruct(image_shape, jnp.float32),
                        jax.ShapeDtypeStruct((batch_size,), jnp.int32)),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        param_count=param_count,
        info={
            "type": "vit",
            "dtype": settings.dtype,
            "param_dtype": settings.param_dtype,
            "scan_layers": settings.scan_layers,
            "batch_size": batch_size,
            "image_size": seq_len,
            "patches": (seq_len // settings.patch_size) ** 2,
            "n_layer": settings.n_layer,
            "d_model": settings.d_model,
            "n_head": settings.n_head,
            "mlp_dim": settings.mlp_dim,
            "n_classes": settings.n_classes,
            "param_count": param_count,
        },
    )
