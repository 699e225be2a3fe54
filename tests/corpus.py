"""A corpus of small models written the way users write them, for the planner's generality tests.

The project's own zoo (remat_planner/models/) was written alongside the planner and shares its
conventions. The models here deliberately do not: they copy the styles found in the wild
(HuggingFace-Flax module trees with blocks named "0", "1", ...; `nn.compact` with auto names;
`nn.scan` stacks; flax.nnx; plain JAX with a dict of arrays; BatchNorm state; U-Net skips;
MLP-Mixer; the Flax examples' ResNet with its `nn.max_pool` stem; a ViT with a class token
and gradient clipping; a hand-written Llama with rotary tables, bfloat16 compute and Lion;
ALBERT's one layer shared by every depth; an encoder-decoder whose encoder output every
decoder block reads; plain JAX with `jax.lax.scan` over stacked parameters),
so that a planner that only works on the zoo's shapes shows up here. Nothing is imported
from remat_planner.

Every model is tiny (a whole step compiles in a few seconds on CPU), with float32
parameters.

`MODELS` maps a name to a builder; `get(name)` builds once and caches. Each builder returns a
`CorpusModel` whose `make_remat_loss(policies)` wraps block i by hand, as a user would
(`nn.remat(Block, policy=...)` in linen, `nnx.remat` in nnx, `jax.checkpoint(block, policy=...)`
in plain JAX), keeping the params pytree identical to `loss_fn`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Policy = Callable[..., bool] | None


@dataclasses.dataclass(frozen=True)
class CorpusModel:
    """One corpus model.

    Attributes:
        name: Key in MODELS.
        loss_fn: `loss_fn(params, *batch)` -> scalar loss, or `(loss, aux)` when has_aux.
        params: Pytree of jax.ShapeDtypeStruct (nothing allocated).
        batch: Tuple of jax.ShapeDtypeStruct pytrees, one per positional batch argument.
        optimizer: optax GradientTransformation for the training step.
        has_aux: loss_fn returns `(loss, aux)`.
        n_blocks: Number of repeated blocks make_remat_loss can wrap (0 if none).
        make_remat_loss: `make_remat_loss(policies)` -> loss_fn over the same params and batch,
            block i wrapped in remat with `policies[i]` (None: not wrapped). All-None gives
            loss_fn itself.
        init: `init(key)` -> `(params, batch)`, concrete arrays with the abstract shapes, for
            gradient checks (values from NumPy, see `_fill`; not traceable).
        supports_mixes: False when only uniform policy tuples are accepted (nn.scan stacks).
        gradient_rtol: How close a remat variant's gradients must be to loss_fn's: float32
            compute recomputes the same values; bfloat16 compute may round a recomputed
            value differently where XLA fuses it otherwise (the gradient checks' tolerance,
            nothing the planner reads).
    """

    name: str
    loss_fn: Callable
    params: Any
    batch: tuple
    optimizer: Any
    has_aux: bool
    n_blocks: int
    make_remat_loss: Callable[[tuple[Policy, ...]], Callable]
    init: Callable[[jax.Array], tuple[Any, tuple]]
    supports_mixes: bool = True
    gradient_rtol: float = 1e-5


def _check_policies(policies, n_blocks: int) -> tuple[Policy, ...]:
    policies = tuple(policies)
    if len(policies) != n_blocks:
        raise ValueError(f"expected {n_blocks} policies, got {len(policies)}")
    return policies


def _remat_maker(loss_fn: Callable, n_blocks: int, build: Callable[[tuple], Callable]):
    """make_remat_loss that returns loss_fn itself for all-None and `build(policies)` otherwise."""

    def make_remat_loss(policies):
        policies = _check_policies(policies, n_blocks)
        if all(p is None for p in policies):
            return loss_fn
        return build(policies)

    return make_remat_loss


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _np_rng(key) -> np.random.Generator:
    """A NumPy generator seeded from a JAX PRNG key (raw uint32 or typed)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.random.default_rng(np.asarray(key, np.uint32).ravel().tolist())


def _fill(abstract, rng: np.random.Generator):
    """Concrete float32 values for an abstract params (or batch-stats) pytree.

    The models' own initializers are traced only (jax.eval_shape): compiling their random
    number generation takes XLA on CPU far longer than compiling a training step, so the values
    come from NumPy instead, by leaf name: scales ~1, batch-stat variances 1, means 0, biases
    small, other matrices (embeddings, kernels, stacked kernels) normal / sqrt(prod(shape[:-1])).
    """

    def leaf(path, a):
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))).lower()
        shape = tuple(a.shape)
        if name == "var":
            value = np.ones(shape)
        elif name == "mean":
            value = np.zeros(shape)
        elif "scale" in name:  # also the (layers, d) scales of an nn.scan stack
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "bias" in name or len(shape) < 2:
            value = 0.02 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))
        return jnp.asarray(value, a.dtype)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def _model(name, loss_fn, params, make_batch, optimizer, n_blocks, build, *, has_aux=False,
           supports_mixes=True, gradient_rtol=1e-5):
    """A CorpusModel from abstract params and `make_batch(rng) -> tuple of arrays`."""

    def init(key):
        rng = _np_rng(key)
        concrete = _fill(params, rng)
        return concrete, tuple(jax.tree.map(jnp.asarray, make_batch(rng)))

    batch = tuple(_abstract(make_batch(np.random.default_rng(0))))
    return CorpusModel(
        name=name, loss_fn=loss_fn, params=params, batch=batch, optimizer=optimizer,
        has_aux=has_aux, n_blocks=n_blocks,
        make_remat_loss=_remat_maker(loss_fn, n_blocks, build), init=init,
        supports_mixes=supports_mixes, gradient_rtol=gradient_rtol)


def _init_shapes(init_fn, *batch):
    """Abstract params of a user init function, traced with jax.eval_shape (nothing allocated)."""
    return jax.eval_shape(init_fn, jax.random.PRNGKey(0), *_abstract(batch))


def _tokens(rng, batch_size, seq_len, vocab):
    return rng.integers(0, vocab, (batch_size, seq_len), dtype=np.int32)


def _raw_key(rng):
    """A raw uint32[2] PRNG key, as jax.random.PRNGKey makes."""
    return rng.integers(0, 2**32, (2,), dtype=np.uint32)


# ---------------------------------------------------------------------------------------------
# 1. hf_gpt2: HuggingFace-Flax style GPT-2 (setup-style modules, blocks named "0", "1", ...,
#    attention mask and position ids threaded through every block, dropout on, tied embeddings).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 512
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02


