"""Scan over layers: a model whose blocks are one `nn.scan` is planned as one stage whose
keep options are scan schemes (remat_planner/scan.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat_planner as rp
from remat_planner import planner, scan
from remat_planner.baselines import builtin_loss
from remat_planner.step import Step
from remat_planner.errors import PlanMismatchError
from remat_planner.memory import profile_stages, simulate
from remat_planner.models.gpt2_workload import GPT2Settings, build_gpt2
from remat_planner.constants import MAX_LAYERS_PER_ITERATION
from remat_planner.plan import (NOTHING, STORE, Plan, ScanPart, ScanScheme, Segment, is_scan_option,
                                layer_policies, mixed_name, validate_segments)
from remat_planner.solve import ChainSolver
from remat_planner.trace import trace
from remat_planner.verify import measure

# Whole-step compiles at several budgets: left out of the README's test command, run by
# .ci/run's second part (`-m slow`).
pytestmark = pytest.mark.slow

OPT = optax.adamw(1e-3)


def gpt2(scan_layers: bool, n_layer: int = 4, d_model: int = 64, batch: int = 4, seq: int = 64):
    settings = GPT2Settings(vocab_size=256, n_layer=n_layer, n_head=4, d_model=d_model,
                            max_seq_len=128, scan_layers=scan_layers)
    return build_gpt2(settings, batch, seq)


@pytest.fixture(scope="module")
def scanned():
    return gpt2(True)


@pytest.fixture(scope="module")
def analysis(scanned):
    """Calibrated analysis of the scanned tiny GPT (two whole-step compiles)."""
    return rp.analyze(scanned.loss_fn, scanned.abstract_params, scanned.abstract_batch, OPT)


@pytest.fixture(scope="module")
def real_inputs(scanned):
    params = scanned.init_params(jax.random.key(0))
    return params, scanned.synthetic_batch(jax.random.key(1))


@pytest.fixture(scope="module")
def reference(scanned, real_inputs):
    """Loss and gradients of the unplanned step on real inputs."""
    params, batch = real_inputs
    return jax.jit(jax.value_and_grad(scanned.loss_fn))(params, *batch)


def _scan_stage(an) -> int:
    """The stage with per-iteration (scan) options."""
    return next(i for i, s in enumerate(an.chain.stages)
                if any(is_scan_option(o.name) for o in s.options))


def _plan_with(an, option: str, params, batch) -> Plan:
    k = _scan_stage(an)
    segs = tuple(Segment(i, i + 1, option if i == k else STORE) for i in range(an.chain.n))
    return planner.plan_from_segments(an, segs, 0, 0, params, batch)


def _assert_grads_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Recognising the layer stack
# ---------------------------------------------------------------------------------------

def test_layer_scan_is_found_and_becomes_one_stage(scanned, analysis):
    program = analysis.program
    index = scan.find_layer_scan(program)
    assert program.eqns[index].name == "scan" and program.eqns[index].params["length"] == 4
    k = _scan_stage(analysis)
    stage = analysis.cost.stages[k]
    assert (stage.start, stage.stop) == (index, index + 1)
    assert stage.name == "GPT2/h"
    names = [o.name for o in analysis.chain.stages[k].options]
    assert names[:2] == [STORE, NOTHING] and all(is_scan_option(n) for n in names[2:])
    # nested (sqrt(n)) schemes and mixed per-layer plans (a split in two scans, or
    # iterations of several layers; the latter copy no parameters and usually win)
    assert any("/" in n for n in names) and any("+" in n or ";" in n for n in names)


def test_bfloat16_layer_stack_is_found():
    """numpy's issubdtype does not know bfloat16 is floating; the carry check must."""
    settings = GPT2Settings(vocab_size=256, n_layer=4, n_head=4, d_model=64, max_seq_len=128,
                            scan_layers=True, dtype="bfloat16")
    wl = build_gpt2(settings, 2, 16)
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    assert scan.find_layer_scan(program) is not None


