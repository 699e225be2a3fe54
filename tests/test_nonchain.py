"""Models that are not chains: ResNet (BatchNorm state, residual branches), diffusion U-Net
(long skip connections), and a GPT written with flax.nnx.

Per model: the gradients (and BatchNorm statistics) of a hand-made nested plan equal the
unplanned ones. Plus the stage finder on skip connections and the has_aux path (trace,
apply, train_step). The closed-loop plans of the same configs are tests/test_sweep.py's
(XLA's peak within ten budgets) and tests/test_reliability.py's (exact gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat_planner as rp
from remat_planner import planner as pl
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.errors import UnsupportedModelError
from remat_planner.graph import build_cost_graph, definitions, last_uses
from remat_planner.memory import cut_overlap, region_inputs
from remat_planner.plan import NOTHING, STORE, Segment
from remat_planner.trace import trace

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow

MODELS = ["resnet", "unet", "nnx"]
CONFIGS = {"resnet": "configs/resnet-tiny.yaml", "unet": "configs/unet-tiny.yaml",
           "nnx": "configs/nnx-tiny.yaml"}


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """Workload, optimizer, the stages (an analysis without XLA), real params and batch,
    and a hand-made nested plan: a region over all but the last stage, each stage inside
    checkpointed (the closed-loop plans of these configs are checked at ten budgets by
    test_sweep.py and for exact gradients by test_reliability.py)."""
    cfg = load_config(CONFIGS[request.param])
    wl = build_workload(cfg)
    opt = make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, has_aux=wl.has_aux,
                    measure_xla=False, calibrate=False)
    key = jax.random.key(0)
    params, batch = wl.init_params(key), wl.synthetic_batch(jax.random.fold_in(key, 1))
    n = an.chain.n
    nested = (Segment(0, n - 1, NOTHING, (), tuple(Segment(i, i + 1, NOTHING) for i in range(n - 1))),
              Segment(n - 1, n, STORE))
    handmade = pl.plan_from_segments(an, nested, 0, 0, params, batch)
    return request.param, wl, opt, an, handmade, params, batch


def _assert_tree_close(got, want, rtol=1e-5):
    """Leafwise equal to rtol, elements near zero measured against the leaf's largest
    magnitude (BatchNorm's batch sums reassociate differently under another fusion)."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(got_leaves, want_leaves):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=rtol * float(np.abs(b).max()))


@pytest.mark.slow
def test_nested_plan_gradients_and_aux_equal_unplanned(model):
    """The hand-made nested plan: loss, gradients and (ResNet) new batch statistics equal
    the unplanned ones."""
    name, wl, _, an, handmade, params, batch = model
    assert an.program.has_aux == (name == "resnet") and an.chain.n >= 3
    want = jax.value_and_grad(wl.loss_fn, has_aux=wl.has_aux)(params, *batch)
    got = jax.jit(jax.value_and_grad(handmade.apply(wl.loss_fn), has_aux=wl.has_aux))(params, *batch)
    _assert_tree_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet"], indirect=True)  # BatchNorm state is the ResNet's
def test_resnet_train_step_carries_batch_stats(model):
    """train_step with has_aux returns the new BatchNorm statistics; the planned step's
    equal the unplanned step's, and Workload.update_batch feeds them to the next step.
    (Parametrized with the ResNet alone: with every model it skipped the U-Net and nnx.)"""
    name, wl, opt, _, handmade, params, batch = model
    assert name == "resnet"
    results = []
    for plan in (None, handmade):
        step = rp.train_step(wl.loss_fn, opt, plan, has_aux=True)
        p, s, b = jax.tree.map(jnp.copy, params), opt.init(params), batch
        for _ in range(2):
            p, s, loss, stats = step(p, s, b)
            b = wl.update_batch(b, stats)
        results.append((p, loss, b[-1]))
    _assert_tree_close(results[1], results[0])
    initial = batch[-1]
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(results[0][2]), jax.tree.leaves(initial))]
    assert all(moved)  # every running mean and variance was updated