class FlaxGPT2Attention(nn.Module):
    config: GPT2Config

    def setup(self):
        c = self.config
        self.embed_dim = c.n_embd
        self.num_heads = c.n_head
        self.head_dim = self.embed_dim // self.num_heads
        init = jax.nn.initializers.normal(c.initializer_range)
        self.c_attn = nn.Dense(3 * self.embed_dim, kernel_init=init)
        self.c_proj = nn.Dense(self.embed_dim, kernel_init=init)
        self.attn_dropout = nn.Dropout(rate=c.attn_pdrop)
        self.resid_dropout = nn.Dropout(rate=c.resid_pdrop)

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def __call__(self, hidden_states, attention_mask, position_ids, deterministic: bool = True):
        qkv_out = self.c_attn(hidden_states)
        query, key, value = jnp.split(qkv_out, 3, axis=2)
        query, key, value = (self._split_heads(t) for t in (query, key, value))

        # causal mask from the position ids, padding mask from attention_mask, built by hand
        causal_mask = position_ids[:, :, None] >= position_ids[:, None, :]          # (b, q, k)
        mask = jnp.logical_and(causal_mask, attention_mask[:, None, :] > 0)
        attention_bias = jnp.where(mask, 0.0, jnp.finfo(hidden_states.dtype).min)[:, None]

        attn_weights = jnp.einsum("bqhd,bkhd->bhqk", query, key) / math.sqrt(self.head_dim)
        attn_weights = jax.nn.softmax(attn_weights + attention_bias, axis=-1)
        attn_weights = self.attn_dropout(attn_weights, deterministic=deterministic)
        attn_output = jnp.einsum("bhqk,bkhd->bqhd", attn_weights, value)
        attn_output = self.c_proj(self._merge_heads(attn_output))
        return self.resid_dropout(attn_output, deterministic=deterministic)


class FlaxGPT2MLP(nn.Module):
    config: GPT2Config
    intermediate_size: int

    def setup(self):
        init = jax.nn.initializers.normal(self.config.initializer_range)
        self.c_fc = nn.Dense(self.intermediate_size, kernel_init=init)
        self.c_proj = nn.Dense(self.config.n_embd, kernel_init=init)
        self.dropout = nn.Dropout(rate=self.config.resid_pdrop)

    def __call__(self, hidden_states, deterministic: bool = True):
        hidden_states = jax.nn.gelu(self.c_fc(hidden_states), approximate=True)
        return self.dropout(self.c_proj(hidden_states), deterministic=deterministic)


class FlaxGPT2Block(nn.Module):
    config: GPT2Config

    def setup(self):
        eps = self.config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(epsilon=eps)
        self.attn = FlaxGPT2Attention(self.config)
        self.ln_2 = nn.LayerNorm(epsilon=eps)
        self.mlp = FlaxGPT2MLP(self.config, 4 * self.config.n_embd)

    def __call__(self, hidden_states, attention_mask, position_ids, deterministic: bool = True):
        residual = hidden_states
        hidden_states = self.attn(self.ln_1(hidden_states), attention_mask, position_ids,
                                  deterministic=deterministic)
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.mlp(self.ln_2(hidden_states), deterministic=deterministic)
        return residual + hidden_states


class FlaxGPT2BlockCollection(nn.Module):
    config: GPT2Config
    remat_policies: tuple | None = None  # like HF's `gradient_checkpointing`, one entry per block

    def setup(self):
        blocks = []
        for i in range(self.config.n_layer):
            policy = None if self.remat_policies is None else self.remat_policies[i]
            if policy is None:
                block_cls = FlaxGPT2Block
            else:  # `deterministic` (argument 4, counting self) must stay a Python bool
                block_cls = nn.remat(FlaxGPT2Block, policy=policy, static_argnums=(4,))
            blocks.append(block_cls(self.config, name=str(i)))
        self.blocks = blocks

    def __call__(self, hidden_states, attention_mask, position_ids, deterministic: bool = True):
        for block in self.blocks:
            hidden_states = block(hidden_states, attention_mask, position_ids, deterministic)
        return hidden_states


class FlaxGPT2Module(nn.Module):
    config: GPT2Config
    remat_policies: tuple | None = None

    def setup(self):
        c = self.config
        init = jax.nn.initializers.normal(c.initializer_range)
        self.wte = nn.Embed(c.vocab_size, c.n_embd, embedding_init=init)
        self.wpe = nn.Embed(c.n_positions, c.n_embd, embedding_init=init)
        self.dropout = nn.Dropout(rate=c.embd_pdrop)
        self.h = FlaxGPT2BlockCollection(c, remat_policies=self.remat_policies)
        self.ln_f = nn.LayerNorm(epsilon=c.layer_norm_epsilon)

    def __call__(self, input_ids, attention_mask, position_ids, deterministic: bool = True):
        hidden_states = self.wte(input_ids.astype("i4")) + self.wpe(position_ids.astype("i4"))
        hidden_states = self.dropout(hidden_states, deterministic=deterministic)
        hidden_states = self.h(hidden_states, attention_mask, position_ids, deterministic)
        return self.ln_f(hidden_states)


class FlaxGPT2LMHeadModule(nn.Module):
    config: GPT2Config
    remat_policies: tuple | None = None

    def setup(self):
        self.transformer = FlaxGPT2Module(self.config, remat_policies=self.remat_policies)

    def __call__(self, input_ids, attention_mask, position_ids, deterministic: bool = True):
        hidden_states = self.transformer(input_ids, attention_mask, position_ids, deterministic)
        return self.transformer.wte.attend(hidden_states)  # tied input/output embeddings


def _hf_gpt2() -> CorpusModel:
    config = GPT2Config()
    batch_size, seq_len = 2, config.n_positions

    def make_loss(policies):
        module = FlaxGPT2LMHeadModule(config, remat_policies=policies)

        def loss_fn(params, input_ids, attention_mask, position_ids, dropout_key):
            logits = module.apply({"params": params}, input_ids, attention_mask, position_ids,
                                  deterministic=False, rngs={"dropout": dropout_key})
            labels, weights = input_ids[:, 1:], attention_mask[:, 1:].astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)
            return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)

        return loss_fn

    def make_batch(rng):
        input_ids = _tokens(rng, batch_size, seq_len, config.vocab_size)
        lengths = np.array([seq_len, seq_len - 11])  # second row right-padded
        attention_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
        position_ids = np.clip(np.cumsum(attention_mask, axis=-1) - 1, 0, None).astype(np.int32)
        return input_ids, attention_mask, position_ids, _raw_key(rng)

    def init_params(key, input_ids, attention_mask, position_ids):
        return FlaxGPT2LMHeadModule(config).init(
            key, input_ids, attention_mask, position_ids)["params"]

    params = _init_shapes(init_params, *make_batch(np.random.default_rng(0))[:3])
    return _model("hf_gpt2", make_loss(None), params, make_batch,
                  optax.adamw(3e-4, weight_decay=0.01), config.n_layer, make_loss)


