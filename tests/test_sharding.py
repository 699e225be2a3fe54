"""Sharded steps on 8 simulated CPU devices (tests/conftest.py): per-device budget checked
by XLA's per-device peak of the compiled SPMD step, exact gradients against the unsharded
unplanned step, collectives never repeated by the plan, one-line errors for bad meshes."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import remat_planner as rp
from remat_planner import sharding as sh
from remat_planner.cli import main
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.errors import ConfigError
from remat_planner.memory import compiler_options
from remat_planner.sharding import jit_kwargs
from remat_planner.step import Step

CONFIG = "configs/llama-tiny.yaml"
BATCH = 32  # divisible by the 8 (dp, fsdp) and 4 (fsdp+tp) data shards
SCHEMES = {"dp": "data=8", "fsdp": "data=8", "fsdp+tp": "data=4,model=2"}
# Budgets as fractions of the way from fixed memory to the no-remat peak (per device).
FRACTIONS = (0.8, 0.65, 0.5)
N_LAYER = 4  # as in the config

pytestmark = [pytest.mark.slow,  # compiles sharded steps: run by .ci/run's second part
              pytest.mark.skipif(len(jax.devices()) < 8,
                                 reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")]


@pytest.fixture(scope="module")
def workload():
    """configs/llama-tiny.yaml (4 unrolled blocks) at batch 32."""
    cfg = load_config(CONFIG, batch_size=BATCH)
    assert cfg.model["n_layer"] == N_LAYER and not cfg.model["scan_layers"]
    return build_workload(cfg), make_optimizer(cfg.optimizer)


@pytest.fixture(scope="module")
def real_inputs(workload):
    wl, _ = workload
    return wl.init_params(jax.random.key(0)), wl.synthetic_batch(jax.random.key(1))


@pytest.fixture(scope="module")
def reference(workload, real_inputs):
    """Loss and gradients of the unsharded, unplanned step."""
    wl, _ = workload
    params, batch = real_inputs
    return jax.jit(jax.value_and_grad(wl.loss_fn))(params, *batch)


@pytest.fixture(scope="module")
def profiles():
    """Stage profiles shared by the schemes' analyses of the same program."""
    return {}


@pytest.fixture(scope="module", params=list(SCHEMES))
def analysis(request, workload, profiles):
    wl, opt = workload
    scheme = request.param
    return scheme, rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt,
                              mesh=SCHEMES[scheme], sharding=scheme, profiles=profiles)


def test_plans_fit_per_device_budget_and_gradients_are_exact(workload, analysis, real_inputs,
                                                             reference):
    wl, opt = workload
    scheme, an = analysis
    noremat = an.noremat.peak_bytes
    assert an.sharding.scheme == scheme and an.fixed.total < noremat
    plans = []
    for frac in FRACTIONS:
        budget = int(an.fixed.total + frac * (noremat - an.fixed.total))
        p = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, analysis=an,
                    max_rounds=2)
        assert p.measured_peak_bytes <= budget, (scheme, frac, p.measured_peak_bytes, budget)
        assert p.sharding.to_dict() == {"mesh": SCHEMES[scheme], "scheme": scheme}
        plans.append(p)
    # the tighter budget really needed remat
    assert plans[-1].measured_peak_bytes < noremat and plans[-1].recompute_flops > 0

    # Communication: the planned step repeats no collective of the unplanned one.
    before, after = an.noremat.communication, plans[-1].metadata["communication"]
    for kind in ("all-gather", "all-reduce", "reduce-scatter"):
        assert after[kind]["bytes"] <= before[kind]["bytes"] * 1.01, (scheme, kind, before, after)
    assert after["in recomputation"]["count"] == 0, after

    # Gradients and loss of the sharded planned step equal the unsharded unplanned ones.
    params, batch = real_inputs
    planned = plans[-1].apply(wl.loss_fn)
    kw = jit_kwargs(Step(planned, sharding=an.sharding), wl.abstract_params, wl.abstract_batch)
    grad_fn = jax.jit(jax.value_and_grad(planned), compiler_options=compiler_options(),
                      in_shardings=(kw["in_shardings"][0], *kw["in_shardings"][1]),
                      out_shardings=(sh.step_shardings(an.sharding, wl.abstract_params,
                                                       wl.abstract_batch).replicated,
                                     kw["out_shardings"]))
    p_sharded, b_sharded = rp.shard_arrays(params, batch, sharding=an.sharding)
    assert p_sharded["lm_head"]["kernel"].sharding.spec != jax.sharding.PartitionSpec() \
        or scheme == "dp"
    loss, grads = grad_fn(p_sharded, *b_sharded)
    ref_loss, ref_grads = reference
    # collectives reorder sums: f32 agrees to ~1e-6 relative; 1e-5 with a small atol
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, ref_grads)

    if scheme == "fsdp+tp":  # the training step API, on arrays placed by shard_arrays
        step = rp.train_step(wl.loss_fn, opt, plans[-1], params=wl.abstract_params,
                             batch=wl.abstract_batch)
        assert plans[-1].sharding == an.sharding
        p_in, b_in, s_in = rp.shard_arrays(params, batch, opt.init(params), optimizer=opt,
                                           sharding=plans[-1].sharding)
        new_params, _, step_loss = step(p_in, s_in, b_in)
        np.testing.assert_allclose(step_loss, ref_loss, rtol=1e-5)
        kernel = new_params["layers_0"]["mlp"]["down_proj"]["kernel"]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec("model", "data")


