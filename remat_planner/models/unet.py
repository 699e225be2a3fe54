"""Diffusion U-Net (DDPM-style noise prediction, Flax linen), sized by config.

Sinusoidal timestep embedding + MLP; a down path of ResBlocks (GroupNorm, SiLU, 3x3
convs, timestep projection) with strided-conv downsampling, self-attention at the low
resolutions, a middle ResBlock-attention-ResBlock, and an up path whose ResBlocks take
the down path's features concatenated (skip connections), with nearest-neighbour
upsampling. The loss is the MSE between the predicted and the true noise of
x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise on a cosine schedule. Not a chain: every
down-path feature map stays live until the up path consumes it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from remat_planner.errors import ConfigError
from remat_planner.models import Workload, register_model


class UNetSettings(BaseModel):
    """The `model:` section of a unet config; defaults are a ~100M-parameter latent U-Net.

    The config's `seq_len` is the image side in pixels (inputs are seq_len x seq_len x
    in_channels).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_channels: int = Field(4, gt=0, strict=True, description="Image (or latent) channels.")
    base_channels: int = Field(128, gt=0, strict=True, description="Channels at full resolution.")
    channel_mult: tuple[int, ...] = Field(
        (1, 2, 4, 4), min_length=1, description="Channel multiplier per resolution level (halving the side each).")
    num_res_blocks: int = Field(2, gt=0, strict=True, description="ResBlocks per level on the down path (+1 on the up path).")
    attention_levels: tuple[int, ...] = Field(
        (2, 3), description="Levels (0 = full resolution) with self-attention after each ResBlock.")
    num_heads: int = Field(4, gt=0, strict=True, description="Attention heads; must divide every attended width.")
    num_groups: int = Field(32, gt=0, strict=True, description="GroupNorm groups; must divide every width.")
    timesteps: int = Field(1000, gt=1, strict=True, description="Diffusion steps of the noise schedule.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Activation/compute dtype.")
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter (and optimizer state) dtype.")

    @model_validator(mode="after")
    def _consistent(self) -> UNetSettings:
        widths = [self.base_channels * m for m in self.channel_mult]
        if any(m <= 0 for m in self.channel_mult):
            raise ValueError(f"channel_mult must be positive, got {list(self.channel_mult)}")
        bad = [w for w in widths if w % self.num_groups]
        if bad:
            raise ValueError(f"num_groups ({self.num_groups}) must divide every width, not {bad[0]}")
        levels = range(len(self.channel_mult))
        if any(level not in levels for level in self.attention_levels):
            raise ValueError(f"attention_levels must be in 0..{len(self.channel_mult) - 1}, "
                             f"got {list(self.attention_levels)}")
        if any(widths[level] % self.num_heads for level in self.attention_levels):
            raise ValueError(f"num_heads ({self.num_heads}) must divide the attended widths")
        return self


def timestep_embedding(t, dim: int, max_period: float = 10000.0):
    """Sinusoidal embedding of integer timesteps t [batch] -> [batch, dim]."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv, plus the timestep embedding, GroupNorm-SiLU-conv; 1x1
    projected shortcut when the width changes."""

    channels: int
    num_groups: int
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, temb):
        conv = functools.partial(nn.Conv, dtype=self.dtype, param_dtype=self.param_dtype)
        norm = functools.partial(nn.GroupNorm, num_groups=self.num_groups, dtype=self.dtype,
                                 param_dtype=self.param_dtype)
        h = conv(self.channels, (3, 3), name="conv_1")(nn.silu(norm(name="norm_1")(x)))
        h = h + nn.Dense(self.channels, dtype=self.dtype, param_dtype=self.param_dtype,
                         name="temb")(nn.silu(temb))[:, None, None, :]
        h = conv(self.channels, (3, 3), name="conv_2")(nn.silu(norm(name="norm_2")(h)))
        if x.shape[-1] != self.channels:
            x = conv(self.channels, (1, 1), name="skip")(x)
        return x + h


