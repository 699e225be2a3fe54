"""apply.py through its public functions: a plan replayed gives the original loss and
gradients, with one `jax.checkpoint` per checkpointed segment and the kept values tagged
by name; a plan for other inputs is refused; the blocks a user would wrap in `nn.remat`;
grouped scans. A small MLP, gpt2-tiny traced once (a few seconds)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_planner as rp
import tiny_mlp
from remat_planner.apply import apply_plan, block_ranges, nested_scan
from remat_planner.baselines import POLICIES, builtin_loss
from remat_planner.step import Step
from remat_planner.config import build_workload, load_config
from remat_planner.errors import PlanMismatchError
from remat_planner.memory import value_name
from remat_planner.plan import DOTS_NO_BATCH, NOTHING, STORE, Segment
from remat_planner.planner import plan_from_segments
from remat_planner.trace import trace

DEPTH, WIDTH, ROWS = 4, 32, 16
CHECKPOINT = {"checkpoint", "remat", "remat2"}  # jax.checkpoint's primitive, by JAX version


_loss = tiny_mlp.loss
PARAMS, BATCH = tiny_mlp.abstract(DEPTH, WIDTH, ROWS)


@pytest.fixture(scope="module")
def mlp():
    """The analysis, a plan of it to replace segments in, and real inputs."""
    an = rp.analyze(_loss, PARAMS, BATCH, measure_xla=False, calibrate=False)
    base = rp.plan(_loss, PARAMS, BATCH, an.min_feasible_budget(), analysis=an, verify=False)
    keys = jax.random.split(jax.random.key(0), DEPTH + 1)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys[:DEPTH]]
    x = jax.random.normal(keys[-1], (ROWS, WIDTH))
    return an, base, params, (x,)


def _plans(an) -> dict[str, tuple[Segment, ...]]:
    n = an.chain.n
    stores = tuple(Segment(i, i + 1, STORE) for i in range(DEPTH, n))
    layers = range(DEPTH)
    dots = lambda i: an.chain.stages[i].option(DOTS_NO_BATCH)  # noqa: E731
    return {
        "store_all": tuple(Segment(i, i + 1, STORE) for i in range(n)),
        "nothing_each": tuple(Segment(i, i + 1, NOTHING) for i in layers) + stores,
        "dots_each": tuple(Segment(i, i + 1, DOTS_NO_BATCH, dots(i).saved)
                           for i in layers) + stores,
        # one region over the layers: pairs nested inside, each pair's layers stored
        "nested": (Segment(0, DEPTH, NOTHING, (), tuple(
            Segment(i, i + 2, NOTHING, (), (Segment(i, i + 1, STORE),
                                            Segment(i + 1, i + 2, STORE)))
            for i in range(0, DEPTH, 2))),) + stores,
    }


def _count_checkpoints(segments) -> int:
    return sum(s.is_checkpoint + _count_checkpoints(s.children) for s in segments)


def _primitives(jaxpr):
    """Every equation's primitive name and params, at any depth."""
    for e in jaxpr.eqns:
        yield e.primitive.name, e.params
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _primitives(sub)


@pytest.mark.parametrize("name", ["store_all", "nothing_each", "dots_each", "nested"])
def test_planned_loss_has_the_original_value_and_gradients(mlp, name):
    an, base, params, batch = mlp
    plan = dataclasses.replace(base, segments=_plans(an)[name])
    planned = apply_plan(plan, _loss)
    loss0, g0 = jax.jit(jax.value_and_grad(_loss))(params, *batch)
    loss1, g1 = jax.jit(jax.value_and_grad(planned))(params, *batch)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name, regions", [("store_all", 0), ("nothing_each", DEPTH),
                                           ("dots_each", DEPTH), ("nested", 3)])