def test_tensor_parallel_collective_outputs_are_kept(workload):
    """Under tp the row-parallel projections, the embedding lookup and the loss's
    reductions over vocabulary-split logits (log-softmax max and sum, the label gather)
    are all-reduced: they are pinned, i.e. in every checkpoint option's saved set. Nothing
    inside attention is (its softmax reduces over keys, not over the split heads)."""
    wl, _ = workload
    from remat_planner.trace import trace
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    spec = sh.ShardingSpec.make("data=4,model=2", "fsdp+tp")
    pinned = sh.collective_outputs(program, wl.abstract_params, spec)
    producers = sorted({(e.name, e.module_path.split("/")[-1]) for e in program.eqns
                        if set(e.outvars) & pinned})
    assert len(pinned) == 2 * N_LAYER + 1 + 3
    assert set(producers) == {("dot_general", "o_proj"), ("dot_general", "down_proj"),
                              ("gather", "embed"), ("reduce_max", ""), ("reduce_sum", ""),
                              ("gather", "")}
    assert not sh.collective_outputs(program, wl.abstract_params,
                                     sh.ShardingSpec.make("data=8", "fsdp"))


def test_partition_specs():
    P = jax.sharding.PartitionSpec
    tp = sh.ShardingSpec.make({"data": 4, "model": 2}, "fsdp+tp")
    assert sh.param_spec("layers_0/attn/q_proj/kernel", (128, 128), tp) == P("data", "model")
    assert sh.param_spec("layers_0/mlp/down_proj/kernel", (352, 128), tp) == P("model", "data")
    assert sh.param_spec("embed/embedding", (512, 128), tp) == P("model", "data")
    assert sh.param_spec("norm/scale", (128,), tp) == P("data")
    # stacked by a scan over layers: still a vector per layer, never split over 'model'
    assert sh.param_spec("layers/attn_norm/scale", (4, 128), tp) == P(None, "data")
    assert sh.param_spec("layers/attn/c_attn/bias", (4, 384), tp) == P(None, "data")
    fsdp = sh.ShardingSpec.make("data=8", "fsdp")
    assert sh.param_spec("x/kernel", (3, 352), fsdp) == P(None, "data")
    assert sh.param_spec("x/bias", (3,), fsdp) == P(None)  # nothing divisible: replicated
    assert sh.ShardingSpec.make("a=2,b=4", "dp").data_axes == ("a", "b")
    assert sh.gathered_spec(P("model", "data"), tp) == P("model", None)
    # plain fsdp on a 2-axis mesh: 'model' is a data axis, gathered like 'data'
    fsdp2 = sh.ShardingSpec.make("data=4,model=2", "fsdp")
    assert sh.param_spec("x/kernel", (128, 352), fsdp2) == P(None, ("data", "model"))
    assert sh.gathered_spec(P(None, ("data", "model")), fsdp2) == P(None, None)
    with pytest.raises(ConfigError, match=r"dimension 1 \(33\) is not divisible by mesh axis 'model'"):
        sh.param_spec("q_proj/kernel", (128, 33), tp)


@pytest.mark.parametrize("mesh, scheme, fragment", [
    ("data=4,model", "dp", "is not axis=size"),
    ("data=four", "dp", "not an integer"),
    ("data=0", "dp", "must be positive"),
    ("data=2,data=4", "dp", "appears twice"),
    ("data=8", "tp", "axis named 'model'"),
    ("model=8", "fsdp+tp", "needs a data axis"),
    ("data=8", "zero", "unknown sharding scheme"),
])
def test_bad_mesh_is_one_line_config_error(mesh, scheme, fragment):
    with pytest.raises(ConfigError, match=fragment):
        sh.ShardingSpec.make(mesh, scheme)


