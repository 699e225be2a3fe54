"""memory.py through its public functions: fixed bytes of a known pytree, the per-parameter
update detection, stage profiles of a small MLP worked out by hand, and `simulate` /
`timeline` on plans of it. No XLA compile but fixed_memory's optimizer update and one
profile with measure_xla (a few seconds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import tiny_mlp
from remat_planner.graph import build_cost_graph
from remat_planner.memory import (compiler_options, fixed_memory, measure_compiler_options,
                                  per_parameter_update, profile_stages, simulate, timeline,
                                  tree_bytes)
from remat_planner.plan import DOTS_NO_BATCH, NOTHING, STORE, Segment
from remat_planner.trace import trace

f32 = jnp.float32

# DEPTH layers x <- tanh(x @ w) on a (ROWS, WIDTH) float32 batch, then mean(x ** 2).
DEPTH, WIDTH, ROWS = 4, 32, 16
ACT = ROWS * WIDTH * 4                        # one activation: 2,048 bytes
LAYER_FLOPS = 2 * ROWS * WIDTH * WIDTH + ROWS * WIDTH  # the matmul and the tanh: 33,280


_mlp_loss = tiny_mlp.loss
MLP_PARAMS, MLP_BATCH = tiny_mlp.abstract(DEPTH, WIDTH, ROWS)


@pytest.fixture(scope="module")
def mlp():
    program = trace(_mlp_loss, MLP_PARAMS, *MLP_BATCH)
    cost = build_cost_graph(program)
    return program, cost, profile_stages(program, cost, measure_xla=False)


# ---------------------------------------------------------------------------------------
# Fixed memory
# ---------------------------------------------------------------------------------------

PARAMS = {"w": jax.ShapeDtypeStruct((64, 32), f32), "b": jax.ShapeDtypeStruct((32,), f32),
          "emb": jax.ShapeDtypeStruct((10, 8), jnp.bfloat16)}
PARAM_BYTES = 64 * 32 * 4 + 32 * 4 + 10 * 8 * 2  # 8,448
BATCH = (jax.ShapeDtypeStruct((16, 64), f32), jax.ShapeDtypeStruct((16,), jnp.int32))
BATCH_BYTES = 16 * 64 * 4 + 16 * 4


def test_tree_bytes_counts_every_leaf_at_its_dtype():
    assert tree_bytes(PARAMS) == PARAM_BYTES
    assert tree_bytes(BATCH) == BATCH_BYTES
    assert tree_bytes({}) == 0


def test_fixed_memory_adds_params_grads_adam_state_and_batch_exactly():
    """Adam keeps two moments like the parameters (mu, nu) and an int32 step count."""
    fm = fixed_memory(PARAMS, BATCH, optax.adam(1e-3))
    assert fm.params_bytes == PARAM_BYTES
    assert fm.grads_bytes == PARAM_BYTES  # every leaf is floating
    assert fm.opt_state_bytes == 2 * PARAM_BYTES + 4
    assert fm.batch_bytes == BATCH_BYTES
    assert fm.aux_bytes == 0 and fm.staged_grads_bytes == 0
    assert fm.total == PARAM_BYTES * 4 + 4 + BATCH_BYTES
    # The update's workspace is XLA's, after the backward: not part of the total.
    assert fm.update_temp_bytes >= 0


def test_fixed_memory_without_optimizer_and_with_integer_leaves():
    """No optimizer: no state, no update workspace. An integer leaf has no gradient."""
    params = {**PARAMS, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    fm = fixed_memory(params, BATCH)
    assert fm.params_bytes == PARAM_BYTES + 4
    assert fm.grads_bytes == PARAM_BYTES
    assert fm.opt_state_bytes == 0 and fm.update_temp_bytes == 0
    assert fm.total == 2 * PARAM_BYTES + 4 + BATCH_BYTES


def test_fixed_memory_sgd_keeps_no_state_and_momentum_one_copy():
    assert fixed_memory(PARAMS, BATCH, optax.sgd(0.1)).opt_state_bytes == 0
    assert fixed_memory(PARAMS, BATCH, optax.sgd(0.1, momentum=0.9)).opt_state_bytes \
        == PARAM_BYTES


# ---------------------------------------------------------------------------------------
# Per-parameter updates (gradient lifetimes)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer, expected", [
    (optax.sgd(0.1), True),
    (optax.adam(1e-3), True),
    (optax.adamw(1e-3, weight_decay=0.1), True),
    (optax.chain(optax.clip(1.0), optax.adam(1e-3)), True),  # elementwise: per leaf
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), False),
], ids=["sgd", "adam", "adamw", "clip-adam", "global-norm-adamw", "global-norm-sgd"])
def test_per_parameter_update_is_read_from_the_update_dataflow(optimizer, expected):
    """True where each leaf's update reads only its own gradient; a global norm reads
    all of them, whatever optimizer follows it."""
    assert per_parameter_update(optimizer, PARAMS) is expected


# ---------------------------------------------------------------------------------------
# Compiler options
# ---------------------------------------------------------------------------------------

def test_compiler_options_keep_remat_on_cpu():
    opts = compiler_options()
    if jax.default_backend() == "cpu":
        assert "cse_barrier_expander" in opts["xla_disable_hlo_passes"]
    else:
        assert opts == {}
    measured = measure_compiler_options()
    assert {k: measured[k] for k in opts} == opts  # measuring keeps what running keeps
    assert measured["xla_backend_optimization_level"] == 0
    compiler_options()["extra"] = 1  # a copy each call: the module's dict is untouched
    assert "extra" not in compiler_options()


# ---------------------------------------------------------------------------------------
# Stage profiles, worked out by hand on the MLP
# ---------------------------------------------------------------------------------------

def test_profile_has_a_stage_per_layer_with_store_first(mlp):
    program, cost, chain = mlp
    assert chain.n == len(cost.stages) >= DEPTH
    for s in chain.stages:
        assert s.options[0].name == STORE
        assert s.options[0].recompute_flops == 0.0
        assert s.option(STORE) is s.options[0]
    with pytest.raises(KeyError):
        chain.stages[0].option("no such option")
    # A layer's forward: its matmul and its tanh.
    assert [s.flops for s in chain.stages[:DEPTH]] == [LAYER_FLOPS] * DEPTH


def test_store_keeps_at_least_what_nothing_keeps_and_recomputes_nothing(mlp):
    _, _, chain = mlp
    for s in chain.stages:
        store, nothing = s.option(STORE), s.option(NOTHING)
        assert store.keep_bytes >= nothing.keep_bytes
        assert store.recompute_flops == 0.0 <= nothing.recompute_flops
        for o in s.options:
            assert nothing.keep_bytes <= o.keep_bytes <= store.keep_bytes or o is store


def test_nothing_keeps_the_layer_input_and_recomputes_its_forward(mlp):
    """Layer 0's input is the batch (an argument, held anyway): it keeps nothing; every
    later layer keeps its input, one activation. Each recomputes its whole forward."""
    _, _, chain = mlp
    layers = chain.stages[:DEPTH]
    assert [s.option(NOTHING).keep_bytes for s in layers] == [0] + [ACT] * (DEPTH - 1)
    assert [s.option(NOTHING).recompute_flops for s in layers] == [LAYER_FLOPS] * DEPTH


def test_dots_keep_the_matmul_output_and_recompute_only_the_tanh(mlp):
    program, cost, chain = mlp
    for k, s in enumerate(chain.stages[:DEPTH]):
        dots, nothing = s.option(DOTS_NO_BATCH), s.option(NOTHING)
        assert dots.keep_bytes == nothing.keep_bytes + ACT  # one (16, 32) f32 dot output
        assert 0 < dots.recompute_flops < 2 * ROWS * WIDTH * WIDTH  # the matmul is kept
        # The saved value is the stage's own dot_general output.
        (v,) = dots.saved
        st = cost.stages[k]
        eqn = next(e for e in program.eqns[st.start:st.stop] if v in e.outvars)
        assert eqn.primitive.name == "dot_general"


def test_boundaries_are_one_activation_between_layers(mlp):
    _, _, chain = mlp
    assert chain.boundary[0] == 0 and chain.boundary[-1] == 0  # no input, a scalar loss
    assert all(b == ACT for b in chain.boundary[1:DEPTH + 1])


def test_identical_layers_share_one_profile(mlp):
    """Layers 1..3 are the same equations up to renaming: the same figures."""
    _, _, chain = mlp
    figures = [tuple((o.name, o.keep_bytes, o.recompute_flops) for o in s.options)
               for s in chain.stages[1:DEPTH]]
    assert len(set(figures)) == 1


def test_profiles_dict_is_reused_across_calls(mlp):
    program, cost, chain = mlp
    profiles: dict = {}
    first = profile_stages(program, cost, measure_xla=False, profiles=profiles)
    n = len(profiles)
    assert n > 0
    messages = []
    again = profile_stages(program, cost, measure_xla=False, profiles=profiles,
                           progress=messages.append)
    assert again == first == chain
    assert len(profiles) == n
    assert messages == []  # nothing profiled the second time


def test_measured_workspace_is_xla_s_and_stored_layers_keep_what_xla_keeps(mlp):
    """Measured, a stored layer keeps what XLA's fusion keeps for its backward (hlo.py):
    its input where that is an activation, and the matmul's output, the tanh being
    recomputed inside the backward's fusion (ACT for the first layer, whose input is the
    batch, 2 ACT for the others). JAX's residuals are one more ACT: the tanh's output and
    its derivative. The checkpoint options keep the named values either way."""
    program, cost, chain = mlp
    measured = profile_stages(program, cost, measure_xla=True)
    for a, b in zip(measured.stages, chain.stages):
        assert [(o.name, o.keep_bytes, o.recompute_flops) for o in a.options[1:]] \
            == [(o.name, o.keep_bytes, o.recompute_flops) for o in b.options[1:]]
        assert a.fwd_temp_bytes >= 0
    # The backward's workspace is its live peak less its boundaries (2 b_in + b_out,
    # counted apart). A middle layer holds x, the cotangent, the matmul's output and the
    # product read with it (4 ACT, one over the boundaries). The first layer's input is
    # the batch (not a boundary) and its matmul output sits in the weight gradient's
    # output buffer until that is written (the gradients are counted apart too): 2 ACT
    # over its cotangent. x ** 2 reads x and the cotangent, and makes its own (no more);
    # the mean's backward broadcasts a scalar and never reads its input: ACT under.
    assert [s.bwd_temp_bytes for s in measured.stages] \
        == [2 * ACT] + [ACT] * (DEPTH - 1) + [0, -ACT]
    stored = lambda c: [s.option(STORE).keep_bytes for s in c.stages[:DEPTH]]  # noqa: E731
    assert stored(measured) == [ACT] + [2 * ACT] * (DEPTH - 1)
    assert stored(chain) == [2 * ACT] + [3 * ACT] * (DEPTH - 1)


# ---------------------------------------------------------------------------------------
# simulate / timeline
# ---------------------------------------------------------------------------------------

def _each(chain, option):
    return tuple(Segment(i, i + 1, option if any(o.name == option for o in s.options)
                         else STORE) for i, s in enumerate(chain.stages))


def test_simulate_storing_everything_recomputes_nothing(mlp):
    _, _, chain = mlp
    peak, flops = simulate(chain, _each(chain, STORE))
    assert flops == 0.0
    assert peak >= sum(s.option(STORE).keep_bytes for s in chain.stages)


def test_simulate_nothing_per_layer_recomputes_each_forward_once(mlp):
    _, _, chain = mlp
    store_peak, _ = simulate(chain, _each(chain, STORE))
    peak, flops = simulate(chain, _each(chain, NOTHING))
    assert flops == sum(s.option(NOTHING).recompute_flops for s in chain.stages)
    assert flops == DEPTH * LAYER_FLOPS
    assert peak < store_peak


def test_a_region_over_the_layers_recomputes_their_forward(mlp):
    """One checkpoint over the DEPTH layers, each stored inside: the backward reruns the
    layers' forwards (the last one only as far as its backward needs: here all of it)."""
    _, _, chain = mlp
    region = Segment(0, DEPTH, NOTHING, (),
                     tuple(Segment(i, i + 1, STORE) for i in range(DEPTH)))
    rest = tuple(Segment(i, i + 1, STORE) for i in range(DEPTH, chain.n))
    _, flops = simulate(chain, (region, *rest))
    assert flops == DEPTH * LAYER_FLOPS