def test_other_scans_and_unrolled_models_are_left_alone():
    unrolled = gpt2(False)
    assert scan.find_layer_scan(trace(unrolled.loss_fn, unrolled.abstract_params,
                                      *unrolled.abstract_batch)) is None

    def loss(w, x):  # a running sum: a scan holding a sliver of the FLOPs
        h = jnp.tanh(x @ w) @ w
        total, _ = jax.lax.scan(lambda c, row: (c + row, None), jnp.zeros(h.shape[1]), h)
        return jnp.sum(total)

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    assert scan.find_layer_scan(trace(loss, w, x)) is None


def test_planning_work_does_not_grow_with_layers():
    """The body is profiled once: 4 and 16 layers give the same chain of three stages and
    the same per-iteration plans; only the split points and nestings differ."""
    stacks = []
    for n in (4, 16):
        wl = gpt2(True, n_layer=n)
        an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, None,
                        measure_xla=False, calibrate=False)
        assert an.chain.n == 3
        program = an.program
        stacks.append(scan.profile_layer_stack(program, scan.find_layer_scan(program),
                                               measure_xla=False))
    assert [p.name for p in stacks[0].plans] == [p.name for p in stacks[1].plans]
    assert stacks[0].plans == stacks[1].plans


# ---------------------------------------------------------------------------------------
# Schemes and their model
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["scan:12xnothing|nothing", "scan:12xdots|store/3",
                                    "scan:12x(nothing|nothing)/2/3",
                                    "scan:5xstore|store+7xnothing|dots_no_batch/7",
                                    "scan:12x[dots_no_batch]/4",
                                    "scan:12x2*nothing|nothing;dots|store/2",
                                    "scan:12xstore|store;(nothing|nothing)"])
def test_scheme_names_round_trip(option):
    scheme = ScanScheme.parse(option)
    assert scheme.option == option and scheme.length == 12


@pytest.mark.parametrize("option", ["scan:", "scan:12", "scan:3xnothing/2", "scan:4xnothing/1",
                                    "scan:4xNothing", "scan:4xnothing+", "scan:4xnothing;",
                                    "scan:4x0*nothing", "scan:3xnothing;nothing",
                                    "scan:4xnothing;store/4"])
def test_bad_scheme_names_are_refused(option):
    with pytest.raises(ValueError):
        ScanScheme.parse(option)
    with pytest.raises(ValueError):  # what Plan.from_json checks a plan file's segments with
        validate_segments((Segment(0, 1, STORE), Segment(1, 2, option)), 2)
    with pytest.raises(ValueError, match="exactly one stage"):
        validate_segments((Segment(0, 2, "scan:4xnothing|nothing"),), 2)


def test_plan_file_with_a_scan_scheme_round_trips(analysis, scanned):
    plan = _plan_with(analysis, "scan:2xdots|store+2xnothing|nothing", scanned.abstract_params,
                      scanned.abstract_batch)
    assert Plan.from_json(plan.to_json()) == plan


def test_unknown_per_iteration_option_is_a_plan_mismatch(analysis, scanned, real_inputs):
    plan = _plan_with(analysis, "scan:4xnothing|dots", scanned.abstract_params,
                      scanned.abstract_batch)  # the MLP half has no batched dots
    params, batch = real_inputs
    with pytest.raises(PlanMismatchError, match="no keep option 'dots'"):
        plan.apply(scanned.loss_fn)(params, *batch)


def test_frontier_is_scheme_cost_of_its_schemes_and_undominated(analysis):
    program = analysis.program
    stack = scan.profile_layer_stack(program, scan.find_layer_scan(program), measure_xla=False)
    frontier = scan.frontier_schemes(stack)
    points = []
    for scheme, cost in frontier:
        assert scan.scheme_cost(stack, scheme) == cost
        points.append((cost.keep_bytes, cost.peak_bytes, cost.recompute_flops))
    for i, p in enumerate(points):
        assert not any(j != i and all(a <= b for a, b in zip(q, p)) and q != p
                       for j, q in enumerate(points))


def _model_and_xla(an, scanned, option):
    """The calibrated model's own peak and recompute FLOPs for the plan with `option` on the
    layer stack (no closed-loop correction), and XLA's peak and FLOPs of that step."""
    plan = _plan_with(an, option, scanned.abstract_params, scanned.abstract_batch)
    act, flops = simulate(an.chain_for(plan.segments, chain=an.chain), plan.segments)
    m = measure(plan.apply(scanned.loss_fn), scanned.abstract_params, scanned.abstract_batch, OPT)
    return an.predicted_peak(act), flops, m.peak_bytes, m.flops