@pytest.mark.parametrize("args, fragment", [
    (["--mesh", "data=4,model", "--sharding", "dp"], "is not axis=size"),
    (["--mesh", "data=4", "--sharding", "dp"], "needs 4 devices but JAX sees 8"),
    (["--mesh", "data=8", "--sharding", "dp", "--batch-size", "4"],
     "batch dimension 4 is not divisible by the data axes"),
    (["--mesh", "data=8"], "needs both a mesh and a sharding scheme"),
    (["--mesh", "data=8", "--sharding", "zero"], "field 'sharding'"),
])
def test_cli_bad_sharding_exits_2_with_one_line(args, fragment, capsys):
    code = main([CONFIG, "--budget", "10MB", "--no-compare", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err and "Traceback" not in err and fragment in err


def test_cli_sharded_json_report(capsys, workload):
    """The CLI on a mesh (model only, --no-verify: the verified path is the API's above):
    fixed memory is per device, fsdp splits it 8 ways."""
    import json
    code = main([CONFIG, "--budget", "12MB", "--batch-size", str(BATCH), "--mesh", "data=8",
                 "--sharding", "fsdp", "--no-verify", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    sharded = report["sharding"]
    assert (sharded["mesh"], sharded["scheme"], sharded["devices"]) == ("data=8", "fsdp", 8)
    wl, opt = workload
    whole = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt,
                       calibrate=False, measure_xla=False).fixed
    fixed = report["fixed"]
    for key in ("params_bytes", "grads_bytes", "opt_state_bytes", "batch_bytes"):
        assert fixed[key] <= getattr(whole, key) // 8 + 4096, key  # small vectors replicated
    assert report["plan"]["predicted_peak_bytes"] <= 12_000_000


def test_config_keys(tmp_path):
    text = Path(CONFIG).read_text() + "mesh: {data: 4, model: 2}\nsharding: fsdp+tp\n"
    path = tmp_path / "sharded.yaml"
    path.write_text(text)
    cfg = load_config(path, batch_size=8)
    assert cfg.mesh == "data=4,model=2" and cfg.sharding == "fsdp+tp"
    from remat_planner.config import sharding_spec
    assert sharding_spec(cfg) == sh.ShardingSpec((("data", 4), ("model", 2)), "fsdp+tp")
    path.write_text(Path(CONFIG).read_text() + "sharding: fsdp\n")
    with pytest.raises(ConfigError, match="needs both a mesh and a sharding scheme"):
        load_config(path)


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
    """The same tiny llama with its blocks in one scan (`scan_layers: true`)."""
    path = tmp_path_factory.mktemp("scanned") / "scanned.yaml"
    path.write_text(Path(CONFIG).read_text().replace("scan_layers: false", "scan_layers: true"))
    cfg = load_config(path, batch_size=BATCH)
    return build_workload(cfg), make_optimizer(cfg.optimizer)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scanned_model_fits_three_budgets_and_gradients_are_exact(scheme, scanned, real_inputs):
    """The scanned tiny llama on 8 devices, dp, fsdp and fsdp+tp: XLA's per-device peak
    within three per-device budgets; the planned step executes no more communication than
    the unplanned one (loop bodies counted per iteration: under fsdp each iteration's
    weights are all-gathered in the forward and once more in the backward, by both); the
    sharded planned step's loss and gradients equal the unsharded unplanned step's."""
    wl, opt = scanned
    an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt,
                    mesh=SCHEMES[scheme], sharding=scheme)
    noremat = an.noremat.peak_bytes
    plans = []
    for frac in FRACTIONS:
        budget = int(an.fixed.total + frac * (noremat - an.fixed.total))
        p = rp.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, analysis=an)
        assert p.measured_peak_bytes <= budget, (frac, p.measured_peak_bytes, budget)
        assert any(s.option.startswith("scan:") for s in p.segments)
        # counted alike (under fsdp the unplanned replay recomputes what depends on the
        # weights alone in the backward; plans measured up to 1e-4 below it)
        assert -1e-3 <= p.measured_flops / an.noremat.flops - 1 < 0.5
        plans.append(p)
    assert plans[-1].measured_peak_bytes < noremat and plans[-1].recompute_flops > 0
    if scheme != "dp":
        before = an.noremat.communication
        for p in plans:
            after = p.metadata["communication"]
            for kind in ("all-gather", "all-reduce", "reduce-scatter"):
                assert after[kind]["bytes"] <= before[kind]["bytes"] * 1.01, (kind, before, after)

    _, batch = real_inputs
    stacked = wl.init_params(jax.random.key(0))  # parameters stacked over the layers
    planned = plans[-1].apply(wl.loss_fn)
    p_sharded, b_sharded = rp.shard_arrays(stacked, batch, sharding=an.sharding)
    loss, grads = jax.jit(jax.value_and_grad(planned),
                          compiler_options=compiler_options())(p_sharded, *b_sharded)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(wl.loss_fn))(stacked, *batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, ref_grads)


