"""Bottleneck ResNet with BatchNorm in train mode (Flax linen), sized by config.

BatchNorm runs with batch statistics (`use_running_average=False`) and updates its
running averages, a mutable `batch_stats` collection. The step treats them as state: the
current stats are the last batch argument of `loss_fn`, which returns `(loss,
new_stats)` (`Workload.has_aux`), and `Workload.update_batch` puts the new stats into the
next step's batch. Gradients are taken with respect to `params` only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from pydantic import BaseModel, ConfigDict, Field

from remat_planner.errors import ConfigError
from remat_planner.models import Workload, register_model


class ResNetSettings(BaseModel):
    """The `model:` section of a resnet config; defaults are ResNet-50 at 224 px.

    The config's `seq_len` is the image side in pixels (images are seq_len x seq_len x 3).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage_sizes: tuple[int, ...] = Field(
        (3, 4, 6, 3), min_length=1, description="Bottleneck blocks per stage; ResNet-50 is [3, 4, 6, 3].")
    width: int = Field(64, gt=0, strict=True, description="Channels of the stem and of the first stage's bottleneck.")
    num_classes: int = Field(1000, gt=1, strict=True, description="Classes of the classification head.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Activation/compute dtype.")
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter (and optimizer state) dtype.")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, each with BatchNorm; projected shortcut
    where the shape changes."""

    filters: int
    strides: int
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype, param_dtype=self.param_dtype)
        y = nn.relu(norm(name="bn_1")(conv(self.filters, (1, 1), name="conv_1")(x)))
        y = conv(self.filters, (3, 3), (self.strides, self.strides), name="conv_2")(y)
        y = nn.relu(norm(name="bn_2")(y))
        y = norm(name="bn_3")(conv(4 * self.filters, (1, 1), name="conv_3")(y))
        shortcut = x
        if shortcut.shape != y.shape:
            shortcut = conv(4 * self.filters, (1, 1), (self.strides, self.strides), name="proj")(x)
            shortcut = norm(name="proj_bn")(shortcut)
        return nn.relu(shortcut + y)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, BatchNorm, 3x3/2 max pool), bottleneck stages, mean pool, dense head.

    Blocks are numbered across stages (`Bottleneck_0`, `Bottleneck_1`, ...), so each is a
    repeated block for the built-in per-block policy comparison.
    """

    stage_sizes: tuple[int, ...]
    width: int
    num_classes: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images):
        x = images.astype(self.dtype)
        x = nn.Conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                    dtype=self.dtype, param_dtype=self.param_dtype, name="stem_conv")(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                         param_dtype=self.param_dtype, name="stem_bn")(x)
        x = max_pool_3x3_s2(nn.relu(x))
        index = 0
        for stage, blocks in enumerate(self.stage_sizes):
            for b in range(blocks):
                strides = 2 if stage > 0 and b == 0 else 1
                x = Bottleneck(self.width * 2 ** stage, strides, self.dtype, self.param_dtype,
                               name=f"Bottleneck_{index}")(x)
                index += 1
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head")(x)


def max_pool_3x3_s2(x):
    """3x3 max pooling with stride 2 and SAME padding, as the maximum of nine strided
    slices: the same values as `nn.max_pool`, differentiated by elementwise selects.
    Measured on resnet-tiny at 64 px (XLA CPU): checkpointing the stem's relu +
    `nn.max_pool` (reduce_window) raised the step's peak by 4x the pooled input instead
    of lowering it; with this form the same checkpoint lowers the peak by 2x the input."""
    b, h, w, c = x.shape
    out_h, out_w = -(-h // 2), -(-w // 2)
    pad_h, pad_w = max(0, 2 * (out_h - 1) + 3 - h), max(0, 2 * (out_w - 1) + 3 - w)
    x = jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)),
                constant_values=-jnp.inf)
    out = None
    for i in range(3):
        for j in range(3):
            window = x[:, i:i + 2 * out_h - 1:2, j:j + 2 * out_w - 1:2, :]
            out = window if out is None else jnp.maximum(out, window)
    return out