# ---------------------------------------------------------------------------------------------
# 2. selfattn_gpt: nn.compact everywhere, default auto names (LM/Decoder_0/Block_3),
#    nn.SelfAttention with nn.make_causal_mask, pre-LN, separate lm_head.
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        with warnings.catch_warnings():  # flax announces SelfAttention's deprecation on each call
            warnings.filterwarnings("ignore", "SelfAttention will be deprecated",
                                    DeprecationWarning)
            h = nn.SelfAttention(num_heads=self.n_heads, qkv_features=self.d_model,
                                 deterministic=True)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d_model)(h)
        h = nn.gelu(h)
        h = nn.Dense(self.d_model)(h)
        return x + h


class Decoder(nn.Module):
    n_layers: int
    d_model: int
    n_heads: int
    remat_policies: tuple | None = None

    @nn.compact
    def __call__(self, x, mask):
        for i in range(self.n_layers):
            if self.remat_policies is None:
                x = Block(self.d_model, self.n_heads)(x, mask)  # auto-named Block_i
            else:
                # nn.remat(Block) is a class named "CheckpointBlock"; name the blocks by hand so
                # the params keep the names of the plain model (what users do to load checkpoints)
                policy = self.remat_policies[i]
                cls = Block if policy is None else nn.remat(Block, policy=policy)
                x = cls(self.d_model, self.n_heads, name=f"Block_{i}")(x, mask)
        return nn.LayerNorm()(x)


class LM(nn.Module):
    vocab_size: int = 256
    max_len: int = 64
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    remat_policies: tuple | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (self.max_len, self.d_model))
        x = x + pos[None, : tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        x = Decoder(self.n_layers, self.d_model, self.n_heads, self.remat_policies)(x, mask)
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x)