def test_scan_body_gathers_weight_slices_and_pins_row_parallel_outputs(scanned):
    """Inside the layer scan's body, fsdp+tp: every split weight slice is gathered over the
    data axis (still split over `model`), and the row-parallel projections' outputs are
    the body's collective outputs; plain fsdp pins nothing."""
    wl, _ = scanned
    from remat_planner import scan
    from remat_planner.trace import trace
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    eqn = program.eqns[scan.find_layer_scan(program)]
    body = scan.layer_body(eqn)
    for scheme, mesh in (("fsdp+tp", "data=4,model=2"), ("fsdp", "data=8")):
        spec = sh.ShardingSpec.make(mesh, scheme)
        regather, pinned = sh.scan_body_shardings(
            eqn, body.program, sh.program_param_specs(program, wl.abstract_params, spec), spec)
        assert regather and all("data" not in str(s.spec) for s in regather.values())
        producers = {e.module_path.split("/")[-1] for e in body.program.eqns
                     if set(e.outvars) & pinned}
        assert producers == ({"o_proj", "down_proj"} if scheme == "fsdp+tp" else set())


def test_communication_parser():
    hlo = """
  %all-gather.1 = f32[128,352]{1,0} all-gather(f32[16,352]{1,0} %p), replica_groups={}
  %ar = (f32[8]{0}, /*index=1*/bf16[4,4]{1,0}) all-reduce(%a, %b), to_apply=%add
  %x = f32[2]{0} add(%y, %z)
  %ag = f32[4]{0} all-gather(f32[1]{0} %q), metadata={op_name="jit(step)/transpose(jvp())/checkpoint/rematted_computation/mul"}
"""
    c = sh.communication(hlo)
    assert c.counts["all-gather"] == 2 and c.bytes["all-gather"] == 128 * 352 * 4 + 16
    assert (c.recomputed_count, c.recomputed_bytes) == (1, 16)
    assert c.counts["all-reduce"] == 1 and c.bytes["all-reduce"] == 8 * 4 + 16 * 2
    assert c.total_bytes == 128 * 352 * 4 + 64 + 16


def test_communication_counts_loop_bodies_per_iteration():
    """A collective in a while body counts once per iteration (known trip count), in a
    nested loop per iteration of both, in a called computation once per call."""
    hlo = """HloModule m

%inner (p: f32[2]) -> f32[2] {
  %ag = f32[8]{0} all-gather(f32[2]{0} %p), replica_groups={}
}

%body (p: f32[2]) -> f32[2] {
  %ar = f32[4]{0} all-reduce(f32[4]{0} %p), to_apply=%add
  %w2 = f32[2]{0} while(%p), condition=%c2, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}

ENTRY %main (a: f32[2]) -> f32[2] {
  %w = f32[2]{0} while(%a), condition=%c, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %top = f32[4]{0} all-reduce(f32[4]{0} %a), to_apply=%add
}
"""
    c = sh.communication(hlo)
    assert c.counts["all-reduce"] == 5 + 1 and c.bytes["all-reduce"] == 6 * 16
    assert c.counts["all-gather"] == 15 and c.bytes["all-gather"] == 15 * 32