def classification_loss(model: ResNet, params, images, labels, batch_stats):
    """Cross-entropy of `model` on (images, labels) with BatchNorm in train mode.

    Returns:
      (loss, new_batch_stats): the running averages after this batch.
    """
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                  mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.mean(loss), updates["batch_stats"]


def replace_last(batch: tuple, aux) -> tuple:
    """The next step's batch: the state argument (last) replaced by the step's aux output."""
    return (*batch[:-1], aux)


@register_model("resnet", config_cls=ResNetSettings)
def build_resnet(settings: ResNetSettings, batch_size: int, seq_len: int) -> Workload:
    """Build an image-classification Workload for a bottleneck ResNet.

    Args:
        settings: Validated model settings.
        batch_size: Images per step.
        seq_len: Image side in pixels.

    Returns:
        A Workload whose batch is `(images, labels, batch_stats)`: images float32
        [batch, side, side, 3], labels int32 [batch], the BatchNorm running averages; its
        loss returns `(loss, new_batch_stats)`.

    Raises:
        ConfigError: If the sizes are not positive or the image is smaller than 32 px.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ConfigError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if any(s <= 0 for s in settings.stage_sizes):
        raise ConfigError(f"field 'model.stage_sizes': every stage needs a block, got {list(settings.stage_sizes)}")
    if seq_len < 32:
        raise ConfigError(f"field 'seq_len' (the image side) must be at least 32 px for a ResNet, got {seq_len}")
    dtype, param_dtype = jnp.dtype(settings.dtype), jnp.dtype(settings.param_dtype)
    model = ResNet(tuple(settings.stage_sizes), settings.width, settings.num_classes, dtype, param_dtype)
    image = jax.ShapeDtypeStruct((batch_size, seq_len, seq_len, 3), jnp.float32)

    def init_variables(key: jax.Array) -> Any:
        return model.init(key, jnp.zeros((1, 32, 32, 3), jnp.float32))

    @jax.jit
    def init_params(key: jax.Array) -> Any:
        return init_variables(key)["params"]

    abstract_vars = jax.eval_shape(init_variables, jax.eval_shape(jax.random.key, 0))
    abstract_stats = abstract_vars["batch_stats"]

    def synthetic_batch(key: jax.Array) -> tuple:
        k_img, k_lab = jax.random.split(key)
        images = jax.random.normal(k_img, image.shape, jnp.float32)
        labels = jax.random.randint(k_lab, (batch_size,), 0, settings.num_classes, dtype=jnp.int32)
        return images, labels, _initial_stats(abstract_stats)

    abstract_params = abstract_vars["params"]
    param_count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    depth = 3 * sum(settings.stage_sizes) + 2
    return Workload(
        name=f"resnet{depth}-{settings.width}w",
        loss_fn=functools.partial(classification_loss, model),
        abstract_params=abstract_params,
        abstract_batch=(image, jax.ShapeDtypeStruct((batch_size,), jnp.int32), abstract_stats),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        param_count=param_count,
        info={
            "type": "resnet",
            "dtype": settings.dtype,
            "param_dtype": settings.param_dtype,
            "batch_size": batch_size,
            "image_size": seq_len,
            "stage_sizes": list(settings.stage_sizes),
            "width": settings.width,
            "num_classes": settings.num_classes,
            "param_count": param_count,
        },
        has_aux=True,
        update_batch=replace_last,
    )


def _initial_stats(abstract_stats) -> Any:
    """BatchNorm's initial running averages: mean 0, variance 1."""
    def leaf(path, s):
        name = getattr(path[-1], "key", "")
        return (jnp.ones if name == "var" else jnp.zeros)(s.shape, s.dtype)
    return jax.tree_util.tree_map_with_path(leaf, abstract_stats)