def test_one_checkpoint_per_checkpointed_segment(mlp, name, regions):
    an, base, params, batch = mlp
    segments = _plans(an)[name]
    assert _count_checkpoints(segments) == regions
    plan = dataclasses.replace(base, segments=segments)
    jaxpr = jax.make_jaxpr(plan.apply(_loss))(params, *batch).jaxpr
    assert sum(p in CHECKPOINT for p, _ in _primitives(jaxpr)) == regions


def test_kept_values_are_tagged_by_name_and_kept_by_the_policy(mlp):
    """dots_each keeps each layer's matmul output: tagged with checkpoint_name, and what
    JAX saves for the backward is those four (16, 32) arrays (the argument aside)."""
    from jax._src.ad_checkpoint import saved_residuals  # as tests/test_explain.py reads it

    an, base, params, batch = mlp
    segments = _plans(an)["dots_each"]
    plan = dataclasses.replace(base, segments=segments)
    planned = plan.apply(_loss)
    jaxpr = jax.make_jaxpr(planned)(params, *batch).jaxpr
    tags = {p["name"] for prim, p in _primitives(jaxpr) if prim == "name"}
    want = {value_name(v) for s in segments for v in s.saved}
    assert len(want) == DEPTH and want <= tags
    saved = [tuple(a.shape) for a, where in saved_residuals(planned, params, *batch)
             if not where.startswith("from the argument")]
    assert saved.count((ROWS, WIDTH)) >= DEPTH


def test_a_plan_for_other_shapes_is_refused(mlp):
    an, base, params, batch = mlp
    planned = base.apply(_loss)
    wider = [jnp.ones((WIDTH + 1, WIDTH + 1)) for _ in range(DEPTH)]
    with pytest.raises(PlanMismatchError, match="re-plan"):
        planned(wider, jnp.ones((ROWS, WIDTH + 1)))


# ---------------------------------------------------------------------------------------
# Blocks and the built-in policies per block
# ---------------------------------------------------------------------------------------

def test_block_ranges_without_module_paths_are_the_repeated_layers():
    program = trace(_loss, PARAMS, *BATCH)
    ranges = block_ranges(program)
    assert len(ranges) == DEPTH
    assert all(hi > lo for lo, hi in ranges)
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # ordered, disjoint
    assert len({hi - lo for lo, hi in ranges}) == 1  # copies of one layer


def test_block_ranges_of_a_flax_model_are_its_numbered_blocks():
    wl = build_workload(load_config("configs/gpt2-tiny.yaml"))
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    ranges = block_ranges(program)
    assert len(ranges) == 4  # gpt2-tiny: 4 layers
    for k, (lo, hi) in enumerate(ranges):
        paths = {program.eqns[i].module_path for i in range(lo, hi)}
        assert all(f"h_{k}" in p.split("/") for p in paths), sorted(paths)[:3]
    assert len({hi - lo for lo, hi in ranges}) == 1


@pytest.mark.parametrize("policy", list(POLICIES))
def test_builtin_policy_per_block_keeps_the_gradients(mlp, policy):
    """Each block in its own jax.checkpoint(policy=...) over block_ranges: DEPTH regions,
    the original gradients."""
    _, _, params, batch = mlp
    loss = builtin_loss(policy, Step(_loss), PARAMS, BATCH)
    jaxpr = jax.make_jaxpr(loss)(params, *batch).jaxpr
    assert sum(p in CHECKPOINT for p, _ in _primitives(jaxpr)) == DEPTH
    g0 = jax.jit(jax.grad(_loss))(params, *batch)
    g1 = jax.jit(jax.grad(loss))(params, *batch)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------
