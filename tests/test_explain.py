"""`explain`: what each segment keeps, checked by hand and against JAX's own saved residuals
and traced checkpoint names on a small MLP; the CLI's explain.json and memory.png; the guide
example."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

import remat_planner as rp
from example_runner import run_example
from remat_planner import planner as pl
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.explain import explain, flax_names
from remat_planner.plan import DOTS_NO_BATCH, NOTHING, STORE, Segment

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain")
    code = main(["explain", str(ROOT / "configs/gpt2-tiny.yaml"), "--budget", "20MB",
                 "--out", str(out)])
    return code, out


def test_explain_json_and_png_written(explained):
    code, out = explained
    assert code == 0
    report = json.loads((out / "explain.json").read_text())
    assert report["segments"]
    assert report["measured_peak_bytes"] <= report["budget_bytes"]
    png = out / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# A plain JAX MLP small enough to work out by hand: DEPTH layers x <- tanh(x @ w) on a
# (ROWS, WIDTH) float32 batch, then mean(x ** 2).
DEPTH, WIDTH, ROWS = 4, 32, 16
ACT = ROWS * WIDTH * 4  # one activation, 2,048 bytes


def _mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


@pytest.fixture(scope="module")
def mlp():
    params = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * DEPTH
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
    an = rp.analyze(_mlp_loss, params, (x,), measure_xla=False, calibrate=False)
    real = ([jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) for i in range(DEPTH)],
            jax.random.normal(jax.random.key(DEPTH), (ROWS, WIDTH)))
    return an, params, (x,), real


def _plan(an, params, batch, option_of):
    n = an.chain.n
    segs = tuple(Segment(i, i + 1, *option_of(i, an.chain.stages[i])) for i in range(n))
    return pl.plan_from_segments(an, segs, 0, 0, params, batch)


def _jax_saved(plan, real) -> list[tuple[str, tuple]]:
    """What JAX's autodiff saves for the planned loss's backward, arguments left out:
    (primitive, shape) per residual, by jax's own saved_residuals."""
    from jax._src.ad_checkpoint import saved_residuals

    out = []
    for aval, where in saved_residuals(plan.apply(_mlp_loss), *real[0:1], real[1]):
        if not where.startswith("from the argument"):
            out.append((where.split()[2], tuple(aval.shape)))
    return sorted(out)


def _explained(ex) -> list[tuple[str, tuple]]:
    return sorted((t.primitive, t.shape) for s in ex.segments for t in s.kept)


def test_checkpointed_stages_keep_their_input_by_hand_and_by_jax(mlp):
    """Every layer checkpointed with nothing_saveable (the loss's stage stored): by hand,
    layer k >= 1 keeps its input, one (16, 32) float32 activation (2,048 B), and
    recomputes its forward, 2*16*32*32 + 16*32 = 33,280 FLOPs; layer 0's input is the
    batch, an argument the step holds anyway. JAX's saved_residuals of the planned loss
    lists the same tensors."""
    an, params, batch, real = mlp
    plan = _plan(an, params, batch, lambda i, s: (NOTHING,) if i < an.chain.n - 1 else (STORE,))
    ex = explain(an, plan)
    layers = ex.segments[:DEPTH]
    assert [s.saved_bytes for s in layers] == [0] + [ACT] * (DEPTH - 1)
    assert all(t.what == "input" and t.primitive == "tanh" and t.shape == (ROWS, WIDTH)
               for s in layers[1:] for t in s.kept)
    assert [s.recompute_flops for s in layers] == [2 * ROWS * WIDTH * WIDTH + ROWS * WIDTH] * DEPTH
    assert _explained(ex) == _jax_saved(plan, real)


def test_named_values_are_the_planned_jaxprs_checkpoint_names(mlp):
    """dots_with_no_batch_dims_saveable per layer: each layer keeps its matmul output,
    named in the replayed step (the `name` equations JAX traces); flax_names lists the
    same names and policies that exist in jax.checkpoint_policies."""
    an, params, batch, real = mlp

    def dots(i, stage):
        names = [o.name for o in stage.options]
        if DOTS_NO_BATCH in names:
            return DOTS_NO_BATCH, stage.option(DOTS_NO_BATCH).saved
        return (STORE,)

    plan = _plan(an, params, batch, dots)
    ex = explain(an, plan)
    named = [t for s in ex.segments for t in s.kept if t.what == "named value"]
    assert [(t.primitive, t.shape, t.nbytes) for t in named] == [
        ("dot_general", (ROWS, WIDTH), ACT)] * DEPTH

    def tagged(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "name":
                yield tuple(e.outvars[0].aval.shape)
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from tagged(sub)

    closed = jax.make_jaxpr(plan.apply(_mlp_loss))(*real[0:1], real[1])
    in_jaxpr = sorted(tagged(closed.jaxpr))
    entries = flax_names(an, plan)
    listed = sorted(tuple(t["shape"]) for e in entries if e["remat"] for t in e["checkpoint_names"])
    assert listed == in_jaxpr == [(ROWS, WIDTH)] * DEPTH
    for e in entries:
        if e["remat"]:  # policies JAX has, the exact one built from the listed names
            assert callable(eval(e["policy"], {"jax": jax}))
            assert callable(eval(e["exact_policy"], {"jax": jax}))


def test_stored_stages_list_what_jax_saves(mlp):
    """Every stage stored: a layer's tanh output is its own residual and the next layer's
    input, one array, listed once (4 tanh outputs, not 7)."""
    an, params, batch, real = mlp
    plan = _plan(an, params, batch, lambda i, s: (STORE,))
    assert _explained(explain(an, plan)) == _jax_saved(plan, real)


def test_explain_bad_budget_exits_2(capsys):
    assert main(["explain", str(ROOT / "configs/gpt2-tiny.yaml"), "--budget", "lots"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_guide_example_runs():
    result = run_example(steps=5)
    plan = result["plan"]
    assert plan.measured_peak_bytes <= result["budget"]
    assert result["losses"][-1] < result["losses"][0]
    assert any(e["remat"] for e in result["flax_names"])