def test_unet_stage_finder_cuts_between_skip_connections():
    """The U-Net's down-path features cross every middle cut: the one-stream rule alone
    left 4 stages; the finder must cut at block boundaries anyway, and every value
    crossing a cut (skips included) must be counted in that cut's boundary bytes, while
    a checkpointed region keeps only the crossing values it uses."""
    wl = build_workload(load_config(CONFIGS["unet"]))
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    cost = build_cost_graph(program)
    stages = cost.stages
    assert len(stages) >= 12
    last, defs = last_uses(program), definitions(program)
    # conv_in's output is the first skip: used by the first down block and by the last
    # up block's concatenation, so it crosses every cut in between.
    conv_in = max(i for i, e in enumerate(program.eqns) if e.module_path.endswith("conv_in"))
    skip = program.eqns[conv_in].outvars[0]
    crossed = [k for k in range(1, len(stages)) if defs[skip] < stages[k].start <= last[skip]]
    assert len(crossed) >= len(stages) // 2
    boundary = [0] + [cost.boundary_bytes(k) for k in range(1, len(stages))] + [0]
    inputs = region_inputs(program, cost, boundary)
    overlap = cut_overlap(program, cost)
    passed_over = 0
    for k in range(1, len(stages)):
        pos = stages[k].start
        live = [v for v, d in defs.items()
                if d < pos <= last.get(v, -1) and v not in program.free]
        assert boundary[k] == sum(program.nbytes(v) for v in live)
        assert (skip in live) == (k in crossed)
        if k in crossed and k + 1 in crossed:
            # The skip counts once, not twice, in a step over two of the cuts it crosses ...
            assert overlap[k][k + 1] >= program.nbytes(skip)
            uses = [e for e in program.eqns[stages[k].start:stages[k].stop] if skip in e.invars]
            if not uses:
                # ... and a checkpointed stage it passes over does not keep it.
                assert inputs[k][k + 1] <= boundary[k] - program.nbytes(skip)
                passed_over += 1
    assert passed_over >= len(stages) // 3


def test_gpt2_stages_unchanged_by_skip_rule():
    """Chains keep the one-stream cuts: GPT-2 small has 26 stages, two per block, the
    embedding lookups and the head with the loss."""
    cfg = load_config("configs/gpt2-small.yaml")  # unrolled: the config scans its blocks
    wl = build_workload(cfg.model_copy(update={"model": {**cfg.model, "scan_layers": False}}))
    stages = build_cost_graph(trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)).stages
    assert len(stages) == 26
    assert [s.name for s in stages[:4]] == ["GPT2[wte,wpe]", "GPT2/h_0[ln_1,attn]",
                                            "GPT2/h_0[ln_2,mlp]", "GPT2/h_1[ln_1,attn]"]


def test_has_aux_trace_and_errors():
    """(loss, aux) is traced with aux as extra outputs; without has_aux it is refused in
    one line, and a has_aux function must return a pair."""
    def loss_fn(w, x):
        h = jnp.tanh(x @ w)
        return jnp.mean(h ** 2), {"mean": jnp.mean(h, axis=0), "passed": x}

    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    program = trace(loss_fn, w, x, has_aux=True)
    assert program.has_aux and len(program.outvars) == 3
    # x is an argument passed through: not an aux activation; the mean is.
    assert len(program.aux_outputs) == 1
    with pytest.raises(UnsupportedModelError, match="one scalar"):
        trace(loss_fn, w, x)
    with pytest.raises(UnsupportedModelError, match=r"\(loss, aux\)"):
        trace(lambda w, x: jnp.sum(x @ w), w, x, has_aux=True)
    assert trace(loss_fn, w, x, has_aux=True).fingerprint() != trace(
        lambda w, x: loss_fn(w, x)[0], w, x).fingerprint()