class AttnBlock(nn.Module):
    """Multi-head self-attention over the spatial positions, residual."""

    num_heads: int
    num_groups: int
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        b, hgt, wid, c = x.shape
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.GroupNorm(self.num_groups, dtype=self.dtype, param_dtype=self.param_dtype,
                         name="norm")(x).reshape(b, hgt * wid, c)
        q, k, v = jnp.split(dense(3 * c, name="qkv")(h), 3, axis=-1)
        heads = lambda t: t.reshape(b, hgt * wid, self.num_heads, c // self.num_heads)
        q, k, v = heads(q), heads(k), heads(v)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c // self.num_heads).astype(self.dtype)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, hgt * wid, c)
        return x + dense(c, name="proj")(out).reshape(b, hgt, wid, c)


class UNet(nn.Module):
    """Noise-prediction U-Net. Blocks are numbered in call order (`ResBlock_3`,
    `AttnBlock_1`, ...) so each is a repeated block for the built-in policy comparison."""

    settings: UNetSettings

    @nn.compact
    def __call__(self, x, t):
        s = self.settings
        dtype, param_dtype = jnp.dtype(s.dtype), jnp.dtype(s.param_dtype)
        dense = functools.partial(nn.Dense, dtype=dtype, param_dtype=param_dtype)
        conv = functools.partial(nn.Conv, dtype=dtype, param_dtype=param_dtype)
        counters = {"ResBlock": 0, "AttnBlock": 0}

        def res(h, channels):
            i = counters["ResBlock"]
            counters["ResBlock"] += 1
            return ResBlock(channels, s.num_groups, dtype, param_dtype, name=f"ResBlock_{i}")(h, temb)

        def attn(h):
            i = counters["AttnBlock"]
            counters["AttnBlock"] += 1
            return AttnBlock(s.num_heads, s.num_groups, dtype, param_dtype, name=f"AttnBlock_{i}")(h)

        temb_dim = 4 * s.base_channels
        temb = timestep_embedding(t, s.base_channels).astype(dtype)
        temb = dense(temb_dim, name="time_mlp_1")(temb)
        temb = dense(temb_dim, name="time_mlp_2")(nn.silu(temb))

        h = conv(s.base_channels, (3, 3), name="conv_in")(x.astype(dtype))
        skips = [h]
        levels = len(s.channel_mult)
        for level, mult in enumerate(s.channel_mult):
            for _ in range(s.num_res_blocks):
                h = res(h, s.base_channels * mult)
                if level in s.attention_levels:
                    h = attn(h)
                skips.append(h)
            if level < levels - 1:
                h = conv(h.shape[-1], (3, 3), (2, 2), name=f"down_{level}")(h)
                skips.append(h)
        h = attn(res(h, h.shape[-1]))
        h = res(h, h.shape[-1])
        for level in reversed(range(levels)):
            for _ in range(s.num_res_blocks + 1):
                h = res(jnp.concatenate([h, skips.pop()], axis=-1), s.base_channels * s.channel_mult[level])
                if level in s.attention_levels:
                    h = attn(h)
            if level > 0:
                b, hgt, wid, c = h.shape
                h = jax.image.resize(h, (b, 2 * hgt, 2 * wid, c), "nearest")
                h = conv(c, (3, 3), name=f"up_{level}")(h)
        h = nn.silu(nn.GroupNorm(s.num_groups, dtype=dtype, param_dtype=param_dtype, name="norm_out")(h))
        return conv(s.in_channels, (3, 3), name="conv_out")(h)


def cosine_alpha_bar(t, timesteps: int):
    """Cumulative signal fraction a_t of the cosine schedule (Nichol & Dhariwal, 2021)."""
    f = lambda u: jnp.cos((u / timesteps + 0.008) / 1.008 * jnp.pi / 2) ** 2
    return jnp.clip(f(t.astype(jnp.float32)) / f(jnp.float32(0)), 1e-5, 1.0)


def noise_prediction_loss(model: UNet, params, x0, noise, t):
    """MSE between the noise added to x0 at step t and the model's prediction of it."""
    a = cosine_alpha_bar(t, model.settings.timesteps)[:, None, None, None]
    xt = jnp.sqrt(a) * x0 + jnp.sqrt(1.0 - a) * noise
    pred = model.apply({"params": params}, xt, t)
    return jnp.mean((pred.astype(jnp.float32) - noise) ** 2)


@register_model("unet", config_cls=UNetSettings)
def build_unet(settings: UNetSettings, batch_size: int, seq_len: int) -> Workload:
    """Build a denoising Workload for the U-Net.

    Args:
        settings: Validated model settings.
        batch_size: Images per step.
        seq_len: Image side in pixels.

    Returns:
        A Workload whose batch is `(x0, noise, t)`: x0 and noise float32 [batch, side,
        side, in_channels], t int32 [batch] in [0, timesteps).

    Raises:
        ConfigError: If the sizes are not positive or the side does not halve down the levels.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise ConfigError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    halvings = len(settings.channel_mult) - 1
    if seq_len % 2 ** halvings:
        raise ConfigError(f"field 'seq_len' (the image side) must be divisible by {2 ** halvings} "
                          f"for {halvings + 1} resolution levels, got {seq_len}")
    model = UNet(settings)
    image = jax.ShapeDtypeStruct((batch_size, seq_len, seq_len, settings.in_channels), jnp.float32)
    steps = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    side = 2 ** halvings

    @jax.jit
    def init_params(key: jax.Array) -> Any:
        # Params do not depend on batch or image size: a 1-image batch at the smallest side.
        return model.init(key, jnp.zeros((1, side, side, settings.in_channels), jnp.float32),
                          jnp.zeros((1,), jnp.int32))["params"]

    def synthetic_batch(key: jax.Array) -> tuple:
        k0, k1, k2 = jax.random.split(key, 3)
        return (jax.random.normal(k0, image.shape, jnp.float32),
                jax.random.normal(k1, image.shape, jnp.float32),
                jax.random.randint(k2, steps.shape, 0, settings.timesteps, dtype=jnp.int32))

    abstract_params = jax.eval_shape(init_params, jax.eval_shape(jax.random.key, 0))
    param_count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params))
    return Workload(
        name=f"unet-{settings.base_channels}c-{len(settings.channel_mult)}l",
        loss_fn=functools.partial(noise_prediction_loss, model),
        abstract_params=abstract_params,
        abstract_batch=(image, image, steps),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        param_count=param_count,
        info={
            "type": "unet",
            "dtype": settings.dtype,
            "param_dtype": settings.param_dtype,
            "batch_size": batch_size,
            "image_size": seq_len,
            "in_channels": settings.in_channels,
            "base_channels": settings.base_channels,
            "channel_mult": list(settings.channel_mult),
            "num_res_blocks": settings.num_res_blocks,
            "attention_levels": list(settings.attention_levels),
            "param_count": param_count,
        },
    )