def _selfattn_gpt() -> CorpusModel:
    batch_size, seq_len, n_layers = 4, 32, 4

    def make_loss(policies):
        model = LM(n_layers=n_layers, remat_policies=policies)

        def loss_fn(params, inputs, targets):
            logits = model.apply({"params": params}, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return loss_fn

    def make_batch(rng):
        tokens = _tokens(rng, batch_size, seq_len + 1, 256)
        return tokens[:, :-1], tokens[:, 1:]

    params = _init_shapes(lambda k, x: LM(n_layers=n_layers).init(k, x)["params"],
                          make_batch(np.random.default_rng(0))[0])
    return _model("selfattn_gpt", make_loss(None), params, make_batch, optax.adamw(1e-3),
                  n_layers, make_loss)


# ---------------------------------------------------------------------------------------------
# 3. bert_encoder: HF-style BERT module tree (model/encoder/layer/<i>/attention/self/...),
#    nn.MultiHeadDotProductAttention with a padding mask, token types, post-LN, MLM head.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 384
    hidden_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    config: BertConfig

    def setup(self):
        c = self.config
        init = jax.nn.initializers.normal(0.02)
        self.word_embeddings = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=init)
        self.position_embeddings = nn.Embed(c.max_position_embeddings, c.hidden_size,
                                            embedding_init=init)
        self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.hidden_size, embedding_init=init)
        self.LayerNorm = nn.LayerNorm(epsilon=c.layer_norm_eps)

    def __call__(self, input_ids, token_type_ids, position_ids):
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class BertSelfOutput(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = nn.Dense(self.config.hidden_size)
        self.LayerNorm = nn.LayerNorm(epsilon=self.config.layer_norm_eps)

    def __call__(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    config: BertConfig

    def setup(self):
        c = self.config
        self.self = nn.MultiHeadDotProductAttention(
            num_heads=c.num_attention_heads, qkv_features=c.hidden_size, out_features=c.hidden_size,
            deterministic=True)
        self.output = BertSelfOutput(c)

    def __call__(self, hidden_states, attention_mask):
        attn_output = self.self(hidden_states, mask=attention_mask)
        return self.output(attn_output, hidden_states)


class BertIntermediate(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = nn.Dense(self.config.intermediate_size)

    def __call__(self, hidden_states):
        return nn.gelu(self.dense(hidden_states), approximate=False)


class BertOutput(nn.Module):
    config: BertConfig

    def setup(self):
        self.dense = nn.Dense(self.config.hidden_size)
        self.LayerNorm = nn.LayerNorm(epsilon=self.config.layer_norm_eps)

    def __call__(self, hidden_states, attention_output):
        return self.LayerNorm(self.dense(hidden_states) + attention_output)


class BertLayer(nn.Module):
    config: BertConfig

    def setup(self):
        self.attention = BertAttention(self.config)
        self.intermediate = BertIntermediate(self.config)
        self.output = BertOutput(self.config)

    def __call__(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class BertLayerCollection(nn.Module):
    config: BertConfig
    remat_policies: tuple | None = None

    def setup(self):
        layers = []
        for i in range(self.config.num_hidden_layers):
            policy = None if self.remat_policies is None else self.remat_policies[i]
            cls = BertLayer if policy is None else nn.remat(BertLayer, policy=policy)
            layers.append(cls(self.config, name=str(i)))
        self.layers = layers

    def __call__(self, hidden_states, attention_mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return hidden_states


class BertEncoder(nn.Module):
    config: BertConfig
    remat_policies: tuple | None = None

    def setup(self):
        self.layer = BertLayerCollection(self.config, remat_policies=self.remat_policies)

    def __call__(self, hidden_states, attention_mask):
        return self.layer(hidden_states, attention_mask)


class BertModule(nn.Module):
    config: BertConfig
    remat_policies: tuple | None = None

    def setup(self):
        self.embeddings = BertEmbeddings(self.config)
        self.encoder = BertEncoder(self.config, remat_policies=self.remat_policies)

    def __call__(self, input_ids, token_type_ids, attention_mask):
        position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        hidden_states = self.embeddings(input_ids, token_type_ids, position_ids)
        mask = nn.make_attention_mask(attention_mask > 0, attention_mask > 0)  # (b, 1, q, k)
        return self.encoder(hidden_states, mask)


class BertForMaskedLMModule(nn.Module):
    config: BertConfig
    remat_policies: tuple | None = None

    def setup(self):
        c = self.config
        self.model = BertModule(c, remat_policies=self.remat_policies)
        self.transform = nn.Dense(c.hidden_size)
        self.transform_LayerNorm = nn.LayerNorm(epsilon=c.layer_norm_eps)
        self.decoder = nn.Dense(c.vocab_size)  # separate (untied) head

    def __call__(self, input_ids, token_type_ids, attention_mask):
        hidden_states = self.model(input_ids, token_type_ids, attention_mask)
        hidden_states = self.transform_LayerNorm(nn.gelu(self.transform(hidden_states)))
        return self.decoder(hidden_states)


def _bert_encoder() -> CorpusModel:
    config = BertConfig()
    batch_size, seq_len = 2, config.max_position_embeddings

    def make_loss(policies):
        module = BertForMaskedLMModule(config, remat_policies=policies)

        def loss_fn(params, input_ids, token_type_ids, attention_mask, labels):
            logits = module.apply({"params": params}, input_ids, token_type_ids, attention_mask)
            weights = attention_mask.astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(losses * weights) / jnp.sum(weights)

        return loss_fn

    def make_batch(rng):
        input_ids = _tokens(rng, batch_size, seq_len, config.vocab_size)
        labels = _tokens(rng, batch_size, seq_len, config.vocab_size)
        token_type_ids = (np.arange(seq_len)[None, :] >= seq_len // 2).astype(np.int32)
        token_type_ids = np.broadcast_to(token_type_ids, (batch_size, seq_len)).copy()
        lengths = np.array([seq_len, seq_len - 20])  # second row padded
        attention_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
        return input_ids, token_type_ids, attention_mask, labels

    def init_params(key, input_ids, token_type_ids, attention_mask):
        return BertForMaskedLMModule(config).init(
            key, input_ids, token_type_ids, attention_mask)["params"]

    params = _init_shapes(init_params, *make_batch(np.random.default_rng(0))[:3])
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return _model("bert_encoder", make_loss(None), params, make_batch, optimizer,
                  config.num_hidden_layers, make_loss)


# ---------------------------------------------------------------------------------------------
# 4. plain_jax: no flax; params are a dict of arrays with a list of per-block dicts.
# ---------------------------------------------------------------------------------------------

_PJ = dict(vocab=256, d_model=64, n_heads=4, d_ff=256, n_layers=4, seq_len=48, batch_size=2)


def _pj_init_params(key):
    c = _PJ
    d, f, v = c["d_model"], c["d_ff"], c["vocab"]
    keys = iter(jax.random.split(key, 4 + 6 * c["n_layers"]))

    def dense(shape, scale=0.02):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = []
    for _ in range(c["n_layers"]):
        blocks.append({
            "ln1_scale": jnp.ones((d,)), "ln1_bias": jnp.zeros((d,)),
            "wq": dense((d, d)), "wk": dense((d, d)), "wv": dense((d, d)), "wo": dense((d, d)),
            "ln2_scale": jnp.ones((d,)), "ln2_bias": jnp.zeros((d,)),
            "w1": dense((d, f)), "b1": jnp.zeros((f,)), "w2": dense((f, d)), "b2": jnp.zeros((d,)),
        })
    return {
        "embed": dense((v, d)),
        "pos": dense((c["seq_len"], d)),
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
        "unembed": dense((d, v)),
    }


def _layer_norm(x, scale, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def block(p, x, mask):
    """One pre-LN transformer block; `mask` is (seq, seq) bool, True where attention is allowed."""
    b, s, d = x.shape
    n_heads = _PJ["n_heads"]
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q = (h @ p["wq"]).reshape(b, s, n_heads, d // n_heads)
    k = (h @ p["wk"]).reshape(b, s, n_heads, d // n_heads)
    v = (h @ p["wv"]).reshape(b, s, n_heads, d // n_heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // n_heads).astype(x.dtype)
    scores = jnp.where(mask, scores, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, d)
    x = x + attn @ p["wo"]
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    h = jax.nn.relu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return x + h


def _pj_forward(params, tokens, block_fns):
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    mask = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), dtype=bool))
    for p, fn in zip(params["blocks"], block_fns):
        x = fn(p, x, mask)
    x = _layer_norm(x, params["ln_f"]["scale"], params["ln_f"]["bias"])
    return x @ params["unembed"]


def _plain_jax() -> CorpusModel:
    c = _PJ

    def make_loss(policies):
        block_fns = [block if pol is None else jax.checkpoint(block, policy=pol)
                     for pol in policies]

        def loss_fn(params, tokens, targets):
            logits = _pj_forward(params, tokens, block_fns)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        return loss_fn

    def make_batch(rng):
        tokens = _tokens(rng, c["batch_size"], c["seq_len"] + 1, c["vocab"])
        return tokens[:, :-1], tokens[:, 1:]

    params = jax.eval_shape(_pj_init_params, jax.random.PRNGKey(0))
    return _model("plain_jax", make_loss((None,) * c["n_layers"]), params, make_batch,
                  optax.adamw(1e-3, weight_decay=0.1), c["n_layers"], make_loss)


# ---------------------------------------------------------------------------------------------
# 5. scan_lm: blocks are one nn.scan over a Block (params stacked on axis 0); remat goes
#    inside the scan, so only uniform policies are possible.
# ---------------------------------------------------------------------------------------------


class ScanBlock(nn.Module):
    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.RMSNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.n_heads, use_bias=False,
                                            deterministic=True)(h, mask=mask)
        x = x + h
        h = nn.RMSNorm()(x)
        gate = nn.Dense(2 * self.d_model, use_bias=False)(h)
        up = nn.Dense(2 * self.d_model, use_bias=False)(h)
        x = x + nn.Dense(self.d_model, use_bias=False)(nn.silu(gate) * up)
        return x, None


class ScanLM(nn.Module):
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 6
    remat: bool = False
    remat_policy: Policy = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        mask = nn.make_causal_mask(tokens)
        block_cls = ScanBlock
        if self.remat:
            block_cls = nn.remat(ScanBlock, policy=self.remat_policy, prevent_cse=False)
        stack = nn.scan(block_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,), length=self.n_layers)
        x, _ = stack(self.d_model, self.n_heads, name="blocks")(x, mask)
        x = nn.RMSNorm()(x)
        return nn.Dense(self.vocab_size, use_bias=False, name="lm_head")(x)


def _scan_lm() -> CorpusModel:
    batch_size, seq_len, n_layers = 2, 32, 6

    def make_module_loss(module):
        def loss_fn(params, inputs, targets):
            logits = module.apply({"params": params}, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return loss_fn

    def build(policies):
        if any(p is not policies[0] for p in policies):
            raise ValueError("scan_lm stacks its blocks with nn.scan: only uniform remat "
                             f"policies are possible, got {policies}")
        return make_module_loss(ScanLM(n_layers=n_layers, remat=True, remat_policy=policies[0]))

    def make_batch(rng):
        tokens = _tokens(rng, batch_size, seq_len + 1, 256)
        return tokens[:, :-1], tokens[:, 1:]

    params = _init_shapes(lambda k, x: ScanLM(n_layers=n_layers).init(k, x)["params"],
                          make_batch(np.random.default_rng(0))[0])
    loss_fn = make_module_loss(ScanLM(n_layers=n_layers))
    return _model("scan_lm", loss_fn, params, make_batch, optax.adamw(1e-3), n_layers, build,
                  supports_mixes=False)


# ---------------------------------------------------------------------------------------------
# 6. nnx_lm: flax.nnx modules; blocks in an nnx.List; loss over a pure dict of arrays via
#    nnx.split / nnx.merge; remat with nnx.remat on the block call.
# ---------------------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs):
        self.n_heads = n_heads
        self.norm1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.fc1 = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x, mask):
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.n_heads, d // self.n_heads) for t in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, mask=mask)
        x = x + self.out(attn.reshape(b, s, d))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class NnxLM(nnx.Module):
    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, max_len: int,
                 *, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Embed(max_len, d_model, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(d_model, n_heads, rngs=rngs) for _ in range(n_layers)])
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, remat_policies=None):
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos(jnp.arange(s))[None]
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))[None, None]
        for i, blk in enumerate(self.blocks):
            policy = None if remat_policies is None else remat_policies[i]
            if policy is None:
                x = blk(x, mask)
            else:
                x = nnx.remat(lambda m, h, msk: m(h, msk), policy=policy)(blk, x, mask)
        return self.head(self.norm(x))


def _nnx_lm() -> CorpusModel:
    vocab, d_model, n_heads, n_layers, seq_len, batch_size = 256, 64, 4, 3, 32, 4

    def new_model(key):
        return NnxLM(vocab, d_model, n_heads, n_layers, seq_len, rngs=nnx.Rngs(key))

    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: new_model(0)))

    def make_loss(policies):
        def loss_fn(params, tokens, targets):
            state = jax.tree.map(lambda v: v, abstract_state)  # fresh Variables, same types
            nnx.replace_by_pure_dict(state, params)
            model = nnx.merge(graphdef, state)
            logits = model(tokens, remat_policies=policies)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        return loss_fn

    def make_batch(rng):
        tokens = _tokens(rng, batch_size, seq_len + 1, vocab)
        return tokens[:, :-1], tokens[:, 1:]

    params = nnx.to_pure_dict(abstract_state)  # nested dict of ShapeDtypeStruct
    return _model("nnx_lm", make_loss(None), params, make_batch, optax.adamw(1e-3), n_layers,
                  make_loss)