def test_timeline_peak_is_simulate_s(mlp):
    _, _, chain = mlp
    for plan in (_each(chain, STORE), _each(chain, NOTHING)):
        events = timeline(chain, plan)
        assert max(e.live_bytes for e in events) == simulate(chain, plan)[0]
        assert [e.phase for e in events] == ["forward"] * chain.n + ["backward"] * chain.n
        assert all(e.kept_bytes <= e.live_bytes for e in events)


def _dropout_mlp(n_layers: int = 6, rows: int = 256, d: int = 128):
    """Plain JAX: residual tanh layers, each followed by dropout on a key folded per layer."""
    def loss(params, x, key):
        h = x
        for i in range(n_layers):
            w = params[f"w{i}"]
            h = h + jnp.tanh(h @ w) @ w.T
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
            h = jnp.where(keep, h / 0.9, 0.0)
        return jnp.mean(h ** 2)

    params = {f"w{i}": jax.ShapeDtypeStruct((d, d), jnp.float32) for i in range(n_layers)}
    batch = (jax.ShapeDtypeStruct((rows, d), jnp.float32),
             jax.eval_shape(lambda: jax.random.key(0)))
    return loss, params, batch


def test_layers_differing_only_in_their_dropout_salt_share_one_profile():
    """Each layer folds its own constant into the dropout key (an integer literal of the
    program): that changes no shape, byte or FLOP, so the layers are profiled once, not
    once per layer (memory._structure_key)."""
    loss, params, batch = _dropout_mlp()
    program = trace(loss, params, *batch)
    cost = build_cost_graph(program)
    messages: list[str] = []
    chain = profile_stages(program, cost, measure_xla=False, progress=messages.append)
    names = [s.name for s in chain.stages]
    assert len(names) >= 6, names
    # the first layer (no gradient flows into its input) and the loss's stage differ
    assert len(messages) <= 3, (messages, names)


