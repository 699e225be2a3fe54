"""The recompute time model (costmodel, graph.eqn_bytes, memory.weighted_chain) and the
wall-clock benchmark script. No test asserts on measured time."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from remat_planner import baselines, costmodel
from remat_planner import planner as pl
from remat_planner.graph import build_cost_graph, eqn_bytes, jaxpr_bytes, jaxpr_flops
from remat_planner.memory import (ChainModel, KeepOption, StageProfile, profile_stages,
                                  simulate, weighted_chain)
from remat_planner.plan import DOTS, NOTHING, STORE
from remat_planner.solve import ChainSolver, brute_force
from remat_planner.trace import trace

ROOT = Path(__file__).resolve().parents[1]
f32 = jnp.float32


def test_eqn_bytes_counts_operands_and_results_not_views():
    x = jax.ShapeDtypeStruct((1000,), f32)
    add = jax.make_jaxpr(lambda a, b: a + b)(x, x)
    assert jaxpr_bytes(add) == 3 * 4000
    view = jax.make_jaxpr(lambda a: a.reshape(10, 100))(x)
    assert jaxpr_bytes(view) == 0
    m = jax.ShapeDtypeStruct((64, 32), f32)
    w = jax.ShapeDtypeStruct((32, 16), f32)
    dot = jax.make_jaxpr(jnp.dot)(m, w)
    assert jaxpr_bytes(dot) == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert jaxpr_flops(dot) == 2 * 64 * 32 * 16
    # a scan body counts once per iteration
    scanned = jax.make_jaxpr(lambda c: jax.lax.scan(lambda c, _: (c * 2.0, None), c, None,
                                                    length=5)[0])(x)
    assert jaxpr_bytes(scanned) == 5 * (2 * 4000 + 4)  # the literal 2.0 is read too
    assert eqn_bytes("broadcast_in_dim", {}, [x], [x]) == 0


def _two_stage_program():
    """Stage 1 elementwise-heavy (a long tanh/exp chain), stage 2 a matmul of similar
    FLOPs; a layer norm between so the graph has a cut."""
    d = 256

    def loss(params, x):
        h = x
        for _ in range(6):  # elementwise: ~1 FLOP per element and op, 8+ bytes moved
            h = jnp.tanh(h) * params["s"] + jnp.exp(-h * h)
        h = h @ params["w"]
        return jnp.mean(h * h)

    params = {"s": jax.ShapeDtypeStruct((d,), f32), "w": jax.ShapeDtypeStruct((d, d), f32)}
    x = jax.ShapeDtypeStruct((512, d), f32)
    return loss, params, x


def test_elementwise_recompute_costs_more_than_flops_say():
    loss, params, x = _two_stage_program()
    program = trace(loss, params, x)
    cost = build_cost_graph(program)
    chain = profile_stages(program, cost, measure_xla=False)
    model = costmodel.CostModel("time").with_balance(4.0)
    timed = weighted_chain(chain, model.bytes_weight)
    inflation = {}  # per stage: time cost / FLOPs of recomputing it (`nothing`)
    for st, s, t in zip(cost.stages, chain.stages, timed.stages):
        for o, ot in zip(s.options, t.options):
            assert ot.recompute_flops == pytest.approx(o.recompute_flops
                                                       + model.balance * o.recompute_bytes)
        if not s.option(NOTHING).recompute_flops:
            continue  # the first stage (argument plumbing) recomputes nothing
        has_dot = any(e.name == "dot_general" for e in program.eqns[st.start:st.stop])
        inflation.setdefault(has_dot, []).append(
            t.option(NOTHING).recompute_flops / s.option(NOTHING).recompute_flops)
    # recomputing the elementwise chain costs far more time than its FLOPs say; the matmul
    # stage's recompute is priced about at its FLOPs
    assert min(inflation[False]) > 10 * max(inflation[True])
    assert max(inflation[True]) < 1.5
    # The whole-program view: the elementwise chain is a large share of time but a small
    # share of FLOPs.
    closed = jax.make_jaxpr(loss)(params, x)

    def elementwise(p, h):
        for _ in range(6):
            h = jnp.tanh(h) * p["s"] + jnp.exp(-h * h)
        return h
    ew = jax.make_jaxpr(elementwise)(params, x)
    share_flops = jaxpr_flops(ew) / jaxpr_flops(closed)
    share_time = (model.seconds(jaxpr_flops(ew), jaxpr_bytes(ew))
                  / model.seconds(jaxpr_flops(closed), jaxpr_bytes(closed)))
    assert share_time > 1.5 * share_flops


def _choice_chain() -> ChainModel:
    """Two stages; the first can be recomputed cheaply in FLOPs but with much traffic
    (`nothing`: an elementwise tail) or with more FLOPs and no traffic (`dots`)."""
    s0 = StageProfile("s0", 100.0, (KeepOption(STORE, (), 100, 0.0),
                                    KeepOption(NOTHING, (), 10, 10.0, recompute_bytes=1000.0),
                                    KeepOption(DOTS, (7,), 12, 50.0, recompute_bytes=0.0)),
                      0, 0, bytes_accessed=1000.0)
    s1 = StageProfile("s1", 100.0, (KeepOption(STORE, (), 5, 0.0),), 0, 0)
    return ChainModel((s0, s1), (0, 1, 0))


@pytest.mark.parametrize("balance", [0.0, 1.0])
def test_time_objective_changes_the_dp_choice(balance):
    chain = _choice_chain()
    model = costmodel.CostModel("flops" if balance == 0 else "time").with_balance(max(balance, 1))
    w = weighted_chain(chain, model.bytes_weight)
    budget = 40  # `store` on stage 0 does not fit
    sol = ChainSolver(w, 200).solve(budget)
    ref = brute_force(w, budget)
    assert sol.recompute_flops == pytest.approx(ref.recompute_flops)
    expected = NOTHING if balance == 0 else DOTS
    assert sol.segments[0].option == expected
    # simulate on the weighted chain is the time cost in FLOP-equivalents
    _, flops = simulate(chain, sol.segments)
    assert flops == (10.0 if balance == 0 else 50.0)


def test_fit_balance_recovers_a_known_balance():
    rng = np.random.default_rng(0)
    base_f, base_b = 1e9, 2e8
    pts = []
    for _ in range(6):
        f, b = base_f * (1 + rng.uniform(0, 0.3)), base_b * (1 + rng.uniform(0, 0.8))
        pts.append((f, b, base_f, base_b, costmodel.predicted_overhead(7.5, f, b, base_f, base_b)))
    balance, rms = costmodel.fit_balance(pts)
    assert balance == pytest.approx(7.5, rel=1e-3)
    assert rms < 1e-6
    # FLOPs alone (balance 0) is the best fit when time tracks FLOPs exactly
    pts0 = [(f, b, bf, bb, f / bf - 1) for f, b, bf, bb, _ in pts]
    assert costmodel.fit_balance(pts0)[0] < 1e-2


def test_measured_machine_constants_are_positive():
    m = costmodel.measure_machine(repeats=2, n=256, elems=1 << 18)
    assert m.flops_per_second > 0 and m.bytes_per_second > 0 and m.balance > 0
    with pytest.raises(ValueError):
        costmodel.CostModel("seconds")
    with pytest.raises(ValueError):
        costmodel.CostModel("time", 1.0, 0.0)


def _mlp(n_layer=4, d=128, batch=256):
    def loss(params, x):
        h = x
        for i in range(n_layer):
            h = h @ params[f"w{i}"]
            h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
            h = jax.nn.gelu(h)
        return jnp.mean(h * h)
    params = {f"w{i}": jax.ShapeDtypeStruct((d, d), f32) for i in range(n_layer)}
    return loss, params, jax.ShapeDtypeStruct((batch, d), f32)


def test_plan_time_objective_is_optimal_for_its_own_cost():
    loss, params, x = _mlp()
    opt = optax.sgd(0.1)
    an = pl.analyze(loss, params, (x,), opt, calibrate=False)
    assert an.step_jaxpr_flops > 0 and an.step_jaxpr_bytes > 0
    budget = an.predicted_peak(int(0.5 * an.noremat_activation_bytes))
    pf = pl.plan(loss, params, (x,), budget, opt, verify=False, analysis=an, cost_model="flops")
    pt = pl.plan(loss, params, (x,), budget, opt, verify=False, analysis=an, cost_model="time")
    for p, kind in ((pf, "flops"), (pt, "time")):
        assert p.metadata["cost_model"] == kind
        assert p.recompute_time_overhead == pytest.approx(
            p.metadata["recompute_seconds_predicted"] / p.metadata["step_seconds_predicted"])
    # each objective's plan is the cheapest in its own currency (exact DP, same memory model)
    assert pf.recompute_flops <= pt.recompute_flops + 1e-6
    assert pt.metadata["recompute_seconds_predicted"] <= pf.metadata["recompute_seconds_predicted"] + 1e-12


def test_time_objective_on_a_scanned_stack():
    from remat_planner.config import build_workload, load_config, make_optimizer
    cfg = load_config(ROOT / "configs" / "gpt2-tiny.yaml")
    cfg = cfg.model_copy(update={"model": {**cfg.model, "scan_layers": True, "n_layer": 4}})
    wl, opt = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = pl.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, opt, calibrate=False)
    assert an.scan_chain is not None
    model = costmodel.CostModel("time")
    timed = an.cost_chain(model)
    k = an.scan_chain.stage
    flops_opts = {o.name: o.recompute_flops for o in an.chain.stages[k].options}
    time_opts = {o.name: o.recompute_flops for o in timed.stages[k].options}
    # a scheme that recomputes costs more in time units than in FLOPs; `store` costs 0
    assert time_opts[STORE] == 0
    assert time_opts[NOTHING] > flops_opts[NOTHING] > 0
    # every scheme of either chain can be simulated on the other (their frontiers differ)
    from remat_planner.plan import Segment
    names = {o.name for c in (an.chain, timed) for o in c.stages[k].options}
    for name in names:
        segs = tuple(Segment(i, i + 1, name if i == k else STORE) for i in range(an.chain.n))
        _, f = simulate(an.chain_for(segs, "flops"), segs)
        _, t = simulate(an.chain_for(segs, model), segs)
        assert t >= f >= 0
    budget = an.predicted_peak(int(0.6 * an.noremat_activation_bytes))
    p = pl.plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, opt, verify=False,
                analysis=an, cost_model=model)
    assert p.metadata["cost_model"] == "time" and p.recompute_time_overhead >= 0


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.extended
def test_benchmark_script_smoke(tmp_path):
    cfg = tmp_path / "micro.yaml"
    text = (ROOT / "configs" / "gpt2-tiny.yaml").read_text()
    text = text.replace("n_layer: 4", "n_layer: 2").replace("d_model: 128", "d_model: 64")
    cfg.write_text(text.replace("seq_len: 64", "seq_len: 32"))
    md = tmp_path / "bench.md"
    md.write_text("# Benchmarks\n\nintro\n\n<!-- benchmark:begin -->\nold\n"
                  "<!-- benchmark:end -->\n\n## Frontier\n\nkept\n")
    out = tmp_path / "bench.json"
    bench = _load_benchmark()
    rc = bench.main([str(cfg), "--reps", "2", "--fractions", "0.5", "--no-policy-budgets",
                     "--min-seconds", "0", "--markdown", str(md), "--json", str(out)])
    assert rc == 0
    text = md.read_text()
    assert "old" not in text and "intro" in text and "## Frontier\n\nkept" in text
    assert "| no remat |" in text and "nothing_saveable" in text
    assert f"jax {jax.__version__}" in text
    data = json.loads(out.read_text())[str(cfg)]
    labels = [v["label"] for v in data["variants"]]
    assert labels[:4] == ["no remat", *baselines.POLICIES]
    assert any(l.startswith("plan ") for l in labels)
    for v in data["variants"]:
        assert len(v["times"]) == 2 and all(t > 0 for t in v["times"])
        assert v["xla_peak_bytes"] > 0
    assert data["fitted_balance"] >= 0


def test_benchmark_reports_the_preloaded_allocator():
    """The benchmark names the caching allocator mapped into its process (the system
    malloc when none is), which it re-runs itself under (scripts/benchmark.py)."""
    import ctypes.util
    import subprocess

    bench = _load_benchmark()
    assert bench.loaded_allocator() is None  # pytest runs on the system malloc
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location("
            f"'b', {str(ROOT / 'scripts' / 'benchmark.py')!r}); m = importlib.util."
            "module_from_spec(s); sys.modules['b'] = m; s.loader.exec_module(m); "
            "print(m.loaded_allocator())")
    libs = {name: ctypes.util.find_library(lib) for name, lib in bench.ALLOCATORS.items()}
    if not any(libs.values()):
        if os.environ.get("REMAT_REQUIRE_ALLOCATOR"):  # set by .ci/run after installing it
            pytest.fail("REMAT_REQUIRE_ALLOCATOR is set but no tcmalloc or jemalloc is found")
        pytest.skip("no tcmalloc or jemalloc installed (apt-get install libtcmalloc-minimal4)")
    for name, lib in libs.items():
        if lib:
            env = {**os.environ, "LD_PRELOAD": lib}
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
            assert out[-1] == name


def test_cli_cost_model_flag_and_config(tmp_path, capsys):
    from remat_planner.cli import main
    tiny = ROOT / "configs" / "gpt2-tiny.yaml"
    budget = "20MB"
    code = main([str(tiny), "--budget", budget, "--no-verify", "--json", "--cost-model", "time"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["cost_model"] == "time" and plan["recompute_time_overhead_predicted"] >= 0
    cfg = tmp_path / "t.yaml"
    cfg.write_text(tiny.read_text() + "cost_model: time\n")
    code = main([str(cfg), "--budget", budget, "--no-verify", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["plan"]["cost_model"] == "time"
    cfg.write_text(tiny.read_text() + "cost_model: seconds\n")
    assert main([str(cfg), "--budget", budget, "--no-verify", "--json"]) == 2
    assert "cost_model" in capsys.readouterr().err