# ---------------------------------------------------------------------------------------------
# 7. cnn_bn: ResNet-ish CNN, BatchNorm in training mode, blocks in list attributes
#    (stages_<s>/layers_<l>/...), batch stats carried in the batch and returned as aux.
# ---------------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        residual = x
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.features, (1, 1), (self.strides, self.strides),
                               use_bias=False, name="proj_conv")(residual)
            residual = norm(name="proj_norm")(residual)
        return nn.relu(residual + y)


class Stage(nn.Module):
    features: int
    n_layers: int
    strides: int
    remat_policies: tuple | None = None

    def setup(self):
        layers = []
        for i in range(self.n_layers):
            policy = None if self.remat_policies is None else self.remat_policies[i]
            # `train` (argument 2, counting self) must stay a Python bool
            cls = ResBlock if policy is None else nn.remat(ResBlock, policy=policy,
                                                           static_argnums=(2,))
            layers.append(cls(self.features, self.strides if i == 0 else 1))
        self.layers = layers

    def __call__(self, x, train: bool):
        for layer in self.layers:
            x = layer(x, train)
        return x


class SmallResNet(nn.Module):
    stage_sizes: tuple = (2, 2)
    stage_features: tuple = (16, 32)
    num_classes: int = 10
    remat_policies: tuple | None = None

    def setup(self):
        self.stem = nn.Conv(self.stage_features[0], (3, 3), use_bias=False)
        self.stem_norm = nn.BatchNorm(momentum=0.9)
        stages, start = [], 0
        for s, (size, feats) in enumerate(zip(self.stage_sizes, self.stage_features)):
            pols = None if self.remat_policies is None else self.remat_policies[start:start + size]
            stages.append(Stage(feats, size, 1 if s == 0 else 2, remat_policies=pols))
            start += size
        self.stages = stages
        self.head = nn.Dense(self.num_classes)

    def __call__(self, x, train: bool = True):
        x = nn.relu(self.stem_norm(self.stem(x), use_running_average=not train))
        for stage in self.stages:
            x = stage(x, train)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _batchnorm_classifier(name: str, module: type[nn.Module], batch_size: int, size: int,
                          stage_sizes: tuple) -> CorpusModel:
    """An image classifier whose BatchNorm statistics ride in the batch and come back as aux,
    as a user's training loop carries them: `module(stage_sizes=..., remat_policies=...)`."""

    def make_loss(policies):
        model = module(stage_sizes=stage_sizes, remat_policies=policies)

        def loss_fn(params, images, labels, batch_stats):
            logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                          train=True, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        return loss_fn

    images = jax.ShapeDtypeStruct((batch_size, size, size, 3), jnp.float32)
    variables = _init_shapes(
        lambda k, x: module(stage_sizes=stage_sizes).init(k, x, train=False), images)

    def make_batch(rng):
        images = rng.standard_normal((batch_size, size, size, 3)).astype(np.float32)
        labels = rng.integers(0, 10, (batch_size,), dtype=np.int32)
        return images, labels, _fill(variables["batch_stats"], rng)  # running means 0, vars 1

    return _model(name, make_loss(None), variables["params"], make_batch, optax.adamw(1e-3),
                  sum(stage_sizes), make_loss, has_aux=True)


def _cnn_bn() -> CorpusModel:
    return _batchnorm_classifier("cnn_bn", SmallResNet, 4, 32, (2, 2))


# ---------------------------------------------------------------------------------------------
# 8. unet: conv blocks down, bottleneck, transposed-conv up with concatenated skips; MSE loss.
# ---------------------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.Conv(self.features, (3, 3))(x)
            x = nn.GroupNorm(num_groups=4)(x)
            x = nn.swish(x)
        return x


class UNet(nn.Module):
    features: tuple = (16, 32)
    bottleneck: int = 64
    out_channels: int = 3
    remat_policies: tuple | None = None

    def _block(self, index, features, name):
        policy = None if self.remat_policies is None else self.remat_policies[index]
        cls = ConvBlock if policy is None else nn.remat(ConvBlock, policy=policy)
        return cls(features, name=name)

    @nn.compact
    def __call__(self, x):
        skips, index = [], 0
        for i, f in enumerate(self.features):
            x = self._block(index, f, f"down_{i}")(x)
            index += 1
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = self._block(index, self.bottleneck, "bottleneck")(x)
        index += 1
        for i, f in enumerate(reversed(self.features)):
            x = nn.ConvTranspose(f, (2, 2), strides=(2, 2), name=f"upsample_{i}")(x)
            x = jnp.concatenate([x, skips.pop()], axis=-1)
            x = self._block(index, f, f"up_{i}")(x)
            index += 1
        return nn.Conv(self.out_channels, (1, 1), name="out")(x)