def test_random_bits_of_later_stages_are_live_in_the_forward():
    """Dropout's random bits are generated at the start of the forward (docs/jax-facts.md,
    fact 8): a stage's bits, a pair of uint32 arrays of its mask's shape, are charged from
    there until it runs (ChainModel.ahead_pending). With them the uncalibrated model puts
    the plan checkpointing every stage within 3% of XLA; without, far under it."""
    import dataclasses

    import remat_planner as rp
    from remat_planner.memory import simulate
    from remat_planner.planner import plan_from_segments
    from remat_planner.verify import measure_step

    loss, params, batch = _dropout_mlp()
    an = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    n = an.chain.n
    mask_pair = 2 * 4 * 256 * 128
    pending = an.chain.ahead_pending  # bits of stages k and later, per cut k
    assert pending[0] == 6 * mask_pair and pending[-1] == 0
    assert all(a >= b for a, b in zip(pending, pending[1:]))
    ckpt = tuple(Segment(i, i + 1, NOTHING if i < n - 1 else STORE) for i in range(n))
    xla = measure_step(an.step.planned(plan_from_segments(an, ckpt, 0, 0, params, batch)),
                       params, batch).peak_bytes
    predict = lambda chain: an.predicted_peak(simulate(chain, ckpt)[0])  # noqa: E731
    assert abs(predict(an.chain) / xla - 1) <= 0.03, (predict(an.chain), xla)
    without = dataclasses.replace(an.chain, ahead_pending=())
    assert predict(without) / xla - 1 < -0.10, (predict(without), xla)