def test_nested_scheme_recomputes_one_more_forward_per_level_by_xla(analysis, scanned):
    """Nesting the flat scheme in groups of 2 (`.../2`) recomputes, by XLA's FLOPs, what
    the model says: one more forward of every layer (measured: XLA +122,808,325 FLOPs,
    the model +122,800,132)."""
    _, flat_model, _, flat_xla = _model_and_xla(analysis, scanned, "scan:4xnothing|nothing")
    _, nested_model, _, nested_xla = _model_and_xla(analysis, scanned,
                                                    "scan:4xnothing|nothing/2")
    assert nested_xla - flat_xla == pytest.approx(nested_model - flat_model, rel=0.01)
    assert nested_model - flat_model == pytest.approx(4 * analysis.scan_chain.stack.body_flops,
                                                      rel=0.05)


@pytest.mark.xfail(strict=True, reason=(
    "the model puts the nested scheme at 5,581,999 B where XLA puts it at 6,387,088 B "
    "(above the flat scheme's 5,764,296 B, which the calibrated model puts to the byte): "
    "-12.6% on `scan:4xnothing|nothing/2`. XLA's own live-range report puts the most bytes live at "
    "once lower nested (5,202,224 B) than flat (5,259,056 B), as the model does, while "
    "its allocations grow by 622,904 B: the miss is in how XLA packs buffers into "
    "allocations (or in buffers that report leaves out), not a buffer the report shows"))
def test_nested_scheme_peak_predicted_within_5pct(analysis, scanned):
    model, _, xla, _ = _model_and_xla(analysis, scanned, "scan:4xnothing|nothing/2")
    assert abs(model / xla - 1) <= 0.05, (model, xla)


@pytest.fixture(scope="module")
def wider():
    """A scanned 6-layer GPT whose activations outweigh its parameters (d 128, batch
    8 x 128: one layer's `dots_no_batch|dots_no_batch` keeps 5.2 MB, its parameters
    0.8 MB), and its calibrated analysis."""
    m = gpt2(True, n_layer=6, d_model=128, batch=8, seq=128)
    return m, rp.analyze(m.loss_fn, m.abstract_params, m.abstract_batch, OPT)


@pytest.mark.slow
def test_mixed_iterations_predicted_within_3_5pct(wider):
    """Iterations of 2 and 3 layers, predicted against XLA: XLA slices the iteration's
    residuals out of the stack while the stack stays whole, so the layers not yet
    differentiated are held twice (scan.mixed_plan). Measured -1.02%, +0.08% and -3.18%;
    -8.3%, -13.4% and -8.6% before the copies were charged."""
    m, an = wider
    for option in ("scan:6x2*dots_no_batch|dots_no_batch", "scan:6x3*dots_no_batch|dots_no_batch",
                   "scan:6x2*nothing|dots_no_batch"):
        model, _, xla, _ = _model_and_xla(an, m, option)
        assert abs(model / xla - 1) <= 0.035, (option, model, xla)


def test_whole_body_checkpoints_run_one_layer_per_iteration():
    """No scheme on the stack's frontier puts a whole-body checkpoint (`[rule]`) among
    several layers of one iteration: XLA recomputes them together (measured on the
    `wider` stack: `2*[dots_no_batch]` -10.2%, `3*[dots_no_batch]` -24.7%,
    `[dots_no_batch];nothing|nothing` -16.1% from the model), while one layer per
    iteration stays in the plan space (what nn.remat(Block) inside nn.scan runs)."""
    wl = gpt2(True, n_layer=6, d_model=128, batch=8, seq=128)
    program = trace(wl.loss_fn, wl.abstract_params, *wl.abstract_batch)
    stack = scan.profile_layer_stack(program, scan.find_layer_scan(program), measure_xla=False)
    whole = {p.name for p in stack.plans if p.whole_body}
    assert whole  # the whole-body checkpoints were measured
    schemes = [sch for sch, _ in scan.frontier_schemes(stack)]
    single = {part.policy for sch in schemes for part in sch.parts
              if len(layer_policies(part.policy)) == 1}
    assert single & whole
    for sch in schemes:
        for part in sch.parts:
            layers = layer_policies(part.policy)
            if len(layers) > 1:
                assert not set(layers) & whole, part.policy


