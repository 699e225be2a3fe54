"""Stages 1 and 2: flat programs, module paths, FLOPs, stage cuts, fingerprints."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
import yaml

from remat_planner.config import build_workload, load_config
from remat_planner.errors import UnsupportedModelError
from remat_planner.graph import build_cost_graph, eqn_flops
from remat_planner.trace import Literal, eval_range, trace

TINY = Path(__file__).resolve().parents[1] / "configs" / "gpt2-tiny.yaml"
CALLS = {"jit", "pjit", "closed_call", "core_call"}


# ------------------------------------------------------------------------------------------
# A small hand-written loss: nested jits (one fed a literal), a custom_jvp of our own,
# jax.nn.relu (a custom_jvp around a jit) and a captured constant array.
# ------------------------------------------------------------------------------------------

@jax.custom_jvp
def softclip(x):
    return jnp.tanh(x)


@softclip.defjvp
def _softclip_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softclip(x), t * (1 - jnp.tanh(x) ** 2)


SCALE = jnp.linspace(0.5, 1.5, 8)  # closed over: becomes a constant of the program


@jax.jit
def inner(w, x):
    return jax.jit(lambda a, c: a @ w + c)(x, 0.25)


def loss_fn(params, x):
    h = inner(params["w"], x) * SCALE
    return jnp.sum(softclip(h) ** 2) + jnp.mean(jax.nn.relu(h - params["b"]))


def make_args(batch=4, dtype=jnp.float32):
    key_w, key_b, key_x = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(key_w, (8, 8)), "b": jax.random.normal(key_b, (8,))}
    return params, jax.random.normal(key_x, (batch, 8)).astype(dtype)


def replay(program, params, *batch):
    """Evaluate every equation of `program` on real arrays; return the loss."""
    env = dict(zip(program.invars, jax.tree.leaves((params, *batch)), strict=True))
    env.update(program.consts)
    eval_range(program, 0, len(program.eqns), env)
    (out,) = program.outvars
    return out.val if isinstance(out, Literal) else env[out]


def test_nested_jits_are_inlined():
    program = trace(loss_fn, *make_args())
    names = [e.name for e in program.eqns]
    assert not CALLS & set(names), names
    assert "dot_general" in names
    # The un-inlined jaxpr did have nested calls: the test is about something.
    top = {e.primitive.name for e in jax.make_jaxpr(loss_fn)(*make_args()).eqns}
    assert top & CALLS


def test_custom_jvp_functions_stay_single_equations():
    program = trace(loss_fn, *make_args())
    custom = [e for e in program.eqns if "custom_jvp" in e.name]
    assert len(custom) == 2  # softclip and jax.nn.relu, each one equation, bodies intact
    assert {e.params["call_jaxpr"].jaxpr.eqns[0].primitive.name for e in custom} >= {"tanh"}


def test_captured_constants_are_program_constants():
    program = trace(loss_fn, *make_args())
    assert any(np.shape(v) == SCALE.shape and np.allclose(v, SCALE)
               for v in program.consts.values())
    assert not set(program.consts) & set(program.invars)


@pytest.mark.parametrize("batch", [1, 4, 7])
def test_replaying_all_equations_gives_the_loss(batch):
    args = make_args(batch)
    program = trace(loss_fn, *args)
    np.testing.assert_allclose(replay(program, *args), loss_fn(*args), rtol=1e-6)


def test_replay_in_two_halves_matches_one_pass():
    args = make_args()
    program = trace(loss_fn, *args)
    env = dict(zip(program.invars, jax.tree.leaves(args)))
    env.update(program.consts)
    mid = len(program.eqns) // 2
    eval_range(program, 0, mid, env)
    assert program.outvars[0] not in env
    eval_range(program, mid, len(program.eqns), env)
    np.testing.assert_allclose(env[program.outvars[0]], loss_fn(*args), rtol=1e-6)


def test_program_layout():
    params, x = make_args()
    program = trace(loss_fn, params, x)
    assert program.n_param_leaves == 2 and len(program.invars) == 3
    assert program.nbytes(program.invars[-1]) == x.size * 4
    assert program.in_tree == jax.tree.structure((params, x))


# ------------------------------------------------------------------------------------------
# Unsupported losses and params
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    lambda p, x: x @ p["w"],                          # a matrix
    lambda p, x: jnp.sum(x @ p["w"], axis=0),         # a vector
    lambda p, x: (jnp.sum(x), jnp.sum(x)),            # two scalars
    lambda p, x: jnp.sum(x @ p["w"]).astype(jnp.int32),  # an integer scalar
], ids=["matrix", "vector", "tuple", "integer"])
def test_non_scalar_or_non_float_loss_rejected(bad):
    with pytest.raises(UnsupportedModelError, match="scalar"):
        trace(bad, *make_args())


@pytest.mark.parametrize("params", [
    jnp.arange(3),
    {"a": jnp.arange(3), "b": jnp.ones(3, dtype=bool)},
    {},
], ids=["int-array", "int-and-bool", "no-leaves"])
def test_params_without_float_leaves_rejected(params):
    def loss(p, x):
        return jnp.sum(x) + sum(jnp.sum(l) for l in jax.tree.leaves(p))
    with pytest.raises(UnsupportedModelError, match="floating"):
        trace(loss, params, jnp.ones(3))


# ------------------------------------------------------------------------------------------
# Cost graph
# ------------------------------------------------------------------------------------------

MATMULS = {
    # name: (lhs shape, rhs shape, einsum, exact FLOPs)
    "mk,kn": ((16, 32), (32, 8), "mk,kn->mn", 2 * 16 * 8 * 32),
    "batched": ((3, 16, 32), (3, 32, 8), "bmk,bkn->bmn", 2 * 3 * 16 * 8 * 32),
    "vector": ((32,), (32, 8), "k,kn->n", 2 * 8 * 32),
    "two-contractions": ((4, 5, 6), (5, 6, 7), "abc,bcd->ad", 2 * 4 * 7 * 5 * 6),
}


@pytest.mark.parametrize("lhs, rhs, spec, flops", MATMULS.values(), ids=MATMULS.keys())
def test_dot_general_flops_are_exact(lhs, rhs, spec, flops):
    program = trace(lambda w, x: jnp.sum(jnp.einsum(spec, x, w)), jnp.ones(rhs), jnp.ones(lhs))
    cost = build_cost_graph(program)
    dots = [(i, e) for i, e in enumerate(program.eqns) if e.name == "dot_general"]
    assert len(dots) == 1
    i, e = dots[0]
    assert cost.graph.nodes[("eqn", i)]["flops"] == flops
    in_avals = [program.avals[v] for v in e.invars]
    out_avals = [program.avals[v] for v in e.outvars]
    assert eqn_flops("dot_general", e.params, in_avals, out_avals) == flops
    assert cost.total_flops == sum(d["flops"] for n, d in cost.graph.nodes(data=True)
                                   if n[0] == "eqn")


@pytest.mark.parametrize("wrap", ["custom_jvp", "custom_vjp"])
def test_flops_of_custom_derivative_calls_count_their_body(wrap):
    if wrap == "custom_jvp":
        mm = jax.custom_jvp(lambda a, b: a @ b)
        mm.defjvp(lambda p, t: (p[0] @ p[1], t[0] @ p[1] + p[0] @ t[1]))
    else:
        mm = jax.custom_vjp(lambda a, b: a @ b)
        mm.defvjp(lambda a, b: (a @ b, (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    program = trace(lambda w, x: jnp.sum(mm(x, w)), jnp.ones((32, 8)), jnp.ones((16, 32)))
    cost = build_cost_graph(program)
    calls = [i for i, e in enumerate(program.eqns) if wrap in e.name]
    assert len(calls) == 1
    assert cost.graph.nodes[("eqn", calls[0])]["flops"] == 2 * 16 * 8 * 32


def test_graph_is_a_bipartite_dag_of_equations_and_values():
    m, k, n = 16, 32, 8
    program = trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((k, n)), jnp.ones((m, k)))
    g = build_cost_graph(program).graph
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    eqn_nodes = {node for node in g if node[0] == "eqn"}
    val_nodes = {node for node in g if node[0] == "val"}
    assert eqn_nodes | val_nodes == set(g)
    assert eqn_nodes == {("eqn", i) for i in range(len(program.eqns))}
    assert val_nodes == {("val", v) for v in program.avals}
    assert all({a[0], b[0]} == {"eqn", "val"} for a, b in g.edges)
    for i, e in enumerate(program.eqns):
        assert {v for _, v in g.predecessors(("eqn", i))} == {v for v in e.invars
                                                              if isinstance(v, int)}
        assert [v for _, v in g.successors(("eqn", i))] == list(e.outvars)
    (dot,) = [i for i, e in enumerate(program.eqns) if e.name == "dot_general"]
    (out,) = program.eqns[dot].outvars
    attrs = g.nodes[("val", out)]
    assert attrs["bytes"] == m * n * 4 and attrs["shape"] == (m, n)
    assert attrs["dtype"] == "float32" and not attrs["free"]
    assert g.nodes[("val", program.invars[0])]["param"] is True
    assert g.nodes[("val", program.invars[1])]["param"] is False


def test_typed_prng_keys_are_costed_or_rejected_cleanly():
    def loss(p, x, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape)
        return jnp.sum(jnp.where(keep, x, 0.0) @ p["w"])

    program = trace(loss, {"w": jnp.ones((32, 8))}, jnp.ones((16, 32)), jax.random.key(0))
    try:
        cost = build_cost_graph(program)
    except UnsupportedModelError:
        return  # a one-line, typed refusal is fine too
    key_bytes = cost.graph.nodes[("val", program.invars[-1])]["bytes"]
    assert key_bytes == jax.random.key_data(jax.random.key(0)).nbytes


# ------------------------------------------------------------------------------------------
# gpt2-tiny: module paths and stages
# ------------------------------------------------------------------------------------------

def _tiny(tmp_path_factory, dtype="float32", batch_size=None, seq_len=None):
    data = yaml.safe_load(TINY.read_text())
    data["model"]["dtype"] = dtype
    path = tmp_path_factory.mktemp("cfg") / f"tiny-{dtype}.yaml"
    path.write_text(yaml.safe_dump(data))
    wl = build_workload(load_config(path, batch_size=batch_size, seq_len=seq_len))
    return wl, trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)


@pytest.fixture(scope="module", params=[("float32", None, None), ("bfloat16", 2, 32)],
                ids=["f32-4x64", "bf16-2x32"])
def tiny(request, tmp_path_factory):
    return _tiny(tmp_path_factory, *request.param)


def _first(program, prefix: str) -> int:
    return next(i for i, e in enumerate(program.eqns)
                if e.module_path == prefix or e.module_path.startswith(prefix + "/"))


def test_equations_carry_flax_module_paths(tiny):
    wl, program = tiny
    paths = {e.module_path for e in program.eqns}
    assert all(p == "" or p.startswith("GPT2") for p in paths), paths
    for i in range(wl.info["n_layer"]):
        for sub in ("ln_1", "attn", "ln_2", "mlp"):
            assert any(p.startswith(f"GPT2/h_{i}/{sub}") for p in paths), (i, sub)
        # The projections are the matmuls of their modules.
        for dense in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            assert any(e.name == "dot_general" and e.module_path == f"GPT2/h_{i}/{dense}"
                       for e in program.eqns), (i, dense)
    assert not any(f"GPT2/h_{wl.info['n_layer']}" in p for p in paths)


def test_stages_tile_the_program(tiny):
    _, program = tiny
    cost = build_cost_graph(program)
    stages = cost.stages
    assert stages[0].start == 0 and stages[-1].stop == len(program.eqns)
    assert all(s.start < s.stop for s in stages)
    assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))
    assert sum(s.flops for s in stages) == pytest.approx(cost.total_flops)
    assert len(cost.crossing) == len(program.eqns) + 1


def test_stages_cut_at_blocks_and_between_attention_and_mlp(tiny):
    wl, program = tiny
    cost = build_cost_graph(program)
    names = [s.name for s in cost.stages]
    starts = {s.start for s in cost.stages}
    n_layer = wl.info["n_layer"]
    for i in range(n_layer):
        assert f"GPT2/h_{i}[ln_2,mlp]" in names, names
        # The attention/MLP cut inside block i.
        assert _first(program, f"GPT2/h_{i}/ln_2") in starts, i
    for i in range(1, n_layer):
        assert f"GPT2/h_{i}[ln_1,attn]" in names, names
        # The cut between block i-1 and block i.
        assert _first(program, f"GPT2/h_{i}/ln_1") in starts, i
    # Block 0 is a copy of the repeated block like the others (graph.find_blocks): its
    # attention stage starts at the block and ends at its attention/MLP cut; the
    # FLOP-free embedding lookups before it keep a stage of their own.
    (block0,) = [s for s in cost.stages if s.start <= _first(program, "GPT2/h_0/attn") < s.stop]
    assert block0.start == _first(program, "GPT2/h_0/ln_1")
    assert block0.stop == _first(program, "GPT2/h_0/ln_2")
    assert block0.name == "GPT2/h_0[ln_1,attn]"
    # The cut after the last block.
    assert _first(program, "GPT2/ln_f") in starts


def test_one_residual_stream_crosses_each_block_cut(tiny):
    wl, program = tiny
    cost = build_cost_graph(program)
    info = wl.info
    stream = (info["batch_size"] * info["seq_len"] * info["d_model"]
              * np.dtype(info["dtype"]).itemsize)
    cuts = [_first(program, f"GPT2/h_{i}/{sub}") for i in range(info["n_layer"])
            for sub in ("ln_1", "ln_2")][1:] + [_first(program, "GPT2/ln_f")]
    stops = {s.stop for s in cost.stages}
    for k in cuts:
        assert k in stops
        assert cost.crossing[k] == stream, (k, program.eqns[k].module_path)
    for k, s in enumerate(cost.stages[:-1], start=1):
        assert cost.boundary_bytes(k) == cost.crossing[s.stop]


def test_replay_of_gpt2_tiny_matches_the_model():
    wl = build_workload(load_config(TINY, batch_size=2, seq_len=16))
    key = jax.random.key(0)
    params, batch = wl.init_params(key), wl.synthetic_batch(jax.random.fold_in(key, 1))
    program = trace(wl.loss_fn, params, *batch)
    # Replayed under jit (eval_eqn re-emits each equation into the trace), one compile.
    replayed = jax.jit(lambda p, b: replay(program, p, *b))(params, batch)
    np.testing.assert_allclose(replayed, jax.jit(wl.loss_fn)(params, *batch), rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Fingerprints
# ------------------------------------------------------------------------------------------

def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_fingerprint_is_stable_for_the_same_function_and_shapes():
    args = make_args()
    fp = trace(loss_fn, *args).fingerprint()
    assert trace(loss_fn, *args).fingerprint() == fp
    assert trace(loss_fn, *_abstract(args)).fingerprint() == fp  # abstract inputs: same
    assert trace(loss_fn, *make_args()).fingerprint() == fp      # values do not matter
    assert len(fp) == 16


@pytest.mark.parametrize("variant", [
    lambda: trace(loss_fn, *make_args(batch=5)),
    lambda: trace(loss_fn, *make_args(dtype=jnp.bfloat16)),
    lambda: trace(loss_fn, {"w": jnp.ones((8, 8), jnp.bfloat16), "b": jnp.ones(8)}, jnp.ones((4, 8))),
    lambda: trace(lambda p, x: loss_fn(p, jnp.tanh(x)), *make_args()),
], ids=["batch", "input-dtype", "param-dtype", "extra-op"])
def test_fingerprint_changes_with_shapes_dtypes_and_ops(variant):
    assert variant().fingerprint() != trace(loss_fn, *make_args()).fingerprint()


def test_gpt2_tiny_fingerprint_tracks_batch_size():
    def fp(**overrides):
        wl = build_workload(load_config(TINY, **overrides))
        return trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch).fingerprint()
    base = fp()
    assert fp() == base
    assert fp(batch_size=2) != base
    assert fp(seq_len=32) != base


def test_resnet_blocks_with_a_projection_shortcut_join_their_group():
    """ResNet-50's 16 bottleneck blocks are found from the dataflow, each stage's first
    block (whose shortcut has a projection convolution: the same block with a branch
    added) included, every block exactly once and cut off as stages, so that a per-block
    plan checkpoints what `nn.remat(Bottleneck)` would."""
    from remat_planner.graph import find_blocks
    wl = build_workload(load_config(TINY.parent / "resnet50.yaml"))
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch, has_aux=True)
    groups = find_blocks(program)
    ranges = sorted(r for g in groups for r in g.ranges)
    names = [{program.eqns[i].module_path.split("/")[1] for i in range(lo, hi)}
             for lo, hi in ranges]
    assert names == [{f"Bottleneck_{k}"} for k in range(16)]
    assert sum(len(g.variants) for g in groups) == 4
    bounds = {s.start for s in build_cost_graph(program).stages}
    assert {lo for lo, _ in ranges} <= bounds


def test_no_cut_between_two_stages_reading_the_same_earlier_activation():
    """graph.drop_split_readers: a cut is dropped where an activation computed before the
    stage ending there is read in that stage and in the one after (a BatchNorm's input,
    read by its statistics and its normalisation): both would keep it if checkpointed.
    A cut after the activation's own stage, and a protected (block) cut, stay."""
    from remat_planner.graph import drop_split_readers

    def loss(params, x):
        h = jnp.tanh(x @ params["w"])      # eqns 0, 1: h is computed by eqn 1
        m = jnp.sin(h)                     # eqn 2: reads h
        out = h * m                        # eqn 3: reads h again
        return jnp.sum(jnp.cos(out))       # eqns 4, 5

    program = trace(loss, {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)},
                    jax.ShapeDtypeStruct((4, 8), jnp.float32))
    assert [e.name for e in program.eqns][:4] == ["dot_general", "tanh", "sin", "mul"]
    counted = {v for e in program.eqns for v in e.outvars}
    assert drop_split_readers(program, [2, 3, 4], counted) == [2, 4]
    assert drop_split_readers(program, [2, 3, 4], counted, frozenset({3})) == [2, 3, 4]
    assert drop_split_readers(program, [2, 3, 4], set()) == [2, 3, 4]


