"""Primitives the planner does not look inside (while_loop, cond, scan, custom_vjp, Pallas
kernels, host callbacks) are single opaque equations: a segment keeps or recomputes each
one whole, the planner plans around it within budget, and gradients stay exact.

Each test puts one such primitive in the middle of a small MLP and checks:
- the traced program holds it as one equation (not inlined);
- in every plan's replayed forward it appears exactly once, outside any checkpoint when
  its stage is stored, inside one when checkpointed (kept or recomputed whole, never cut);
- a region around it recomputes it once more, whole (one more occurrence in the gradient
  computation than the same plan without the region);
- the planner's plan at a budget between the smallest feasible and the no-remat peak is
  within budget by XLA, and every plan gives the unplanned loss and gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pallas

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.memory import compiler_options
from remat_planner.plan import NOTHING, STORE, Segment

ROWS, WIDTH = 16, 32
CHECKPOINT_PRIMITIVES = ("checkpoint", "remat", "remat2")


def _mlp(ws, x, middle):
    h = jnp.tanh(x @ ws[0])
    h = jnp.tanh(h @ ws[1])
    h = middle(h, ws[3])
    h = jnp.tanh(h @ ws[2])
    return jnp.mean(h ** 2)


# -- one middle layer per primitive family --------------------------------------------------

def _spectral_norm(h, w):
    """Power iteration to a tolerance (a real while_loop, trip count unknown at trace
    time) on the stopped-gradient weight, as spectral normalisation does."""
    ws = jax.lax.stop_gradient(w)

    def cond(c):
        _, s, s_old, i = c
        return (jnp.abs(s - s_old) > 1e-4 * s) & (i < 50)

    def body(c):
        v, s, _, i = c
        u = ws @ v
        u = u / jnp.linalg.norm(u)
        v = ws.T @ u
        s_new = jnp.linalg.norm(v)
        return v / s_new, s_new, s, i + 1

    v0 = jnp.ones(w.shape[1]) / np.sqrt(w.shape[1])
    _, sigma, _, _ = jax.lax.while_loop(cond, body, (v0, jnp.float32(1), jnp.float32(0), 0))
    return jnp.tanh(h @ (w / sigma))


def _branch(h, w):
    return jax.lax.cond(jnp.mean(h) > 0, lambda a: jnp.tanh(a @ w), lambda a: jnp.sin(a @ w.T), h)


def _recurrence(h, w):
    """A cumulative op over the rows: c_t = tanh(c_{t-1} @ w + h_t)."""
    def step(c, row):
        c = jnp.tanh(c @ w + row)
        return c, c
    return jax.lax.scan(step, jnp.zeros(h.shape[1]), h)[1]


@jax.custom_vjp
def _soft_clip(x):
    return 2.0 * jnp.tanh(x)


_soft_clip.defvjp(lambda x: (_soft_clip(x), x),
                  lambda x, g: (2.0 * g * (1.0 - jnp.tanh(x) ** 2),))


def _custom(h, w):
    return _soft_clip(h @ w)


def _mask_kernel(x_ref, o_ref):
    o_ref[...] = jnp.where(x_ref[...] > 0, 1.0, 0.5).astype(o_ref.dtype)


def _pallas_gate(h, w):
    """A Pallas kernel (interpreted on CPU) computing a gate from stopped activations."""
    gate = pallas.pallas_call(_mask_kernel, out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
                              interpret=True)(jax.lax.stop_gradient(h))
    return jnp.tanh((h * gate) @ w)


def _host_gate(h, w):
    """The same gate computed on the host by a foreign (numpy) function."""
    gate = jax.pure_callback(lambda a: np.where(a > 0, 1.0, 0.5).astype(a.dtype),
                             jax.ShapeDtypeStruct(h.shape, h.dtype), jax.lax.stop_gradient(h))
    return jnp.tanh((h * gate) @ w)


# -- checks ---------------------------------------------------------------------------------

def _occurrences(jaxpr, primitive: str, depth: int = 0) -> list[int]:
    """Checkpoint nesting depth of each `primitive` equation, looking inside checkpoint
    regions (and calls) but not inside other primitives."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == primitive:
            found.append(depth)
            continue
        inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if inner is not None and e.primitive.name in (*CHECKPOINT_PRIMITIVES, "pjit", "jit",
                                                      "closed_call"):
            inner = getattr(inner, "jaxpr", inner)
            found += _occurrences(inner, primitive,
                                  depth + (e.primitive.name in CHECKPOINT_PRIMITIVES))
    return found