def test_mixed_iteration_model():
    """`a;2*b`: three layers per iteration; kept bytes and recompute add up, and the peak
    is the worst layer's backward with the earlier layers' keeps held."""
    assert layer_policies("a|b;2*c|d") == ["a|b", "c|d", "c|d"]
    assert mixed_name(["a|b", "c|d", "c|d"]) == "a|b;2*c|d"
    part = ScanPart(12, "x;2*y", (2,))
    assert (part.layers_per_iteration, part.iterations, part.n_groups) == (3, 4, 2)


def test_mixed_plans_are_in_the_frontier_and_priced_as_their_layers(analysis):
    index = scan.find_layer_scan(analysis.program)
    st = scan.profile_layer_stack(analysis.program, index, measure_xla=False)
    a, b = st.plan("dots|dots_no_batch"), st.plan("nothing|nothing")
    mixed = scan.part_cost(st, ScanPart(st.length, f"{a.name};{b.name}"))
    # the layers' keeps add up; their parameter slices are taken inside the checkpoints,
    # so the parameters are not copied (apply.body_step(take=j))
    assert mixed.keep_bytes == st.length // 2 * (a.keep_bytes + b.keep_bytes)
    assert mixed.recompute_flops == pytest.approx(st.length // 2 * (a.recompute_flops
                                                                     + b.recompute_flops))
    schemes = {sch.option for sch, _ in scan.frontier_schemes(st)}
    assert any(";" in o for o in schemes)


def test_mixed_iteration_copies_no_parameters(analysis, scanned):
    """Two layers per iteration with different plans (`a;b`, b keeping less than a):
    each layer's parameter slice is taken inside its checkpoints, so the parameters are
    not copied and the mixed scan peaks below the `a` scan. Slices taken outside the
    checkpoints were stacked by the scan, one copy of the parameters: on this model the
    mixed scan then peaked at 9,521,096 bytes, above the `a` scan's 9,309,984 (now
    8,865,640); on GPT-2 small at +340 MB (now 9.102 GiB, between the `a` and `b`
    scans' 9.243 and 8.961 GiB)."""
    st = analysis.scan_chain.stack
    peaks = {}
    for option in ("dots|dots_no_batch", "nothing|nothing", "dots|dots_no_batch;nothing|nothing"):
        plan = _plan_with(analysis, f"scan:{st.length}x{option}", scanned.abstract_params,
                          scanned.abstract_batch)
        peaks[option] = rp.measure(plan.apply(scanned.loss_fn), scanned.abstract_params,
                                   scanned.abstract_batch, OPT).peak_bytes
    assert peaks["nothing|nothing"] < peaks["dots|dots_no_batch"]
    assert peaks["dots|dots_no_batch;nothing|nothing"] < peaks["dots|dots_no_batch"], peaks


def test_whole_block_keep_rule_is_jax_policy_on_the_block(analysis):
    """`[dots_no_batch]` is one checkpoint over the block keeping its dots without batch
    dims, as nn.remat(block, policy=dots_with_no_batch_dims_saveable) in nn.scan: its
    recompute is the attention's batched dots, at least the per-sub-stage plan's."""
    index = scan.find_layer_scan(analysis.program)
    st = scan.profile_layer_stack(analysis.program, index, measure_xla=False)
    names = [p.name for p in st.plans]
    assert "[dots_no_batch]" in names and "[dots]" in names
    whole, split = st.plan("[dots_no_batch]"), st.plan("dots_no_batch|dots_no_batch")
    assert 0 < whole.recompute_flops and whole.recompute_flops >= split.recompute_flops * 0.99
    assert st.plan("[dots]").recompute_flops < whole.recompute_flops


