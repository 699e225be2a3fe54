"""verify.py through its public functions: `measure` reads XLA's own figures for the
step (checked against a compile of the same step written here by hand), its memo of
programs, `step_digest`, `make_step` and `train_step` on a small MLP (a few seconds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat_planner as rp
import tiny_mlp
from remat_planner.memory import compiler_options, tree_bytes
from remat_planner.verify import make_step, measure, step_digest, train_step

f32 = jnp.float32
DEPTH, WIDTH, ROWS = 3, 64, 32
AUX = (ROWS, WIDTH)


_loss = tiny_mlp.loss
_loss_aux = tiny_mlp.loss_with_aux  # the last activation as aux: ROWS x WIDTH f32
PARAMS, BATCH = tiny_mlp.abstract(DEPTH, WIDTH, ROWS)
OPT = optax.adam(1e-3)


def _by_hand(loss_fn, optimizer):
    """The donated optimizer step written here, compiled with the option that keeps
    remat: (memory_analysis, cost_analysis)."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(optimizer.init, PARAMS)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(PARAMS, opt_state, BATCH) \
        .compile(compiler_options())
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return compiled.memory_analysis(), cost


@pytest.fixture(scope="module")
def by_hand():
    return _by_hand(_loss, OPT)


def test_peak_is_argument_plus_output_minus_alias_plus_temp(by_hand):
    m = measure(_loss, PARAMS, BATCH, OPT)
    ma, _ = by_hand
    assert (m.argument_bytes, m.output_bytes, m.alias_bytes, m.temp_bytes) == (
        ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
        ma.temp_size_in_bytes)
    assert m.peak_bytes == (ma.argument_size_in_bytes + ma.output_size_in_bytes
                            - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    assert m.communication is None and m.compile_seconds > 0


def test_arguments_are_params_optimizer_state_and_batch(by_hand):
    """The step's arguments, exactly; params and state are donated, so XLA aliases them
    to the outputs (the new params and state)."""
    m = measure(_loss, PARAMS, BATCH, OPT)
    state = tree_bytes(jax.eval_shape(OPT.init, PARAMS))
    assert m.argument_bytes == tree_bytes(PARAMS) + state + tree_bytes(BATCH)
    assert 0 < m.alias_bytes <= tree_bytes(PARAMS) + state
    assert m.output_bytes >= tree_bytes(PARAMS) + state + 4  # and the f32 loss


def test_flops_are_xla_s_cost_analysis(by_hand):
    m = measure(_loss, PARAMS, BATCH, OPT)
    _, cost = by_hand
    assert m.flops == float(cost["flops"])
    # at least the forward and backward matmuls: 3 per layer but the first (no dx)
    assert m.flops >= (3 * DEPTH - 1) * 2 * ROWS * WIDTH * WIDTH


def test_without_optimizer_the_step_is_the_gradient():
    m = measure(_loss, PARAMS, BATCH)
    compiled = jax.jit(jax.grad(_loss)).lower(PARAMS, *BATCH).compile(compiler_options())
    ma = compiled.memory_analysis()
    assert m.peak_bytes == (ma.argument_size_in_bytes + ma.output_size_in_bytes
                            - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    assert m.argument_bytes == tree_bytes(PARAMS) + tree_bytes(BATCH)
    # the gradients (XLA:CPU adds a pointer table of a few bytes for a tuple result)
    assert tree_bytes(PARAMS) <= m.output_bytes <= tree_bytes(PARAMS) + 64
    assert m.alias_bytes == 0  # nothing donated


def test_aux_outputs_count_as_outputs():
    plain = measure(_loss, PARAMS, BATCH, OPT)
    aux = measure(_loss_aux, PARAMS, BATCH, OPT, has_aux=True)
    extra = aux.output_bytes - plain.output_bytes
    assert ROWS * WIDTH * 4 <= extra <= ROWS * WIDTH * 4 + 16  # the aux array (+ its pointer)


def test_a_batch_array_is_taken_as_a_one_tuple():
    one, tup = measure(_loss, PARAMS, BATCH[0], OPT), measure(_loss, PARAMS, BATCH, OPT)
    assert (one.peak_bytes, one.flops) == (tup.peak_bytes, tup.flops)
    assert step_digest(_loss, PARAMS, BATCH[0], OPT) == step_digest(_loss, PARAMS, BATCH, OPT)


# ---------------------------------------------------------------------------------------
# The memo of programs and step_digest
# ---------------------------------------------------------------------------------------

def test_step_digest_names_the_program_not_the_function():
    d = step_digest(_loss, PARAMS, BATCH, OPT)
    assert step_digest(lambda p, x: _loss(p, x), PARAMS, BATCH, OPT) == d
    assert step_digest(lambda p, x: 2.0 * _loss(p, x), PARAMS, BATCH, OPT) != d
    assert step_digest(_loss, PARAMS, BATCH) != d  # no optimizer: another step
    assert step_digest(_loss, PARAMS, BATCH, optax.sgd(0.1)) != d


def test_measuring_the_same_program_twice_compiles_once():
    programs: dict = {}
    first = measure(_loss, PARAMS, BATCH, OPT, programs=programs)
    assert list(programs) == [step_digest(_loss, PARAMS, BATCH, OPT)]
    assert programs[step_digest(_loss, PARAMS, BATCH, OPT)] is first
    # Another function lowering to the same program: the entry, not a new compile.
    again = measure(lambda p, x: _loss(p, x), PARAMS, BATCH, OPT, programs=programs)
    assert again is first and len(programs) == 1
    other = measure(lambda p, x: 2.0 * _loss(p, x), PARAMS, BATCH, OPT, programs=programs)
    assert other is not first and len(programs) == 2
    # Without the dict every call compiles: an equal measurement, but a new one.
    fresh = measure(_loss, PARAMS, BATCH, OPT)
    assert fresh is not first and fresh.peak_bytes == first.peak_bytes


# ---------------------------------------------------------------------------------------
# Scans: FLOPs counted per iteration
# ---------------------------------------------------------------------------------------

def _scan_loss(params, x):
    def body(h, w):
        return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(body, x, params)
    return jnp.mean(h ** 2)


def test_a_scanned_step_counts_every_iteration():
    """XLA's cost analysis counts a loop body once; measure counts it per iteration, so
    twice the layers is about twice the FLOPs."""
    flops = {}
    for n in (4, 8):
        params = jax.ShapeDtypeStruct((n, WIDTH, WIDTH), f32)
        flops[n] = measure(_scan_loss, params, BATCH, optax.sgd(0.1)).flops
    assert 1.8 < flops[8] / flops[4] < 2.1
    assert flops[4] >= 4 * (3 * 2 * ROWS * WIDTH * WIDTH)


# ---------------------------------------------------------------------------------------
# make_step and train_step
# ---------------------------------------------------------------------------------------

def _real():
    keys = jax.random.split(jax.random.key(0), DEPTH + 1)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[:DEPTH]]
    return params, (jax.random.normal(keys[-1], (ROWS, WIDTH)),)


def test_make_step_is_value_and_grad_then_the_update():
    params, batch = _real()
    state = OPT.init(params)
    new_params, new_state, loss = jax.jit(make_step(_loss, OPT))(params, state, batch)
    grads = jax.grad(_loss)(params, *batch)
    updates, want_state = OPT.update(grads, state, params)
    want = optax.apply_updates(params, updates)
    np.testing.assert_allclose(loss, _loss(params, *batch), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(new_state[0].count) == int(want_state[0].count) == 1
    g = jax.jit(make_step(_loss))(params, batch)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_train_step_with_a_plan_trains_like_the_step_as_written():
    """One step with a plan that checkpoints every layer: the same loss and new params
    as without a plan (gradients are the original ones)."""
    an = rp.analyze(_loss, PARAMS, BATCH, OPT, measure_xla=False, calibrate=False)
    plan = rp.plan(_loss, PARAMS, BATCH, an.min_feasible_budget(), OPT, analysis=an,
                   verify=False)
    assert any(s.is_checkpoint for s in plan.segments)
    params, batch = _real()
    copy = lambda t: jax.tree.map(jnp.array, t)  # noqa: E731 (inputs are donated)
    out_plain = train_step(_loss, OPT)(copy(params), OPT.init(params), batch)
    out_plan = train_step(_loss, OPT, plan)(copy(params), OPT.init(params), batch)
    np.testing.assert_allclose(out_plan[2], out_plain[2], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out_plan[0]), jax.tree.leaves(out_plain[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
