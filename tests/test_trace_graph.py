"""Stage 1 and 2: flat programs, module paths, FLOPs, stage cuts, fingerprints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest

from remat_planner.config import build_workload, load_config
from remat_planner.errors import UnsupportedModelError
from remat_planner.graph import build_cost_graph
from remat_planner.trace import eval_range, trace


@jax.custom_jvp
def softclip(x):
    return jnp.tanh(x)


softclip.defjvp(lambda primals, tangents: (softclip(primals[0]),
                                           tangents[0] * (1 - jnp.tanh(primals[0]) ** 2)))


@jax.jit
def inner(w, x):
    return jax.jit(lambda a: a @ w)(x) + 1.0


def loss_fn(params, x):
    h = inner(params["w"], x)
    return jnp.sum(softclip(h) ** 2)


ARGS = ({"w": jnp.ones((8, 8)) / 8}, jnp.arange(32.0).reshape(4, 8) / 32)


def replay(program, args):
    env = dict(zip(program.invars, jax.tree.leaves(args)))
    env.update(program.consts)
    eval_range(program, 0, len(program.eqns), env)
    return env[program.outvars[0]]


def test_jit_inlined_custom_jvp_kept_and_replay_exact():
    program = trace(loss_fn, *ARGS)
    names = [e.name for e in program.eqns]
    assert not {"jit", "pjit", "closed_call"} & set(names)
    assert sum("custom_jvp" in n for n in names) == 1
    np.testing.assert_allclose(replay(program, ARGS), loss_fn(*ARGS), rtol=1e-6)


def test_abstract_inputs_allocate_nothing():
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ARGS)
    assert trace(loss_fn, *abstract).fingerprint() == trace(loss_fn, *ARGS).fingerprint()


def test_fingerprint_tracks_shapes_and_dtypes():
    base = trace(loss_fn, *ARGS).fingerprint()
    bigger = trace(loss_fn, ARGS[0], jnp.zeros((5, 8))).fingerprint()
    half = trace(loss_fn, ARGS[0], ARGS[1].astype(jnp.bfloat16)).fingerprint()
    assert len({base, bigger, half}) == 3


@pytest.mark.parametrize("bad, match", [
    (lambda p, x: x @ p["w"], "one scalar"),
    (lambda p, x: (jnp.sum(x), jnp.sum(x)), "one scalar"),
])
def test_non_scalar_loss_rejected(bad, match):
    with pytest.raises(UnsupportedModelError, match=match):
        trace(bad, *ARGS)


def test_integer_only_params_rejected():
    with pytest.raises(UnsupportedModelError, match="floating"):
        trace(lambda p, x: jnp.sum(x * p), jnp.arange(3), jnp.ones(3))


def test_graph_nodes_and_exact_dot_flops():
    m, k, n = 16, 32, 8
    f = lambda w, x: jnp.sum(x @ w)
    program = trace(f, jnp.ones((k, n)), jnp.ones((m, k)))
    cost = build_cost_graph(program)
    g = cost.graph
    assert isinstance(g, nx.DiGraph)
    dots = [d for node, d in g.nodes(data=True) if node[0] == "eqn" and d["primitive"] == "dot_general"]
    assert len(dots) == 1 and dots[0]["flops"] == 2 * m * n * k
    vals = [d for node, d in g.nodes(data=True) if node[0] == "val"]
    assert any(d["bytes"] == m * n * 4 for d in vals)
    assert nx.is_directed_acyclic_graph(g)


@pytest.fixture(scope="module")
def tiny_program():
    wl = build_workload(load_config("configs/gpt2-tiny.yaml"))
    return wl, trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)


def test_flax_module_paths(tiny_program):
    _, program = tiny_program
    paths = {e.module_path for e in program.eqns}
    assert any(p.startswith("GPT2/h_0/attn") for p in paths)
    assert any(p.startswith("GPT2/h_3/mlp") for p in paths)


def test_stages_cut_at_blocks_and_attention_mlp(tiny_program):
    wl, program = tiny_program
    cost = build_cost_graph(program)
    stages = cost.stages
    assert stages[0].start == 0 and stages[-1].stop == len(program.eqns)
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    names = [s.name for s in stages]
    for i in range(1, 4):  # block 0's attention is merged with the (FLOP-free) embedding
        assert f"GPT2/h_{i}[ln_1,attn]" in names
    for i in range(4):
        assert f"GPT2/h_{i}[ln_2,mlp]" in names
    info = wl.info
    stream = info["batch_size"] * info["seq_len"] * 128 * 4  # residual stream, f32
    for s in stages[:-2]:
        assert cost.crossing[s.stop] == stream, s.name