def _unet() -> CorpusModel:
    batch_size, size = 2, 32
    n_blocks = 2 * len(UNet.features) + 1

    def make_loss(policies):
        model = UNet(remat_policies=policies)

        def loss_fn(params, images, targets):
            return jnp.mean((model.apply({"params": params}, images) - targets) ** 2)

        return loss_fn

    def make_batch(rng):
        images = rng.standard_normal((batch_size, size, size, 3)).astype(np.float32)
        targets = rng.standard_normal((batch_size, size, size, 3)).astype(np.float32)
        return images, targets

    params = _init_shapes(lambda k, x: UNet().init(k, x)["params"],
                          make_batch(np.random.default_rng(0))[0])
    return _model("unet", make_loss(None), params, make_batch, optax.adamw(1e-3), n_blocks,
                  make_loss)


# ---------------------------------------------------------------------------------------------
# 9. mlp_mixer: non-transformer; residual token/channel MLP blocks with LayerNorm, held in a
#    python list attribute (auto names layers_<i>).
# ---------------------------------------------------------------------------------------------


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(self.mlp_dim)(x))
        return nn.Dense(x.shape[-1])(y)


class MixerBlock(nn.Module):
    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = jnp.swapaxes(nn.LayerNorm()(x), 1, 2)
        y = jnp.swapaxes(MlpBlock(self.tokens_mlp_dim, name="token_mixing")(y), 1, 2)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)


class MlpMixer(nn.Module):
    num_classes: int = 10
    patch: int = 4
    hidden_dim: int = 64
    num_blocks: int = 6
    tokens_mlp_dim: int = 64
    channels_mlp_dim: int = 128
    remat_policies: tuple | None = None

    def setup(self):
        self.stem = nn.Conv(self.hidden_dim, (self.patch, self.patch),
                            strides=(self.patch, self.patch))
        layers = []
        for i in range(self.num_blocks):
            policy = None if self.remat_policies is None else self.remat_policies[i]
            cls = MixerBlock if policy is None else nn.remat(MixerBlock, policy=policy)
            layers.append(cls(self.tokens_mlp_dim, self.channels_mlp_dim))
        self.layers = layers
        self.pre_head_layer_norm = nn.LayerNorm()
        self.head = nn.Dense(self.num_classes)

    def __call__(self, images):
        x = self.stem(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # (batch, tokens, channels)
        for layer in self.layers:
            x = layer(x)
        return self.head(jnp.mean(self.pre_head_layer_norm(x), axis=1))


def _mlp_mixer() -> CorpusModel:
    batch_size, size, n_blocks = 4, 32, 6

    def make_loss(policies):
        model = MlpMixer(num_blocks=n_blocks, remat_policies=policies)

        def loss_fn(params, images, labels):
            logits = model.apply({"params": params}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return loss_fn

    def make_batch(rng):
        images = rng.standard_normal((batch_size, size, size, 3)).astype(np.float32)
        labels = rng.integers(0, 10, (batch_size,), dtype=np.int32)
        return images, labels

    params = _init_shapes(lambda k, x: MlpMixer(num_blocks=n_blocks).init(k, x)["params"],
                          make_batch(np.random.default_rng(0))[0])
    return _model("mlp_mixer", make_loss(None), params, make_batch, optax.adamw(1e-3), n_blocks,
                  make_loss)


# ---------------------------------------------------------------------------------------------
# 10. resnet_maxpool: the layout of the Flax examples' ResNet: a 7x7 stride-2 stem, BatchNorm,
#     `nn.max_pool` 3x3 stride 2 SAME, then blocks created in __call__ under the names
#     auto-naming gives them (ResNetBlock_<k>); batch stats in the variables, returned as aux.
# ---------------------------------------------------------------------------------------------


class ResNetBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        residual = x
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False,
                               name="conv_proj")(residual)
            residual = norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class PoolResNet(nn.Module):
    stage_sizes: tuple = (2, 2)
    num_filters: int = 8
    num_classes: int = 10
    remat_policies: tuple | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                    name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        k = 0
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                policy = None if self.remat_policies is None else self.remat_policies[k]
                # `train` (argument 2, counting self) must stay a Python bool
                cls = ResNetBlock if policy is None else nn.remat(ResNetBlock, policy=policy,
                                                                  static_argnums=(2,))
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                # the name auto-naming gives the plain block, so remat keeps the params
                x = cls(self.num_filters * 2 ** i, strides, name=f"ResNetBlock_{k}")(x, train)
                k += 1
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def _resnet_maxpool() -> CorpusModel:
    return _batchnorm_classifier("resnet_maxpool", PoolResNet, 8, 64, (2, 2))


# ---------------------------------------------------------------------------------------------
# 11. vit: the big_vision / Flax-examples ViT layout: a patch convolution, a class token and a
#     learned position embedding, blocks held in a list made in setup (blocks_<i>), attention
#     and MLP dropout on, the class token's output classified; optax.chain of
#     clip_by_global_norm and AdamW, so the update needs every gradient first.
# ---------------------------------------------------------------------------------------------


class VitMlp(nn.Module):
    dim: int
    hidden: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, x, deterministic):
        y = nn.Dense(self.hidden)(x)
        y = nn.gelu(y)
        y = nn.Dropout(self.rate)(y, deterministic=deterministic)
        y = nn.Dense(self.dim)(y)
        return nn.Dropout(self.rate)(y, deterministic=deterministic)


class Encoder1DBlock(nn.Module):
    dim: int
    heads: int

    def setup(self):
        self.ln1 = nn.LayerNorm()
        self.attn = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=0.1)
        self.ln2 = nn.LayerNorm()
        self.mlp = VitMlp(self.dim, 4 * self.dim)

    def __call__(self, x, deterministic):
        h = self.ln1(x)
        h = self.attn(h, h, deterministic=deterministic)
        x = x + h
        return x + self.mlp(self.ln2(x), deterministic)


class ViT(nn.Module):
    depth: int = 4
    dim: int = 64
    heads: int = 4
    patch: int = 4
    classes: int = 10
    policies: tuple | None = None

    def setup(self):
        self.embed = nn.Conv(self.dim, (self.patch, self.patch), strides=(self.patch, self.patch),
                             padding="VALID")
        self.cls = self.param("cls", nn.initializers.zeros, (1, 1, self.dim))
        self.pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, 65, self.dim))
        blocks = []
        for i in range(self.depth):  # the names a list attribute gets: blocks_<i>
            p = None if self.policies is None else self.policies[i]
            cls = (Encoder1DBlock if p is None
                   else nn.remat(Encoder1DBlock, policy=p, static_argnums=(2,)))
            blocks.append(cls(self.dim, self.heads, name=f"blocks_{i}"))
        self.blocks = blocks
        self.norm = nn.LayerNorm()
        self.head = nn.Dense(self.classes)

    def __call__(self, img, train=True):
        x = self.embed(img)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        x = jnp.concatenate([jnp.tile(self.cls, (b, 1, 1)), x], axis=1) + self.pos
        for blk in self.blocks:
            x = blk(x, not train)
        return self.head(self.norm(x[:, 0]))