# ---------------------------------------------------------------------------------------
# Exact gradients, XLA peak within budget
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", [
    "scan:4xdots|dots_no_batch",          # flat, named values kept
    "scan:4x(store|nothing)/2",           # sqrt(n): groups of 2, a region per iteration
    "scan:2xdots|store/2+2xnothing|nothing",        # split: a nested part + a flat part
    "scan:4xnothing|nothing/2/2",         # three levels (one group of 2 x 2)
    "scan:2x[dots_no_batch]+2x[dots]",    # one checkpoint per block under a keep rule
    "scan:4xdots|store;nothing|nothing",  # two layers per iteration, each its own plan
    "scan:4xdots|dots_no_batch;store|store/2",  # ... and grouped (sqrt(n) over pairs)
    NOTHING,                              # one checkpoint around the whole scan
])
def test_planned_gradients_are_exact(option, analysis, scanned, real_inputs, reference):
    params, batch = real_inputs
    plan = _plan_with(analysis, option, scanned.abstract_params, scanned.abstract_batch)
    want_loss, want = reference
    got_loss, got = jax.jit(jax.value_and_grad(plan.apply(scanned.loss_fn)))(params, *batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_grads_equal(got, want)


@pytest.mark.slow
def test_xla_peak_within_budget_at_three_budgets(analysis, scanned, real_inputs, reference):
    lo, hi = analysis.min_feasible_budget(), analysis.noremat.peak_bytes
    assert lo < hi
    own = dataclasses.replace(analysis, verified={})  # no plans measured by other tests
    plans = []
    for frac in (0.2, 0.5, 0.8):
        budget = int(lo + frac * (hi - lo))
        p = rp.plan(scanned.loss_fn, scanned.abstract_params, scanned.abstract_batch, budget,
                    OPT, analysis=own)
        assert p.measured_peak_bytes <= budget, (budget, p.measured_peak_bytes, p.segments)
        plans.append(p)
    assert any(is_scan_option(s.option) for p in plans for s in p.segments)
    assert plans[0].recompute_flops >= plans[-1].recompute_flops
    params, batch = real_inputs
    _assert_grads_equal(jax.jit(jax.grad(plans[0].apply(scanned.loss_fn)))(params, *batch),
                        reference[1])


# ---------------------------------------------------------------------------------------
# The same model unrolled and scanned
# ---------------------------------------------------------------------------------------

def _as_scan_body(an):
    """The analysis's chain with its stages profiled as a scanned body's sub-stages are
    (scan.body_chain): a stored stage keeps JAX's residual list, and the forward's
    workspace is the forward and backward's compiled together (memory.profile_stages'
    `xla_keeps` and `forward_alone`)."""
    body = profile_stages(an.program, an.cost, xla_keeps=False, forward_alone=False)
    stages = tuple(dataclasses.replace(s, fwd_temp_bytes=b.fwd_temp_bytes, options=(
        dataclasses.replace(s.options[0], keep_bytes=b.options[0].keep_bytes),
        *s.options[1:])) for s, b in zip(an.chain.stages, body.stages))
    return dataclasses.replace(an.chain, stages=stages)


@pytest.mark.slow
def test_unrolled_and_scanned_plans_cost_the_same():
    """Both models of the same 8-layer GPT (uncalibrated: the same jax.vjp residuals and
    per-sub-stage XLA workspaces) give plans of equal recompute cost within 2%. (An
    unrolled stored stage is charged what XLA keeps, fewer bytes than the scan's stacked
    residuals, and its forward's own workspace: here the unrolled stages are profiled
    as the scan's body is, so that the solvers see the same stages.)

    How the budgets are picked: all of them, 41 from the smallest budget both can meet
    to eps below the smaller no-remat peak (at the peak itself the DP's rounding of
    sizes to memory units decides whether storing everything fits). The two frontiers
    are staircases that coincide except near their steps, where the scanned one lags: a
    scan split in two copies its slices of the stacked parameters and concatenates
    their gradients (up to 2 X in the model, X = the stacked block parameters, 1.6 MB
    here), the unrolled program's edges differ by a carry (block 0 shares the
    embedding's stage and keeps no input), and a scan mixes at most two per-layer plans
    where unrolled blocks each pick theirs, and an iteration of g layers holds the
    cotangent of its parameter slice (scan.mixed_cotangent_bytes, up to 7 layers'
    parameters = 7/8 X at g = 4), which unrolled blocks do not. So at every budget each
    planner matches the other's cost within 2% given eps = 2 X + 7/8 X + 2 carries more
    (measured before the cotangent term: the scan needed up to 2.02 X, the unrolled
    planner none), and at the same budget they are equal within 2% on a quarter of the
    grid or more: 12 of 41 measured, 13 or more before an iteration of g layers was
    also charged the working copies of its residuals (scan.mixed_plan, which XLA
    holds: test_mixed_iterations_predicted_within_3_5pct), which unrolled blocks do not
    need either, so the scan meets the same cost a little less often.
    """
    solvers = []
    for scan_layers in (False, True):
        wl = gpt2(scan_layers, n_layer=8, batch=8, seq=128)
        an = rp.analyze(wl.loss_fn, wl.abstract_params, wl.abstract_batch, OPT, calibrate=False)
        chain = an.chain if scan_layers else _as_scan_body(an)
        act = simulate(chain, tuple(Segment(i, i + 1, STORE) for i in range(chain.n)))[0]
        solvers.append((an, act, ChainSolver(chain, act)))
    (au, act_u, su), (as_, act_s, ss) = solvers
    program = as_.program
    stack = scan.profile_layer_stack(program, scan.find_layer_scan(program), measure_xla=False)
    mixed = max(scan.mixed_cotangent_bytes(stack, g)
                for g in range(2, min(stack.length - 1, MAX_LAYERS_PER_ITERATION) + 1)
                if stack.length % g == 0)
    eps = 2 * stack.length * stack.xs_bytes + mixed + 2 * stack.carry_bytes
    lo = max(su.min_feasible_bytes(), ss.min_feasible_bytes())
    hi = min(act_u, act_s)
    assert eps < 0.05 * (hi - lo)

    def cost(solver, budget):
        sol = solver.solve(int(budget))
        return np.inf if sol is None else sol.recompute_flops

    close = lambda a, b: a <= 1.02 * b + 1e-6 * au.step_flops
    equal = 0
    for budget in np.linspace(lo, hi - eps, 41):
        cu, cs = cost(su, budget), cost(ss, budget)
        assert close(cost(ss, budget + eps), cu), (budget, cu, cs)
        assert close(cost(su, budget + eps), cs), (budget, cu, cs)
        equal += close(cs, cu) and close(cu, cs)
    assert equal >= 41 // 4


# ---------------------------------------------------------------------------------------
# Built-in policies and FLOPs of scanned steps
# ---------------------------------------------------------------------------------------

def test_builtin_policy_goes_on_the_scan_body(scanned, analysis, real_inputs, reference):
    loss = builtin_loss("nothing_saveable", Step(scanned.loss_fn), scanned.abstract_params,
                        scanned.abstract_batch)
    none = analysis.noremat  # the same step without remat
    remat = measure(loss, scanned.abstract_params, scanned.abstract_batch, OPT)
    assert remat.peak_bytes < none.peak_bytes
    assert remat.flops > 1.1 * none.flops  # every block's forward runs again
    params, batch = real_inputs
    _assert_grads_equal(jax.jit(jax.grad(loss))(params, *batch), reference[1])


def test_measured_flops_count_every_iteration(analysis):
    """XLA's cost analysis counts a loop body once; measure() counts a scanned step's
    FLOPs like the unrolled step's."""
    unrolled = gpt2(False)
    flops = measure(unrolled.loss_fn, unrolled.abstract_params, unrolled.abstract_batch, OPT).flops
    assert analysis.noremat.flops == pytest.approx(flops, rel=0.02)


@pytest.mark.parametrize("option", ["scan:4xdots|dots_no_batch", "scan:4x[dots_no_batch]"])
def test_calibrated_model_predicts_schemes_it_was_not_fitted_on(analysis, scanned, option):
    """The calibration fits the model on two steps (without remat, and the stack as
    `scan:4xnothing|nothing`); a flat scheme it never measured is predicted within 5% of
    XLA's peak by the model alone (measured: -4.14% and -3.37%)."""
    model, _, xla, _ = _model_and_xla(analysis, scanned, option)
    assert abs(model / xla - 1) <= 0.05, (option, model, xla)


def test_fixed_memory_counts_the_parameters(analysis, scanned):
    """Parameter bytes are the abstract parameters' own (898,560 B here), stacked layer
    weights included."""
    want = sum(int(np.prod(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(scanned.abstract_params))
    assert analysis.fixed.params_bytes == want