def _pooling_cnn(n_layers: int = 4, batch: int = 4, hw: int = 32, c: int = 16):
    """Plain JAX: layers of tanh(conv3x3(h)), each followed by a 2 x 2 max pooling of stride
    1 ("SAME": every layer keeps its shape), as in docs/jax-facts.md, fact 9."""
    def layer(w, h):
        h = jnp.tanh(jax.lax.conv_general_dilated(
            h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")

    def loss(params, x):
        h = x
        for i in range(n_layers):
            h = layer(params[f"w{i}"], h)
        return jnp.mean(h ** 2)

    params = {f"w{i}": jax.ShapeDtypeStruct((3, 3, c, c), jnp.float32) for i in range(n_layers)}
    return loss, params, (jax.ShapeDtypeStruct((batch, hw, hw, c), jnp.float32),)


def test_pooling_indices_and_zeros_are_held_from_the_start(monkeypatch):
    """A max pooling's gradient on CPU computes its argmax from one s32 iota per dimension
    of the padded input, which XLA makes at the start of the step (docs/jax-facts.md, fact
    9): charged ahead until the pooling's stage runs, and kept to its backward where the
    stage is not stored (memory.with_pooling_indices). Its scatter-add starts from zeros
    of the padded input's shape, also made at the start and held to the pooling's
    backward (fact 15, memory.with_pooling_zeros). With both the uncalibrated model puts
    the plan checkpointing every stage within 3% of XLA (measured -2.86%); without the
    zeros 12.3% under (XLA's live ranges at the peak, in stage 3's backward, hold the
    three of the other stages, 3 x 278,784 B); without either, 41% under."""
    import remat_planner as rp
    from remat_planner import planner
    from remat_planner.graph import value_uses, varying_values
    from remat_planner.memory import pooling_index_bytes, pooling_zeros_bytes, simulate
    from remat_planner.planner import plan_from_segments
    from remat_planner.verify import measure_step

    loss, params, batch = _pooling_cnn()
    optimizer = optax.adamw(1e-3)
    an = rp.analyze(loss, params, batch, optimizer, calibrate=False)
    iotas = 4 * 4 * (4 * 33 * 33 * 16)  # 4 x s32[4, 33, 33, 16] per pooling
    zeros = 4 * 33 * 33 * 16 * 4        # f32[4, 33, 33, 16] per pooling
    varying, uses = varying_values(an.program), value_uses(an.program)
    pools = [e for e in an.program.eqns if e.name == "reduce_window_max"]
    assert [pooling_index_bytes(an.program, e, varying) for e in pools] == [iotas] * 4
    assert [pooling_zeros_bytes(an.program, e, varying, uses) for e in pools] == [zeros] * 4
    assert sum(s.index_bytes for s in an.chain.stages) == 4 * iotas
    assert an.chain.ahead_pending[0] == 4 * iotas and an.chain.ahead_pending[-1] == 0
    assert an.chain.carried_fwd[1] == 4 * zeros
    n = an.chain.n
    ckpt = tuple(Segment(i, i + 1, NOTHING if i < n - 1 else STORE) for i in range(n))
    xla = measure_step(an.step.planned(plan_from_segments(an, ckpt, 0, 0, params, batch)),
                       params, batch).peak_bytes

    def predict(analysis):
        return analysis.predicted_peak(simulate(analysis.chain, ckpt)[0])

    assert abs(predict(an) / xla - 1) <= 0.03, (predict(an), xla)
    monkeypatch.setattr(planner, "with_pooling_zeros", lambda chain, program, cost: chain)
    no_zeros = rp.analyze(loss, params, batch, optimizer, calibrate=False)
    assert predict(no_zeros) / xla - 1 < -0.10, (predict(no_zeros), xla)
    assert predict(an) - predict(no_zeros) == 3 * zeros  # the stage's own is in its workspace
    monkeypatch.setattr(planner, "with_pooling_indices", lambda chain, program, cost: chain)
    without = rp.analyze(loss, params, batch, optimizer, calibrate=False)
    assert without.chain.n == n
    assert predict(without) / xla - 1 < -0.35, (predict(without), xla)


def test_a_pooled_value_read_elsewhere_too_gets_no_zeros():
    """Where the pooling's input has another reader (a U-Net's skip), the scatter adds onto
    that reader's cotangent: XLA makes no zeros for it (docs/jax-facts.md, fact 15; the
    corpus U-Net's step scatters into a slice of another buffer)."""
    from remat_planner.graph import value_uses, varying_values
    from remat_planner.memory import pooling_zeros_bytes

    def loss(w, x):
        h = jnp.tanh(x @ w)
        p = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (2, 1), (2, 1), "VALID")
        return jnp.sum(p ** 2) + jnp.sum(h)

    program = trace(loss, jax.ShapeDtypeStruct((8, 8), f32), jax.ShapeDtypeStruct((16, 8), f32))
    varying, uses = varying_values(program), value_uses(program)
    pools = [e for e in program.eqns if e.name == "reduce_window_max"]
    assert len(pools) == 1 and pooling_zeros_bytes(program, pools[0], varying, uses) == 0


def _masked_blocks(n_blocks: int = 4, batch: int = 4, seq: int = 256, d: int = 64):
    """Plain JAX, no modules: blocks `h + tanh(((h @ h^T) * m) @ h @ w)`, each reading one
    causal mask m (batch x seq x seq float32, 1 MiB) made from the token ids, with no
    gradient: four times a block's input (batch x seq x d, 256 KiB). As
    docs/jax-facts.md, fact 11, measures."""
    def block(w, h, m):
        s = jnp.einsum("btd,bsd->bts", h, h) * m
        return h + jnp.tanh(jnp.einsum("bts,bsd->btd", s, h) @ w)

    def loss(params, x, tokens):
        m = (tokens[:, None, :] <= tokens[:, :, None]).astype(f32)
        h = x
        for i in range(n_blocks):
            h = block(params[f"w{i}"], h, m)
        return jnp.mean(h ** 2)

    params = {f"w{i}": jax.ShapeDtypeStruct((d, d), f32) for i in range(n_blocks)}
    batch = (jax.ShapeDtypeStruct((batch, seq, d), f32),
             jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    return loss, params, batch


def test_a_mask_passed_into_every_block_is_one_buffer(monkeypatch):
    """A value that crosses cuts without a gradient (a mask, position ids) is one buffer,
    live from where it is made to the backward of the first stage reading it, whatever
    the plan (docs/jax-facts.md, fact 11; memory.carried_values). Counted in every cut's
    boundary and in every checkpoint's keep, as before, the mask counted once per block:
    the uncalibrated model put each block checkpointed under `nothing` at +95.3% of XLA
    (9,129,988 B against 4,674,008 B); charged once, at +5.6% (what is left is the
    attention-like products' workspace, measured with their buffers unshared)."""
    import remat_planner as rp
    from remat_planner import planner as planner_module
    from remat_planner.memory import carried_values
    from remat_planner.planner import per_block_plans, plan_from_segments
    from remat_planner.verify import measure_step

    loss, params, batch = _masked_blocks()
    mask, x = 4 * 256 * 256 * 4, 4 * 256 * 64 * 4
    an = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    # made by the first stage (no weights), read first by the first block
    assert list(carried_values(an.program, an.cost).values()) == [(0, 1, mask)]
    n = an.chain.n
    assert an.chain.boundary[2:n] == (x,) * (n - 2)  # a block's input alone crosses each cut
    assert an.chain.carried_fwd == (0,) + (mask,) * n
    assert an.chain.carried_bwd == (0, 0) + (mask,) * (n - 1)
    for s in an.chain.stages[2:n - 1]:  # a block under `nothing` keeps its input alone
        assert s.option(NOTHING).keep_bytes == x  # (the first block's is the batch's x)
    nothing_per_block = per_block_plans(an)[0]
    xla = measure_step(an.step.planned(plan_from_segments(an, nothing_per_block, 0, 0, params,
                                                          batch)), params, batch).peak_bytes
    predicted = an.predicted_peak(simulate(an.chain, nothing_per_block)[0])
    assert abs(predicted / xla - 1) <= 0.06, (predicted, xla)
    # the mask in every boundary and keep instead
    monkeypatch.setattr(planner_module, "carried_values", lambda program, cost: {})
    per_region = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    assert per_region.chain.boundary[2:n - 1] == (x + mask,) * (n - 3)  # not into the loss
    over = per_region.predicted_peak(simulate(per_region.chain, nothing_per_block)[0])
    assert over / xla - 1 > 0.5, (over, xla)


def _embedded_blocks(tied: bool, vocab: int = 4096, d: int = 64, batch: int = 4,
                     seq: int = 256, n_blocks: int = 4):
    """Plain JAX: an embedding table (4096 x 64, 1 MiB) read by a gather, blocks
    `h + tanh(h @ w)` (a block's input 256 KiB), and a 16-way head: its own weights, or
    the table itself (tied) read through a slice of it."""
    def loss(params, tokens, targets):
        h = params["emb"][tokens]
        for i in range(n_blocks):
            h = h + jnp.tanh(h @ params[f"w{i}"])
        head = params["emb"][:16].T if tied else params["head"]
        logp = jax.nn.log_softmax(h @ head)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    params = {"emb": jax.ShapeDtypeStruct((vocab, d), f32),
              **{f"w{i}": jax.ShapeDtypeStruct((d, d), f32) for i in range(n_blocks)}}
    if not tied:
        params["head"] = jax.ShapeDtypeStruct((d, 16), f32)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return loss, params, (tokens, tokens)


def test_a_gathered_table_s_gradient_lives_from_the_step_s_start(monkeypatch):
    """The gradient of a table read only by a gather (an embedding) is a scatter-add into
    zeros that XLA makes at the start of the step (docs/jax-facts.md, fact 12): the
    chain charges the table's bytes from the start to the gather's backward, not with
    that stage's own gradients. Each block checkpointed, `nothing` saved: XLA 6,529,536
    B; the model 6,529,028 B (-0.01%), and 5,726,212 B (-12.3%) with the table's
    gradient in the gather's backward only. A table read otherwise too (tied) is not
    charged so."""
    import remat_planner as rp
    from remat_planner import planner as planner_module
    from remat_planner.memory import table_gradient_bytes
    from remat_planner.planner import per_block_plans, plan_from_segments
    from remat_planner.verify import measure_step

    table = 4096 * 64 * 4
    loss, params, batch = _embedded_blocks(tied=False)
    an = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    n = an.chain.n
    assert table_gradient_bytes(an.program, an.cost) == (table,) + (0,) * (n - 1)
    assert an.chain.carried_fwd == (0,) + (table,) * n  # made before the first stage
    assert an.chain.carried_bwd == (0,) + (table,) * n  # until the gather's backward
    assert an.chain.stages[0].grad_bytes == 0  # not again with the stage's own
    nothing_per_block = per_block_plans(an)[0]
    xla = measure_step(an.step.planned(plan_from_segments(an, nothing_per_block, 0, 0, params,
                                                          batch)), params, batch).peak_bytes
    predicted = an.predicted_peak(simulate(an.chain, nothing_per_block)[0])
    assert abs(predicted / xla - 1) <= 0.01, (predicted, xla)
    monkeypatch.setattr(planner_module, "table_gradient_bytes",
                        lambda program, cost: (0,) * len(cost.stages))
    late = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    under = late.predicted_peak(simulate(late.chain, nothing_per_block)[0])
    assert xla - under >= 0.7 * table, (under, xla)
    monkeypatch.undo()
    loss, params, batch = _embedded_blocks(tied=True)
    tied = rp.analyze(loss, params, batch, optax.adamw(1e-3), measure_xla=False,
                      calibrate=False)
    assert not any(table_gradient_bytes(tied.program, tied.cost))


def test_the_loss_stage_is_profiled_returning_the_loss():
    """The step returns the loss, and XLA computes it after the head's backward, holding
    what it reads: one more logits-sized buffer than the head's forward and backward
    without it (docs/jax-facts.md, fact 13). The stage making the loss is profiled
    returning it: its backward workspace grows by about the logits (4 x 256 x 4096,
    16 MiB); no other stage's changes."""
    from remat_planner.memory import profile_stages

    vocab, logits = 4096, 4 * 256 * 4096 * 4

    def loss(params, tokens, targets):
        h = jnp.tanh(params["emb"][tokens] @ params["w"])
        logp = jax.nn.log_softmax(h @ params["head"])
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    params = {"emb": jax.ShapeDtypeStruct((vocab, 64), f32),
              "w": jax.ShapeDtypeStruct((64, 64), f32),
              "head": jax.ShapeDtypeStruct((64, vocab), f32)}
    tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    program = trace(loss, params, tokens, tokens)
    cost = build_cost_graph(program)
    held = profile_stages(program, cost)
    alone = profile_stages(program, cost, returns_loss=False)
    last = len(cost.stages) - 1
    grown = held.stages[last].bwd_temp_bytes - alone.stages[last].bwd_temp_bytes
    assert 0.95 * logits <= grown <= 1.05 * logits, (grown, logits)
    assert ([s.bwd_temp_bytes for s in held.stages[:last]]
            == [s.bwd_temp_bytes for s in alone.stages[:last]])


def test_a_wide_loss_head_is_one_stage_and_predicted_within_1pct():
    """A plain-JAX LM whose logits (4 x 256 x 4096, 16 MiB) outweigh a block's output
    (256 KiB) 64 times. The logits' matmul, the softmax and the loss are one stage
    (graph.merge_loss_tail): XLA fuses across cuts between them in the step. With the
    loss returned from that stage's profile (fact 13) and the table's gradient from the
    step's start (fact 12), the uncalibrated model is within 1% of XLA without remat
    and with each block checkpointed (measured -0.01% for both; with fact 12 alone,
    -36.5% and -36.9%)."""
    import remat_planner as rp
    from remat_planner.planner import per_block_plans, plan_from_segments
    from remat_planner.verify import measure_step

    vocab, d, n_blocks = 4096, 64, 4

    def loss(params, tokens, targets):
        h = params["emb"][tokens]
        for i in range(n_blocks):
            h = h + jnp.tanh(h @ params[f"w{i}"])
        logp = jax.nn.log_softmax(h @ params["head"])
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    params = {"emb": jax.ShapeDtypeStruct((vocab, d), f32),
              **{f"w{i}": jax.ShapeDtypeStruct((d, d), f32) for i in range(n_blocks)},
              "head": jax.ShapeDtypeStruct((d, vocab), f32)}
    tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    batch = (tokens, tokens)
    an = rp.analyze(loss, params, batch, optax.adamw(1e-3), calibrate=False)
    program, last = an.program, an.cost.stages[-1]
    names = [e.name for e in program.eqns[last.start:last.stop]]
    assert names[0] == "dot_general" and "exp" in names  # the matmul through the loss
    store = tuple(Segment(i, i + 1, STORE) for i in range(an.chain.n))
    for segs in (store, per_block_plans(an)[0]):
        xla = measure_step(an.step.planned(plan_from_segments(an, segs, 0, 0, params, batch)),
                           params, batch).peak_bytes
        predicted = an.predicted_peak(simulate(an.chain, segs)[0])
        assert abs(predicted / xla - 1) <= 0.01, (predicted, xla)


def test_a_pre_norm_block_under_a_dots_rule_runs_its_backward_stage_by_stage():
    """A whole block checkpointed under `dots_with_no_batch_dims` (what
    nn.remat(Block, policy=...) runs): in a pre-norm block the MLP's input is the saved
    attention projection added to the block's input, so XLA recomputes the attention's
    scores only for the attention's backward, after the MLP's (memory.span_is_stagewise).
    Charged as the block's stages' backwards in turn, the corpus `nn.SelfAttention` LM
    with every block so is predicted -0.06% of XLA (+8.29% as the block's forward and
    backward compiled together). Under `nothing` the MLP's input needs the attention
    recomputed (a matmul): the whole block's profile stays; under dropout's random bits
    too (the corpus GPT-2)."""
    import corpus
    import remat_planner as rp
    from remat_planner.planner import per_block_plans, plan_from_segments
    from remat_planner.verify import measure_step

    def flags(an):
        return {o.name: o.stagewise for _, _, p in an.chain.spans for o in p.options}

    m = corpus.get("selfattn_gpt")
    an = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, calibrate=False)
    assert flags(an)[DOTS_NO_BATCH] and not flags(an)[NOTHING]
    dnb_per_block = next(p for p in per_block_plans(an)
                         if any(s.option == DOTS_NO_BATCH and s.stop - s.start > 1 for s in p))
    xla = measure_step(an.step.planned(plan_from_segments(an, dnb_per_block, 0, 0, m.params,
                                                          m.batch)), m.params, m.batch).peak_bytes
    predicted = an.predicted_peak(simulate(an.chain, dnb_per_block)[0])
    assert abs(predicted / xla - 1) <= 0.01, (predicted, xla)
    gpt2 = corpus.get("hf_gpt2")
    an = rp.analyze(gpt2.loss_fn, gpt2.params, gpt2.batch, gpt2.optimizer, measure_xla=False,
                    calibrate=False)
    assert not any(flags(an).values())