def test_batchnorm_statistics_and_normalisation_share_a_stage():
    """The corpus CNN's stem BatchNorm (tests/corpus.py): its input is read by the
    statistics and by the normalisation, so no stage boundary falls between them."""
    import corpus

    m = corpus.get("cnn_bn")
    program = trace(m.loss_fn, m.params, *m.batch, has_aux=True)
    names = [s.name for s in build_cost_graph(program).stages]
    assert sum("stem_norm" in name for name in names) == 1, names

def test_the_loss_tail_after_its_narrowest_cut_is_one_stage():
    """graph.merge_loss_tail: from the last block boundary on, the cuts after the
    narrowest go (the logits' matmul, softmax and loss become one stage); of equally
    narrow ones the last stays; block boundaries and the cuts before stay."""
    from remat_planner.graph import merge_loss_tail

    crossing = {10: 64, 20: 64, 30: 64, 35: 64, 40: 4096, 45: 4096}
    # blocks end at 30: the final norm (30-35) stays apart, the head from 35 is one stage
    assert merge_loss_tail([10, 20, 30, 35, 40, 45], crossing, frozenset({10, 20, 30})) == \
        [10, 20, 30, 35]
    # the narrowest is the last block boundary: everything after it is the head
    crossing[35] = 128
    assert merge_loss_tail([10, 20, 30, 35, 40, 45], crossing, frozenset({10, 20, 30})) == \
        [10, 20, 30]
    # without blocks (no head to tell apart) or nothing after the last block: unchanged
    assert merge_loss_tail([10, 40, 45], crossing, frozenset()) == [10, 40, 45]
    assert merge_loss_tail([10, 20, 30], crossing, frozenset({10, 20, 30})) == [10, 20, 30]