def _vit() -> CorpusModel:
    depth, bs = 4, 8

    def make_loss(policies):
        m = ViT(depth=depth, policies=policies)

        def loss_fn(params, images, labels, key):
            logits = m.apply({"params": params}, images, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return loss_fn

    def make_batch(rng):
        return (rng.standard_normal((bs, 32, 32, 3)).astype(np.float32),
                rng.integers(0, 10, (bs,), dtype=np.int32), _raw_key(rng))

    params = _init_shapes(lambda k, x: ViT(depth=depth).init(k, x, train=False)["params"],
                          make_batch(np.random.default_rng(0))[0])
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.05))
    return _model("vit", make_loss(None), params, make_batch, opt, depth, make_loss)


# ---------------------------------------------------------------------------------------------
# 12. llama_rope: a Llama-style decoder written by hand: rotary tables computed once and passed
#     to every layer, RMSNorm, SwiGLU, bfloat16 compute on float32 parameters (Dense(dtype=
#     bfloat16)), a causal mask built inside each layer; optax.lion.
# ---------------------------------------------------------------------------------------------


def _rope_tables(seq, hd):
    inv = 1.0 / (10000 ** (jnp.arange(0, hd, 2) / hd))
    t = jnp.arange(seq)[:, None] * inv[None]
    return jnp.sin(t), jnp.cos(t)


def _apply_rope(x, sin, cos):
    x1, x2 = x[..., ::2], x[..., 1::2]
    s, c = sin[None, :, None, :], cos[None, :, None, :]
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(x.shape)


class RMSNorm(nn.Module):

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
        return (y * w).astype(x.dtype)


class LlamaLayer(nn.Module):
    dim: int
    heads: int

    @nn.compact
    def __call__(self, x, sin, cos):
        b, s, d = x.shape
        hd = d // self.heads
        h = RMSNorm(name="input_layernorm")(x)

        def dense(name, features):
            return nn.Dense(features, use_bias=False, dtype=jnp.bfloat16, name=name)

        q = dense("q_proj", d)(h).reshape(b, s, self.heads, hd)
        k = dense("k_proj", d)(h).reshape(b, s, self.heads, hd)
        v = dense("v_proj", d)(h).reshape(b, s, self.heads, hd)
        q, k = _apply_rope(q, sin, cos), _apply_rope(k, sin, cos)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        att = jax.nn.softmax(att, -1).astype(jnp.bfloat16)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        x = x + dense("o_proj", d)(o)
        h = RMSNorm(name="post_attention_layernorm")(x)
        g = dense("gate_proj", 3 * d)(h)
        u = dense("up_proj", 3 * d)(h)
        return x + dense("down_proj", d)(nn.silu(g) * u)


class Llama(nn.Module):
    vocab: int = 512
    dim: int = 64
    heads: int = 4
    layers: int = 4
    policies: tuple | None = None

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.dim, dtype=jnp.bfloat16, name="embed_tokens")(ids)
        sin, cos = _rope_tables(ids.shape[1], self.dim // self.heads)
        for i in range(self.layers):
            p = None if self.policies is None else self.policies[i]
            cls = LlamaLayer if p is None else nn.remat(LlamaLayer, policy=p)
            x = cls(self.dim, self.heads, name=f"layers_{i}")(x, sin, cos)
        x = RMSNorm(name="norm")(x)
        logits = nn.Dense(self.vocab, use_bias=False, dtype=jnp.bfloat16, name="lm_head")(x)
        return logits.astype(jnp.float32)


def _llama_rope() -> CorpusModel:
    layers, bs, seq = 4, 4, 64

    def make_loss(policies):
        m = Llama(layers=layers, policies=policies)

        def loss_fn(params, ids):
            logits = m.apply({"params": params}, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        return loss_fn

    def make_batch(rng):
        return (_tokens(rng, bs, seq + 1, 512),)

    params = _init_shapes(lambda k, x: Llama(layers=layers).init(k, x[:, :-1])["params"],
                          make_batch(np.random.default_rng(0))[0])
    # nn.remat(nothing_saveable) per layer: the embedding's gradient within 3e-4 of the
    # largest gradient (bfloat16 rounding of the recomputed forward)
    return _model("llama_rope", make_loss(None), params, make_batch, optax.lion(1e-4), layers,
                  make_loss, gradient_rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# 13. albert_shared: ALBERT's weight sharing: one post-norm layer module called at every
#     depth (its gradient is the sum over the calls), a factorized embedding projection,
#     a padding mask from nn.make_attention_mask; nn.remat of the shared layer, so only
#     one policy for all depths.
# ---------------------------------------------------------------------------------------------


class AlbertLayer(nn.Module):
    d: int = 64
    heads: int = 4

    @nn.compact
    def __call__(self, x, mask):
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, deterministic=True)(
            x, x, mask=mask)
        x = nn.LayerNorm()(x + h)
        h = nn.Dense(4 * self.d)(x)
        h = nn.Dense(self.d)(nn.gelu(h))
        return nn.LayerNorm()(x + h)


class Albert(nn.Module):
    layers: int = 4
    policy: Policy = None
    remat: bool = False

    @nn.compact
    def __call__(self, ids, attn_mask):
        x = nn.Embed(384, 32)(ids)
        x = nn.Dense(64, name="embedding_projection")(x)
        mask = nn.make_attention_mask(attn_mask, attn_mask)
        cls = nn.remat(AlbertLayer, policy=self.policy) if self.remat else AlbertLayer
        layer = cls(name="shared_layer")
        for _ in range(self.layers):
            x = layer(x, mask)
        return nn.Dense(384)(x)


def _albert_shared() -> CorpusModel:
    layers, batch_size, seq_len = 4, 4, 64

    def make_module_loss(module):
        def loss_fn(params, ids, attn_mask, labels):
            logits = module.apply({"params": params}, ids, attn_mask)
            w = attn_mask.astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return (losses * w).sum() / w.sum()

        return loss_fn

    def build(policies):
        if any(p is not policies[0] for p in policies):
            raise ValueError("albert_shared calls one layer module at every depth: only uniform "
                             f"remat policies are possible, got {policies}")
        return make_module_loss(Albert(layers=layers, policy=policies[0], remat=True))

    def make_batch(rng):
        ids = _tokens(rng, batch_size, seq_len, 384)
        lengths = np.array([seq_len, seq_len - 9, seq_len, seq_len - 20])  # right-padded rows
        attn_mask = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int32)
        return ids, attn_mask, _tokens(rng, batch_size, seq_len, 384)

    ids, attn_mask, _ = make_batch(np.random.default_rng(0))
    params = _init_shapes(lambda k, i, a: Albert(layers=layers).init(k, i, a)["params"],
                          ids, attn_mask)
    return _model("albert_shared", make_module_loss(Albert(layers=layers)), params, make_batch,
                  optax.adamw(1e-3), layers, build, supports_mixes=False)


# ---------------------------------------------------------------------------------------------
# 14. t5_encdec: an encoder-decoder: the encoder's output is read by every decoder block's
#     cross attention (a value crossing every decoder cut), a causal self-attention mask,
#     input and output embeddings tied (Embed.attend).
# ---------------------------------------------------------------------------------------------


def _self_attention(h, mask=None):
    with warnings.catch_warnings():  # flax announces SelfAttention's deprecation on each call
        warnings.filterwarnings("ignore", "SelfAttention will be deprecated", DeprecationWarning)
        return nn.SelfAttention(num_heads=4, deterministic=True)(h, mask=mask)


class EncBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + _self_attention(nn.LayerNorm()(x))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(64)(nn.relu(nn.Dense(256)(h)))


class DecBlock(nn.Module):
    @nn.compact
    def __call__(self, y, enc, mask):
        y = y + _self_attention(nn.LayerNorm()(y), mask)
        h = nn.LayerNorm()(y)
        y = y + nn.MultiHeadDotProductAttention(num_heads=4, deterministic=True)(h, enc)
        h = nn.LayerNorm()(y)
        return y + nn.Dense(64)(nn.relu(nn.Dense(256)(h)))


class EncDec(nn.Module):
    n: int = 2
    policies: tuple | None = None

    @nn.compact
    def __call__(self, src, tgt):
        emb = nn.Embed(256, 64)
        x = emb(src)
        for i in range(self.n):
            p = None if self.policies is None else self.policies[i]
            cls = EncBlock if p is None else nn.remat(EncBlock, policy=p)
            x = cls(name=f"encoder_{i}")(x)
        enc = nn.LayerNorm(name="enc_norm")(x)
        y = emb(tgt)
        mask = nn.make_causal_mask(tgt)
        for i in range(self.n):
            p = None if self.policies is None else self.policies[self.n + i]
            cls = DecBlock if p is None else nn.remat(DecBlock, policy=p)
            y = cls(name=f"decoder_{i}")(y, enc, mask)
        return emb.attend(nn.LayerNorm(name="dec_norm")(y))


def _t5_encdec() -> CorpusModel:
    n, batch_size = 2, 4

    def make_loss(policies):
        module = EncDec(n=n, policies=policies)

        def loss_fn(params, src, tgt_in, tgt_out):
            logits = module.apply({"params": params}, src, tgt_in)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out).mean()

        return loss_fn

    def make_batch(rng):
        tgt = _tokens(rng, batch_size, 49, 256)
        return _tokens(rng, batch_size, 64, 256), tgt[:, :-1], tgt[:, 1:]

    src, tgt_in, _ = make_batch(np.random.default_rng(0))
    params = _init_shapes(lambda k, s, t: EncDec(n=n).init(k, s, t)["params"], src, tgt_in)
    return _model("t5_encdec", make_loss(None), params, make_batch, optax.adamw(1e-3), 2 * n,
                  make_loss)