@pytest.mark.parametrize("config,scheme,scanned", [
    ("llama-tiny", "tp", True),       # stacked RMSNorm scales
    ("gpt2-tiny", "fsdp+tp", True),   # q, k, v sliced out of a fused projection; stacked biases
    ("vit-tiny", "tp", True),         # a patch embedding that would split the residual stream
    ("vit-tiny", "tp", False),        # the same, unrolled: 29 stages, all `nothing`
])
def test_tp_nothing_plan_repeats_no_collective(config, scheme, scanned, tmp_path):
    """Under tp, every stage (every sub-stage of a scanned body) checkpointed with
    `nothing` recomputes everything it computes, and the step still executes the
    unplanned step's collectives: the same bytes of all five kinds (per execution), none
    in a recomputation for unrolled models, the same counts too for scans. What made it
    fail, and is fixed: stacked norm scales ([layers, d]) split over `model` like kernels
    (XLA then split the residual stream, all-reduced the RMSNorm sum and all-gathered
    activations: 43 -> 51 all-reduces and 32 -> 36 all-gathers on the llama); q, k, v
    sliced out of a fused projection (collective permutes: 8 -> 16 on gpt2); stacked
    biases gathered again by the recomputation under fsdp (76 -> 92 all-gathers on gpt2);
    a column-parallel patch embedding, position embedding and class token that split the
    residual stream (vit: 42 -> 50 all-reduces scanned; unrolled 125 -> 134 all-gathers,
    6 collectives in recomputations)."""
    path = tmp_path / f"{config}.yaml"
    path.write_text(Path(f"configs/{config}.yaml").read_text()
                    .replace("scan_layers: false", f"scan_layers: {str(scanned).lower()}"))
    cfg = load_config(path, batch_size=BATCH)
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt,
                    mesh="data=4,model=2", sharding=scheme, calibrate=False,
                    measure_xla=scanned)
    from remat_planner import planner as pl, scan
    from remat_planner.plan import STORE, Segment
    n = an.chain.n
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

    def comm(options):
        segs = tuple(Segment(i, i + 1, o) for i, o in enumerate(options))
        p = pl.plan_from_segments(an, segs, 0, 0, wl.abstract_params, wl.abstract_batch)
        return rp.measure(p.apply(wl.loss_fn), wl.abstract_params, wl.abstract_batch, opt,
                          sharding=an.sharding).communication

    if scanned:
        k, stack = an.scan_chain.stage, an.scan_chain.stack
        nothing = f"scan:{stack.length}x" + "|".join(["nothing"] * stack.chain.n)
        before = comm([scan.store_scheme(stack) if i == k else STORE for i in range(n)])
        after = comm([nothing if i == k else STORE for i in range(n)])
        pick = lambda c: {kind: (c[kind]["count"], c[kind]["bytes"]) for kind in kinds}  # noqa: E731
    else:
        options = [("nothing" if any(o.name == "nothing" for o in st.options) else STORE)
                   for st in an.chain.stages]
        assert options.count("nothing") >= n - 2
        before, after = comm([STORE] * n), comm(options)
        assert after["in recomputation"]["count"] == 0, after
        pick = lambda c: {kind: c[kind]["bytes"] for kind in kinds}  # noqa: E731
    assert pick(after) == pick(before), (pick(before), pick(after))


def test_unpaired_kernels_stay_replicated_under_tp():
    """Kernels tp would split column-parallel by their names but that no row-parallel
    kernel pairs with stay replicated: BERT's masked-LM `head_transform`, ViT's patch
    embedding, position embedding and class token. The llama's layers all pair up."""
    from remat_planner.trace import trace
    P = jax.sharding.PartitionSpec
    spec = sh.ShardingSpec.make("data=4,model=2", "fsdp+tp")
    expected = {"llama-tiny": (), "gpt2-tiny": (), "bert-tiny": ("head_transform/kernel",),
                "vit-tiny": ("cls_token", "patch_embed/kernel", "pos_embed")}
    for config, unpaired in expected.items():
        cfg = load_config(f"configs/{config}.yaml", batch_size=BATCH)
        wl = build_workload(cfg)
        program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
        assert sh.unpaired_kernels(program, wl.abstract_params, spec) == unpaired, config
    kept = sh.with_unpaired(Step(wl.loss_fn, sharding=spec), wl.abstract_params,
                            wl.abstract_batch)
    assert kept.replicated == expected["vit-tiny"]
    assert sh.param_spec("patch_embed/kernel", (4, 4, 3, 128), kept) == P(None, None, None, "data")
    assert sh.param_spec("patch_embed/kernel", (4, 4, 3, 128), spec) == P(None, "data", None, "model")
    assert sh.ShardingSpec.from_dict(kept.to_dict()) == kept
    assert "replicated" not in spec.to_dict()
    assert sh.with_unpaired(Step(wl.loss_fn, sharding=sh.ShardingSpec.make("data=8", "fsdp")),
                            wl.abstract_params, wl.abstract_batch).replicated == ()