def _count_all(jaxpr, primitive: str) -> int:
    """Every `primitive` equation anywhere in the jaxpr, sub-jaxprs included."""
    count = 0
    for e in jaxpr.eqns:
        count += e.primitive.name == primitive
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += _count_all(sub, primitive)
    return count


def _stage_depth(segments, stage: int, depth: int = 0) -> int:
    for s in segments:
        if s.start <= stage < s.stop:
            if s.children:
                return _stage_depth(s.children, stage, depth + 1)
            return depth + (s.option != STORE)
    raise AssertionError(stage)


def _check_family(middle, primitive: str) -> None:
    loss_fn = functools.partial(_mlp, middle=middle)
    keys = jax.random.split(jax.random.key(0), 5)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / 6 for k in keys[:4]]
    x = jax.random.normal(keys[4], (ROWS, WIDTH))
    an = pl.analyze(loss_fn, ws, (x,), measure_xla=False, calibrate=False)

    # One opaque equation in the traced program, inside one stage.
    where = [i for i, e in enumerate(an.program.eqns) if e.name == primitive]
    assert len(where) == 1, [e.name for e in an.program.eqns]
    (stage,) = [k for k, s in enumerate(an.cost.stages) if s.start <= where[0] < s.stop]
    n = an.chain.n
    assert n >= 3

    budget = (an.min_feasible_budget() + an.noremat_predicted_peak) // 2
    planned = rp.plan(loss_fn, ws, (x,), budget, analysis=an)
    assert planned.measured_peak_bytes <= budget
    leaves = tuple(Segment(i, i + 1, NOTHING) for i in range(n))
    plans = {
        "store": tuple(Segment(i, i + 1, STORE) for i in range(n)),
        "nothing": leaves,
        "region": (Segment(0, n, NOTHING, (), leaves),),
        "planner": planned.segments,
    }
    grad = lambda f: jax.jit(jax.value_and_grad(f), compiler_options=compiler_options())
    want_loss, want_grads = grad(loss_fn)(ws, x)
    in_grad = {}
    for name, segments in plans.items():
        plan = pl.plan_from_segments(an, segments, 0, 0, ws, (x,))
        f = plan.apply(loss_fn)
        # Kept or recomputed whole: once in the replayed forward, at its stage's depth.
        assert _occurrences(jax.make_jaxpr(f)(ws, x).jaxpr, primitive) == [
            _stage_depth(segments, stage)], name
        in_grad[name] = _count_all(jax.make_jaxpr(jax.grad(f))(ws, x).jaxpr, primitive)
        loss, grads = grad(f)(ws, x)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        for a, b in zip(grads, want_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The region around everything re-runs the opaque equation once more, whole.
    assert in_grad["region"] == in_grad["nothing"] + 1, in_grad
    assert in_grad["nothing"] >= in_grad["store"] >= 1, in_grad


def test_while_loop_is_opaque():
    _check_family(_spectral_norm, "while")


def test_cond_is_opaque():
    _check_family(_branch, "cond")


def test_scan_is_opaque():
    _check_family(_recurrence, "scan")


def test_custom_vjp_is_opaque():
    _check_family(_custom, "custom_vjp_call")


def test_pallas_call_is_opaque():
    _check_family(_pallas_gate, "pallas_call")


def test_host_callback_is_opaque():
    _check_family(_host_gate, "pure_callback")


@pytest.mark.parametrize("middle, primitive", [(_recurrence, "scan"), (_branch, "cond")],
                         ids=["scan", "cond"])
def test_opaque_flops_are_counted(middle, primitive):
    """The cost model sees the work inside: a scan costs its length times its body."""
    loss_fn = functools.partial(_mlp, middle=middle)
    ws = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * 4
    an = pl.analyze(loss_fn, ws, (jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32),),
                    measure_xla=False, calibrate=False)
    (i,) = [i for i, e in enumerate(an.program.eqns) if e.name == primitive]
    flops = an.cost.graph.nodes[("eqn", i)]["flops"]
    per_row = 2 * WIDTH * WIDTH  # the dot of one row (or of each row, for cond)
    assert flops >= ROWS * per_row