# ---------------------------------------------------------------------------------------------
# 15. plain_scan: plain JAX with the layers' parameters stacked on axis 0 and jax.lax.scan
#     over them (no Flax); jax.checkpoint(layer, policy=...) as the scan body.
# ---------------------------------------------------------------------------------------------

_PS = dict(n_layers=6, d_model=64, vocab=256, batch_size=4, seq_len=48)


def _ps_init(key):
    n, d, v = _PS["n_layers"], _PS["d_model"], _PS["vocab"]
    ks = jax.random.split(key, 6)
    return {"emb": jax.random.normal(ks[0], (v, d)) * 0.02,
            "layers": {"w1": jax.random.normal(ks[1], (n, d, 4 * d)) * 0.02,
                       "w2": jax.random.normal(ks[2], (n, 4 * d, d)) * 0.02,
                       "wqkv": jax.random.normal(ks[3], (n, d, 3 * d)) * 0.02,
                       "wo": jax.random.normal(ks[4], (n, d, d)) * 0.02,
                       "g": jnp.ones((n, d))},
            "out": jax.random.normal(ks[5], (d, v)) * 0.02}


def _ps_layer(x, p):
    t = x.shape[1]
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
    q, k, v = jnp.split(h @ p["wqkv"], 3, -1)
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s), v) @ p["wo"]
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"], None


def _plain_scan() -> CorpusModel:
    def make_loss(body):
        def loss_fn(params, ids, labels):
            x = params["emb"][ids]
            x, _ = jax.lax.scan(body, x, params["layers"])
            logits = x @ params["out"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return loss_fn

    def build(policies):
        if any(p is not policies[0] for p in policies):
            raise ValueError("plain_scan scans its layers: only uniform remat policies are "
                             f"possible, got {policies}")
        return make_loss(jax.checkpoint(_ps_layer, policy=policies[0]))

    def make_batch(rng):
        tokens = _tokens(rng, _PS["batch_size"], _PS["seq_len"] + 1, _PS["vocab"])
        return tokens[:, :-1], tokens[:, 1:]

    params = jax.eval_shape(_ps_init, jax.random.PRNGKey(0))
    return _model("plain_scan", make_loss(_ps_layer), params, make_batch, optax.adamw(1e-3),
                  _PS["n_layers"], build, supports_mixes=False)

MODELS: dict[str, Callable[[], CorpusModel]] = {
    "hf_gpt2": _hf_gpt2,
    "selfattn_gpt": _selfattn_gpt,
    "bert_encoder": _bert_encoder,
    "plain_jax": _plain_jax,
    "scan_lm": _scan_lm,
    "nnx_lm": _nnx_lm,
    "cnn_bn": _cnn_bn,
    "unet": _unet,
    "mlp_mixer": _mlp_mixer,
    "resnet_maxpool": _resnet_maxpool,
    "vit": _vit,
    "llama_rope": _llama_rope,
    "albert_shared": _albert_shared,
    "t5_encdec": _t5_encdec,
    "plain_scan": _plain_scan,
}


@functools.lru_cache(maxsize=None)
def get(name: str) -> CorpusModel:
    """The corpus model `name`, built on first use."""
    try:
        builder = MODELS[name]
    except KeyError:
        raise KeyError(f"unknown corpus model {name!r}; known: {sorted(MODELS)}") from None
    return builder()
