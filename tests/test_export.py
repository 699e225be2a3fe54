"""A plan exported as hand-written Flax (remat_planner/export.py): `nn.remat` around the
model's own modules with policy predicates, compiled by XLA to the same peak and FLOPs as
the replayed plan; segments that are not one module are reported, not approximated."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import corpus
import remat_planner as rp
from remat_planner.config import build_workload, load_config, make_optimizer
from remat_planner.errors import InfeasibleBudgetError
from remat_planner.export import PrimitivePolicy, export_flax, main, module_plan
from remat_planner.memory import dot_outputs
from remat_planner.models.gpt2 import GPT2, Block as GPT2Block
from remat_planner.models.layers import causal_lm_loss
from remat_planner.plan import DOTS, DOTS_NO_BATCH, NOTHING, STORE, Plan, Segment, StageInfo
from remat_planner.trace import trace

WITHIN = 0.01  # the tolerance between the hand-written form and the replay


def _close(a, b):
    return abs(a - b) <= WITHIN * b


@pytest.fixture(scope="module")
def selfattn():
    m = corpus.get("selfattn_gpt")
    return m, rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer)


def test_exported_form_on_a_users_lm_equals_the_replay(selfattn):
    """selfattn_gpt (tests/corpus.py: nn.compact, auto-named Block_i, stock nn.SelfAttention)
    at a budget between all-nothing and no remat: the exported per-block policies, passed to
    the model's own nn.remat(Block, policy=...), compile to the replayed plan's peak and FLOPs."""
    m, an = selfattn
    budget = int(0.75 * an.noremat.peak_bytes)
    plan = module_plan(m.loss_fn, m.params, m.batch, budget, m.optimizer, analysis=an)
    assert plan.measured_peak_bytes <= budget
    exported = plan.to_flax(an)
    assert exported.exact, exported.problems
    assert [w.scope for w in exported.wraps] and all(
        w.class_name == "Block" and w.scope.startswith("Decoder_0/Block_") for w in exported.wraps)
    policies = tuple(exported.policy_for(f"Block_{i}") for i in range(m.n_blocks))
    assert any(p is not None for p in policies)
    hand = rp.measure(m.make_remat_loss(policies), m.params, m.batch, m.optimizer)
    assert _close(hand.peak_bytes, plan.measured_peak_bytes), (hand, plan.measured_peak_bytes)
    assert _close(hand.flops, plan.measured_flops), (hand, plan.measured_flops)
    # the comparison can fail: without the wraps the step is 1% away on both counts
    assert not _close(an.noremat.peak_bytes, plan.measured_peak_bytes)
    assert not _close(an.noremat.flops, plan.measured_flops)


def test_a_planner_plan_over_half_blocks_is_reported_not_faked(selfattn):
    """A segment over part of a block (LayerNorm_1 + the MLP's Dense_0/Dense_1) is no
    module: the export says so per segment and wraps nothing for it."""
    m, an = selfattn
    n = an.chain.n
    stages = an.stage_infos
    mlp = next(i for i, s in enumerate(stages) if "Dense_0" in s.name)
    lo, hi = stages[mlp].start, stages[mlp].stop
    segs = tuple(Segment(i, i + 1, DOTS_NO_BATCH, dot_outputs(an.program, lo, hi, DOTS_NO_BATCH))
                 if i == mlp else Segment(i, i + 1, STORE) for i in range(n))
    plan = Plan(segs, stages, an.program.fingerprint(), 0, 0, 0.0, 0, 1.0)
    exported = export_flax(plan, an.program)
    assert not exported.exact and not exported.wraps
    assert len(exported.problems) == 1
    assert stages[mlp].name in exported.problems[0]
    assert "not exactly one Flax module" in exported.problems[0]
    assert "NOT EXPORTED" in exported.to_python()


class _Pair(nn.Module):
    """Two projections of the same shape: a predicate cannot tell them apart."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(x.shape[-1])(x)))


class _Residual(nn.Module):
    """x + f(x) with f a stock-module MLP (the residual add inside the module)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class _Outer(nn.Module):
    """Two residual MLPs, as one block; `policies` maps module paths to nn.remat policies
    (what a user edits in their model source)."""

    policies: tuple = ()

    @nn.compact
    def __call__(self, x):
        pol = dict(self.policies)
        for i in range(2):
            cls = _Residual if f"Outer/Residual_{i}" not in pol else nn.remat(
                _Residual, policy=pol[f"Outer/Residual_{i}"])
            x = cls(name=f"Residual_{i}")(x)
        return x


class _Net(nn.Module):
    policies: tuple = ()

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        pol = dict(self.policies)
        for i in range(3):
            path = f"Outer_{i}"
            cls = _Outer if path not in pol else nn.remat(_Outer, policy=pol[path])
            x = cls(tuple((k.removeprefix(path + "/"), v) for k, v in self.policies
                          if k.startswith(path + "/")), name=path)(x)
        return nn.Dense(1)(x).mean()


def _net_step(policies=()):
    model = _Net(tuple(policies))

    def loss_fn(params, x):
        return model.apply({"params": params}, x)

    x = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    params = jax.eval_shape(lambda: _Net().init(jax.random.key(0), jnp.zeros((1, 32)))["params"])
    return loss_fn, params, (x,)


def _stages_by_module(program, depth):
    """Stages = maximal runs of equations under the same module at `depth` of the path."""
    keys = ["/".join(e.module_path.split("/")[:depth + 1]) for e in program.eqns]
    cuts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]] + [len(keys)]
    return tuple(StageInfo(a, b, keys[a]) for a, b in zip(cuts, cuts[1:]))


def test_nested_regions_export_to_nested_remat_with_the_replays_figures():
    """A hand-made plan (the planner cuts stages elsewhere) whose stages are modules: Outer_0
    one checkpoint keeping its input, inside it Residual_1 keeping its projections, and
    Outer_2 keeping every dot. Exported, it is nn.remat(Outer) holding nn.remat(Residual):
    the same XLA peak and FLOPs as the replay."""
    loss_fn, params, batch = _net_step()
    program = trace(loss_fn, params, *batch)
    stages = _stages_by_module(program, 2)  # Net/Outer_i/Residual_j
    at = {s.name: i for i, s in enumerate(stages)}
    r00, r01, r20, r21 = (at["_Net/Outer_0/Residual_0"], at["_Net/Outer_0/Residual_1"],
                          at["_Net/Outer_2/Residual_0"], at["_Net/Outer_2/Residual_1"])
    assert r01 == r00 + 1 and r21 == r20 + 1

    def saved(i, rule):
        return dot_outputs(program, stages[i].start, stages[i].stop, rule)

    segs = []
    i = 0
    while i < len(stages):
        if i == r00:
            kids = (Segment(r00, r00 + 1, STORE), Segment(r01, r01 + 1, DOTS_NO_BATCH,
                                                          saved(r01, DOTS_NO_BATCH)))
            segs.append(Segment(r00, r01 + 1, NOTHING, (), kids))
            i = r01 + 1
        elif i == r20:
            lo, hi = stages[r20].start, stages[r21].stop
            segs.append(Segment(r20, r21 + 1, DOTS, dot_outputs(program, lo, hi, DOTS)))
            i = r21 + 1
        else:
            segs.append(Segment(i, i + 1, STORE))
            i += 1
    plan = Plan(tuple(segs), stages, program.fingerprint(), 0, 0, 0.0, 0, 1.0)
    exported = export_flax(plan, program)
    assert exported.exact, exported.problems
    assert [w.scope for w in exported.wraps] == ["Outer_0", "Outer_2"]
    assert [w.scope for w in exported.wraps[0].nested] == ["Outer_0/Residual_1"]
    assert exported.wraps[0].policy.keep == frozenset()
    assert exported.wraps[1].policy.builtin == "jax.checkpoint_policies.dots_saveable"
    optimizer = optax.sgd(0.1)
    replay = rp.measure(plan.apply(loss_fn), params, batch, optimizer)
    policies = [(w.scope, w.policy) for w in exported.all_wraps()]
    hand_loss, _, _ = _net_step(policies)
    hand = rp.measure(hand_loss, params, batch, optimizer)
    plain = rp.measure(loss_fn, params, batch, optimizer)
    assert _close(hand.peak_bytes, replay.peak_bytes), (hand, replay)
    assert _close(hand.flops, replay.flops), (hand, replay)
    assert not _close(plain.flops, replay.flops)  # the plan does recompute


def test_same_shaped_values_kept_and_recomputed_are_not_exported():
    """_Pair keeps its first projection but recomputes the second, same primitive and
    shapes: no predicate on (primitive, shapes) says which, so the export refuses."""
    model = _Pair()

    def loss_fn(params, x):
        return model.apply({"params": params}, x).sum()

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"])
    program = trace(loss_fn, params, x)
    n = len(program.eqns)
    spans = [i for i, e in enumerate(program.eqns) if e.module_path.startswith("_Pair")]
    lo, hi = spans[0], spans[-1] + 1
    assert all(program.eqns[i].module_path.startswith("_Pair") for i in range(lo, hi))
    dots = dot_outputs(program, lo, hi, DOTS)
    assert len(dots) == 2
    stages = tuple(s for s in (StageInfo(0, lo, "pre"), StageInfo(lo, hi, "_Pair"),
                               StageInfo(hi, n, "post")) if s.stop > s.start)
    k = [s.name for s in stages].index("_Pair")
    segs = tuple(Segment(i, i + 1, DOTS_NO_BATCH, dots[:1]) if i == k else
                 Segment(i, i + 1, STORE) for i in range(len(stages)))
    plan = Plan(segs, stages, program.fingerprint(), 0, 0, 0.0, 0, 1.0)
    exported = export_flax(plan, program)
    assert not exported.exact and not exported.wraps
    assert "cannot tell apart" in exported.problems[0]
    # both kept: exported, and the built-in that keeps the same values is named
    segs = tuple(Segment(i, i + 1, DOTS_NO_BATCH, dots) if i == k else s
                 for i, s in enumerate(segs))
    exported = export_flax(Plan(segs, stages, program.fingerprint(), 0, 0, 0.0, 0, 1.0), program)
    assert exported.exact and exported.wraps[0].policy.builtin == \
        "jax.checkpoint_policies.dots_with_no_batch_dims_saveable"


def test_rendered_python_decides_as_the_policy(selfattn):
    """The pasted code's policy functions answer as the policy objects on every equation
    of the step, and keep something."""
    m, an = selfattn
    plan = module_plan(m.loss_fn, m.params, m.batch, int(0.75 * an.noremat.peak_bytes),
                       m.optimizer, analysis=an)
    exported = plan.to_flax(an)
    code = exported.to_python()
    scope = {}
    exec(compile(code, "<exported>", "exec"), scope)
    fns = [v for k, v in scope.items() if k.startswith("policy_") and callable(v)]
    objs = list(dict.fromkeys(w.policy for w in exported.all_wraps()))
    assert len(fns) == len(objs)
    kept = 0
    for fn, obj in zip(fns, objs):
        for e in an.program.eqns:
            avals = [an.program.avals[v] if isinstance(v, int) else np.asarray(v.val)
                     for v in e.invars]
            assert fn(e.primitive, *avals, **e.params) == obj(e.primitive, *avals, **e.params)
            kept += obj(e.primitive, *avals, **e.params)
    assert kept > 0
    assert "nn.remat(Block" in code


class _HandGPT2(GPT2):
    """The zoo's GPT-2 (remat_planner/models/gpt2.py) as a user edits it: block h_i is
    nn.remat(Block, policy=policies[i]) where one is given."""

    policies: tuple = ()

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=pdtype, name="wte")
        wpe = nn.Embed(cfg.max_seq_len, cfg.d_model, dtype=dtype, param_dtype=pdtype, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1])[None, :])
        for i in range(cfg.n_layer):
            policy = self.policies[i] if self.policies else None
            cls = GPT2Block if policy is None else nn.remat(GPT2Block, policy=policy)
            x = cls(cfg.n_head, dtype, pdtype, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(dtype=dtype, param_dtype=pdtype, name="ln_f")(x))


def test_exported_form_on_the_gpt2_tiny_config_equals_the_replay():
    cfg = load_config("configs/gpt2-tiny.yaml")
    wl, optimizer = build_workload(cfg), make_optimizer(cfg.optimizer)
    an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, optimizer)
    budget = int(0.8 * an.noremat.peak_bytes)
    plan = module_plan(wl.loss_fn, wl.abstract_params, wl.abstract_batch, budget, optimizer,
                       analysis=an)
    exported = plan.to_flax(an)
    assert exported.exact and exported.wraps
    gcfg = _gpt2_config(cfg)
    policies = tuple(exported.policy_for(f"h_{i}") for i in range(gcfg.n_layer))
    hand = _HandGPT2(gcfg, policies)
    hand_loss = lambda params, tokens: causal_lm_loss(hand, params, tokens)
    m = rp.measure(hand_loss, wl.abstract_params, wl.abstract_batch, optimizer)
    assert _close(m.peak_bytes, plan.measured_peak_bytes), (m, plan.measured_peak_bytes)
    assert _close(m.flops, plan.measured_flops), (m, plan.measured_flops)


def _gpt2_config(cfg):
    from remat_planner.models.gpt2 import GPT2Config
    return GPT2Config(**cfg.model)


def test_an_infeasible_whole_module_budget_names_the_smallest(selfattn):
    m, an = selfattn
    with pytest.raises(InfeasibleBudgetError, match="whole modules"):
        module_plan(m.loss_fn, m.params, m.batch, an.fixed.total, m.optimizer, analysis=an)


def test_policy_for_finds_modules_by_suffix_and_refuses_ambiguity():
    p = PrimitivePolicy(frozenset())
    from remat_planner.export import FlaxExport, Wrap
    w = lambda path: Wrap(path, None, (0, 1), NOTHING, p, "")
    ex = FlaxExport((w("LM/a/Block_0"), w("LM/b/Block_0")), (), "f")
    assert ex.find("a/Block_0").path == "LM/a/Block_0"
    assert ex.policy_for("LM/b/Block_0") is p
    assert ex.policy_for("Block_7") is None
    with pytest.raises(KeyError, match="2 wrapped modules"):
        ex.find("Block_0")


def test_command_line_prints_the_exported_form(capsys):
    assert main(["configs/gpt2-tiny.yaml", "--budget", "24MB", "--python"]) == 0
    out = capsys.readouterr().out
    assert "XLA peak" in out and "def policy_0(prim, *avals, **params)" in out
    # the blocks it wraps by name (which ones depends on the plan), or why it cannot
    assert re.search(r"^# h_\d+: nn.remat\(Block", out, re.M) or "NOT EXPORTED" in out


def test_the_example_plans_whole_blocks_and_its_hand_written_form_matches():
    """examples/own_training_loop.py writes its blocks as modules: the planner's own plan
    (rp.plan, not module_plan) exports exactly, and the example's nn.remat form compiles to
    the replay's XLA peak and FLOPs."""
    from example_runner import run_example

    result = run_example(steps=1, name="own_training_loop_export")
    plan, exported, hand = result["plan"], result["exported"], result["by_hand"]
    assert exported.exact and exported.wraps
    assert all(w.class_name == "ResidualBlock" for w in exported.wraps)
    assert _close(hand.peak_bytes, plan.measured_peak_bytes)
    assert _close(hand.flops, plan.measured_flops)


def test_mixed_rules_per_block_on_an_hf_style_bert_equal_the_replay():
    """bert_encoder (tests/corpus.py: HF-style module tree, stock
    nn.MultiHeadDotProductAttention): at 75% of the no-remat peak the whole-module plan
    keeps different values in different layers (attention's probs @ values in some, every
    dot in others), each layer's policy told apart by shapes alone, and the model's own
    nn.remat(BertLayer, policy=...) compiles to the replay's figures. (At 80%, with the
    gradients charged where they exist, every layer keeps every dot.)"""
    m = corpus.get("bert_encoder")
    an = rp.analyze(m.loss_fn, m.params, m.batch, m.optimizer, has_aux=m.has_aux)
    plan = module_plan(m.loss_fn, m.params, m.batch, int(0.75 * an.noremat.peak_bytes),
                       m.optimizer, analysis=an)
    exported = plan.to_flax(an, m.loss_fn, m.params, m.batch)
    assert exported.exact
    assert {w.class_name for w in exported.wraps} == {"BertLayer"}
    policies = tuple(exported.policy_for(f"encoder/layer/{i}") for i in range(m.n_blocks))
    assert len({p for p in policies if p is not None}) >= 2, "expected different rules per layer"
    hand = rp.measure(m.make_remat_loss(policies), m.params, m.batch, m.optimizer, m.has_aux)
    assert _close(hand.peak_bytes, plan.measured_peak_bytes), (hand, plan.measured_peak_bytes)
    assert _close(hand.flops, plan.measured_flops), (hand, plan.measured_flops)