# Grouped scans
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [(), (2,), (4,), (2, 2)])
def test_nested_scan_is_the_plain_scan(groups):
    """An 8-iteration scan as checkpointed groups (of 2, of 4, of 2 x 2): the same carry,
    outputs and gradients as jax.lax.scan; one checkpoint per level of grouping."""
    ws = jax.random.normal(jax.random.key(1), (8, WIDTH, WIDTH)) / np.sqrt(WIDTH)
    x = jax.random.normal(jax.random.key(2), (ROWS, WIDTH))

    def it(carry, xs):
        (h,), (w,) = carry, xs
        h = jnp.tanh(h @ w)
        return [h], [jnp.sum(h)]

    def run(ws, scan):
        (h,), (ys,) = scan(it, [x], [ws])
        return jnp.mean(h ** 2) + jnp.mean(ys)

    grouped = lambda f, c, xs: nested_scan(f, c, xs, groups)  # noqa: E731
    (c0,), (ys0,) = jax.lax.scan(it, [x], [ws])
    (c1,), (ys1,) = grouped(it, [x], [ws])
    assert ys1.shape == ys0.shape == (8,)
    np.testing.assert_allclose(c1, c0, rtol=1e-6)
    np.testing.assert_allclose(ys1, ys0, rtol=1e-6)
    g0 = jax.grad(run)(ws, jax.lax.scan)
    g1 = jax.grad(run)(ws, grouped)
    np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-7)
    jaxpr = jax.make_jaxpr(lambda w: run(w, grouped))(ws).jaxpr
    assert sum(p in CHECKPOINT for p, _ in _primitives(jaxpr)) == len(groups)


def _embed_then_layers(params, ids):
    """An embedding looked up with jnp.take (a nested jit in JAX's program), two tanh
    layers, each in a jit of its own, and a mean."""
    h = jnp.take(params["table"], ids, axis=0)
    for w in params["layers"]:
        h = jax.jit(lambda h, w: jnp.tanh(h @ w))(h, w)
    return jnp.mean(h ** 2)


def test_a_replayed_range_binds_the_nested_calls_it_holds_whole():
    """The replay of a stored range emits each nested call it holds whole as the user's
    program does (a `call` in the lowered step), not its equations one by one; the
    checkpointed regions replay flat, under each keep rule (the built-ins' comparison
    steps replay theirs the same way), with the gradients of the step as written."""
    from remat_planner.trace import Call, steps

    params = {"table": jax.ShapeDtypeStruct((64, 16), jnp.float32),
              "layers": [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 2}
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    program = trace(_embed_then_layers, params, ids)
    assert len(program.calls) >= 3
    whole = [s for s in steps(program, 0, len(program.eqns)) if isinstance(s, Call)]
    assert {c.params["name"] for c in whole} >= {"_take", "<lambda>"}

    an = rp.analyze(_embed_then_layers, params, ids, measure_xla=False, calibrate=False)
    n = an.chain.n
    user = jax.jit(_embed_then_layers).lower(params, ids).as_text()
    assert "call @_take" in user
    # the embedding stored, every later stage but the last checkpointed: under nothing,
    # and keeping the dots, which are made inside the layers' jits
    for rule in (NOTHING, DOTS_NO_BATCH):
        options = [{o.name: o for o in st.options} for st in an.chain.stages]
        segments = tuple(Segment(i, i + 1, rule, options[i][rule].saved)
                         if 0 < i < n - 1 and rule in options[i] else
                         Segment(i, i + 1, STORE if i in (0, n - 1) else NOTHING)
                         for i in range(n))
        assert rule == NOTHING or any(s.saved for s in segments)
        plan = plan_from_segments(an, segments, 0, 0, params, ids)
        planned = jax.jit(plan.apply(_embed_then_layers)).lower(params, ids).as_text()
        assert "call @_take" in planned, rule
        grads = [jax.grad(f)(real_params, real_ids) for f in (_embed_then_layers,
                                                              plan.apply(_embed_then_layers))]
        np.testing.assert_allclose(grads[0]["table"], grads[1]["table"], rtol=1e-5, atol=1e-6)


real_params = {"table": jnp.linspace(-1.0, 1.0, 64 * 16).reshape(64, 16),
               "layers": [jnp.eye(16) * 0.5 + 0.01, jnp.eye(16) * 0.3 - 0.02]}
real_ids = jnp.arange(8) * 7 % 64
