"""The pipeline end to end: trace -> graph -> memory -> solve -> apply -> verify.

`plan()` is the public entry point. It solves against the memory model, then compiles
the planned step and reads XLA's peak; when XLA's peak exceeds the budget it tightens
the solver's budget by the measured excess and solves again (a bounded number of
rounds), so a plan is never returned as fitting when XLA says it does not.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from . import baselines, scan
from .apply import input_signature
from .budget import parse_budget, units_of
from .constants import (MAX_PROBES, MAX_VERIFY_COMPILES, PER_BLOCK_FIRST_MARGIN,
                        PER_BLOCK_MARGIN, PROBE_MARGIN,
                        REUSE_TOLERANCE, SLACK_STOP)
from .costmodel import CostModel, resolve as resolve_cost_model
from .describe import sub_stage_labels
from .options import ScanPart, ScanScheme, Store
from .errors import InfeasibleBudgetError
from .graph import CostGraph, build_cost_graph
from .graph import jaxpr_bytes, jaxpr_flops
from .memory import (ChainModel, FixedMemory, StageProfile, carried_values, fixed_memory,
                     per_parameter_update, profile_stages, scale_chain, scaled_workspace,
                     shared_differentiated, simulate, stage_gradient_bytes, table_gradient_bytes,
                     with_carried_values, with_shared_cotangents,
                     with_gradient_timeline, with_pooling_indices, with_pooling_zeros,
                     with_random_bits,
                     weighted_chain, with_gathered_weights, with_stage_gradients,
                     with_table_gradients)
from .sharding import (ShardingSpec, batch_share, check_devices, collective_outputs,
                       gathered_bytes, rebuilds_scan, with_unpaired, with_unpaired_kernels)
from .plan import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING, STORE, Plan, ScanOption, Segment,
                   StageInfo)
from .solve import ChainSolver, Solution
from .trace import Program, trace
from .step import Step
from .verify import Measurement, abstract, as_batch, make_step, measure_step

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything measured about a step before solving; reusable across budgets."""

    program: Program
    cost: CostGraph
    chain: ChainModel
    fixed: FixedMemory
    noremat_activation_bytes: int
    step_flops: float  # forward + backward FLOPs of the unplanned step, by the cost model
    noremat: Measurement | None = None  # XLA's figures for the step without remat
    # XLA peak minus modelled peak of the step without remat: what per-stage measurement
    # misses (buffers XLA keeps across stages, fusion across stage cuts). Added to every
    # prediction; 0 when not calibrated.
    calibration_bytes: int = 0
    residual_scale: float = 1.0   # fitted scale on `store` residual bytes (see _calibrate)
    workspace_scale: float = 1.0  # fitted scale on stage workspaces (see _calibrate)
    calibration_compiles: int = 0  # whole-step compiles the calibration made (two)
    # FLOPs and memory traffic of the whole unplanned step's jaxpr (forward, backward,
    # optimizer update; graph.jaxpr_flops / jaxpr_bytes): the time model's denominator.
    step_jaxpr_flops: float = 0.0
    step_jaxpr_bytes: float = 0.0
    scan_chain: object | None = None  # scan.ScanChain of a layer-stack model (calibrated)
    # The step analysed (step.Step: loss, optimizer, has_aux, sharding). Sharded (its
    # `sharding`, a sharding.ShardingSpec): every byte figure is one device's; `pinned`
    # are the values produced by collectives, kept by every checkpoint.
    step: Step | None = None
    pinned: frozenset = frozenset()
    # XLA measurements of plans of this step, by (segments, optimizer): planning the same
    # analysis at several budgets (a frontier sweep) meets the same plans again, and a
    # compile is the expensive part of verifying one. The calibration's checkpointed
    # step is one of them.
    verified: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def sharding(self) -> ShardingSpec | None:
        """The analysed step's sharding.ShardingSpec, or None (unsharded)."""
        return self.step.sharding if self.step is not None else None

    def cost_chain(self, cost_model: CostModel) -> ChainModel:
        """The chain whose recompute costs are in `cost_model`'s units (FLOPs, or
        FLOP-equivalents of time: memory.weighted_chain; a layer stack's schemes are
        re-derived from its weighted body)."""
        w = cost_model.bytes_weight
        if not w:
            return self.chain
        chain = weighted_chain(self.chain, w)
        if self.scan_chain is None:
            return chain
        sc = dataclasses.replace(self.scan_chain, chain=chain)
        return sc.with_stack(scan.weighted(self.scan_chain.stack, w)).chain

    def chain_for(self, segments, cost_model: CostModel | str | None = None,
                  chain: ChainModel | None = None) -> ChainModel:
        """The chain in `cost_model`'s units (`chain` if already built) in which every
        scan scheme that `segments` use is an option, so simulate() accepts a plan
        solved with either objective."""
        model = resolve_cost_model(cost_model)
        chain = self.cost_chain(model) if chain is None else chain
        if self.scan_chain is None:
            return chain
        names = _scan_options(segments)
        if not names:
            return chain
        w = model.bytes_weight
        stack = scan.weighted(self.scan_chain.stack, w) if w else self.scan_chain.stack
        return scan.with_schemes(chain, self.scan_chain.stage, stack, names)

    def step_seconds(self, cost_model: CostModel) -> float:
        """The time model's seconds for the unplanned step."""
        return cost_model.seconds(self.step_jaxpr_flops, self.step_jaxpr_bytes)

    @property
    def noremat_predicted_peak(self) -> int:
        return self.predicted_peak(self.noremat_activation_bytes)

    def predicted_peak(self, activation_bytes: int) -> int:
        return (self.fixed.total + max(activation_bytes, self.fixed.update_bytes)
                + self.calibration_bytes)

    def min_feasible_budget(self) -> int:
        """The smallest whole-step budget the model finds a plan for."""
        solver = ChainSolver(self.chain, max(self.noremat_activation_bytes, 1))
        return self.predicted_peak(solver.min_feasible_bytes() or 0)

    @property
    def stage_infos(self) -> tuple[StageInfo, ...]:
        return tuple(StageInfo(s.start, s.stop, s.name) for s in self.cost.stages)


def analyze(loss_fn: Callable, params, batch, optimizer=None, *, measure_xla: bool = True,
            calibrate: bool = True, progress: Progress | None = None,
            has_aux: bool = False, mesh=None, sharding=None,
            profiles: dict | None = None) -> Analysis:
    """Trace, build the cost graph and profile every stage (nothing allocated).

    With `calibrate`, two whole steps are compiled (without remat, and with every stage
    but the last checkpointed) and the memory model is fitted to XLA's peaks (_calibrate);
    for a model whose layers are one scan, the second step checkpoints the scan's body
    instead and the two compile side by side (_calibrate_scan).
    With `has_aux`, loss_fn returns `(loss, aux)`; aux (e.g. new batch statistics) is
    returned by the step and counted with fixed memory.
    With `mesh` and `sharding` (e.g. "data=4,model=2" and "fsdp"; see sharding.py) the
    step is the SPMD step on that mesh and every figure is per device: fixed memory is
    each tensor's shard, activations are divided by the batch split, and the
    calibration compiles are the sharded step's.
    With `profiles`, a dict the caller keeps, stage profiles are reused across analyses
    of the same program (one per sharding scheme, say); without it nothing is carried
    from one call to the next.
    """
    step = Step.make(loss_fn, optimizer, has_aux, mesh, sharding)
    batch = as_batch(batch)
    say = progress or (lambda msg: None)
    check_devices(step.sharding)  # the device count must match before anything else
    say("tracing")
    program = trace(loss_fn, params, *batch, has_aux=has_aux)
    step = step.replace(sharding=with_unpaired_kernels(step.sharding, program, params))
    spec = step.sharding
    cost = build_cost_graph(program)
    say(f"{len(program.eqns)} equations, {len(cost.stages)} stages")
    fixed = fixed_memory(params, batch, optimizer, sharding=spec)
    pinned = collective_outputs(program, params, spec)
    if has_aux:
        fixed = dataclasses.replace(fixed, aux_bytes=sum(program.nbytes(v)
                                                         for v in program.aux_outputs))
    scanned = scan.profile_chain(program, cost, measure_xla=measure_xla, progress=say,
                                 profiles=profiles)
    if scanned is not None and spec is not None:
        # one device's share of the batch; what tensor parallelism splits further, the
        # gathered weight slices and the kept collective outputs are left to the
        # calibration compiles, which are the sharded step's (_calibrate_scan)
        scanned = scan.scaled(scanned, batch_share(spec))
    if scanned is not None:  # the layers are one scan: a stage whose options are scan schemes
        cost, chain = scanned.cost, scanned.chain
    else:
        # values crossing cuts undifferentiated (masks, position ids): one buffer each,
        # charged along the step, not per region (docs/jax-facts.md, fact 11); a sharded
        # step keeps them in its boundaries (one device's share, scale_chain)
        carried = carried_values(program, cost) if spec is None else {}
        # differentiated values every copy of a block reads (an encoder's output): one
        # buffer the same way, and one for their cotangent (shared_differentiated)
        shared = shared_differentiated(program, cost) if spec is None else {}
        carried |= {v: (d, first, b) for v, (d, first, _, b) in shared.items()}
        chain = profile_stages(program, cost, measure_xla=measure_xla, progress=say,
                               pinned=pinned, profiles=profiles, carried=frozenset(carried))
        chain = with_shared_cotangents(with_carried_values(chain, carried), shared)
        if spec is not None:  # one device's share of the batch (calibration fits the rest)
            chain = scale_chain(chain, batch_share(spec))
            chain = with_gathered_weights(chain, program, cost,
                                          gathered_bytes(program, params, spec))
    # gathered tables' gradients: charged from the step's start (fact 12), not with
    # their stage's own
    tables = (table_gradient_bytes(program, cost) if optimizer is not None and spec is None
              else (0,) * len(cost.stages))
    if optimizer is not None and spec is None:
        # Gradients along the step (docs/jax-facts.md, fact 3): none exists in the forward.
        # Under a per-parameter update each stage's own gradients live through its
        # backward only, the rest through the whole backward; an update that reads every
        # gradient (clip_by_global_norm) holds each from its stage's backward to the end.
        # (With jax.grad alone the gradients are the step's outputs, which XLA allocates
        # for the whole step: they stay in fixed memory.)
        own = stage_gradient_bytes(program, cost)
        held = None
        if per_parameter_update(optimizer, params):
            chain = with_stage_gradients(chain, [o - t for o, t in zip(own, tables)])
            fixed = dataclasses.replace(fixed, staged_grads_bytes=sum(own))
        else:
            held = own
        fixed = dataclasses.replace(fixed, timed_grads_bytes=fixed.grads_bytes
                                    - fixed.staged_grads_bytes)
        chain = with_gradient_timeline(chain, fixed.timed_grads_bytes, held)
    if spec is None:
        # made ahead at the step's start: random bits, and the index arrays of max
        # poolings' gradients (docs/jax-facts.md, facts 8 and 9)
        chain = with_random_bits(chain, program, cost)
        chain = with_pooling_indices(chain, program, cost)
        # zeros made at the step's start for scatters: tables' gradients, poolings'
        # (facts 12 and 15)
        chain = with_table_gradients(chain, tables)
        chain = with_pooling_zeros(chain, program, cost)
    if scanned is not None:
        scanned = dataclasses.replace(scanned, chain=chain)
    store_all = [Segment(i, i + 1, STORE) for i in range(chain.n)]
    noremat_peak, _ = simulate(chain, store_all)
    # forward + backward of the unplanned step: backward ~ 2x forward for dots
    step_flops = 3.0 * cost.total_flops
    jf, jb = step_traffic(step, params, batch)
    an = Analysis(program, cost, chain, fixed, noremat_peak, step_flops, step=step,
                  pinned=pinned, step_jaxpr_flops=jf, step_jaxpr_bytes=jb,
                  scan_chain=scanned)
    if calibrate and scanned is not None:
        an = _calibrate_scan(an, scanned, params, batch, say)
    elif calibrate:
        say("measuring the step without remat (calibration)")
        base = step
        if spec is not None:
            # The unplanned sharded step as the planner runs it: every stage stored, weights
            # all-gathered and collective outputs tagged as in a plan (apply.run_segments),
            # so the plan's figures differ from it by the remat alone.
            store_all = tuple(Segment(i, i + 1, STORE) for i in range(chain.n))
            base = step.planned(plan_from_segments(an, store_all, 0, 0, params, batch))
        noremat = measure_step(base, params, batch)
        # Sharded: XLA's FLOPs are one device's; the model's stay global (recompute too).
        flops = step_flops if spec is not None else (noremat.flops or step_flops)
        an = _calibrate(dataclasses.replace(an, noremat=noremat, step_flops=flops),
                        params, batch, say)
    return an


def _scan_options(segments) -> list[str]:
    """Scan scheme names used anywhere in a segment tree."""
    out = []
    for s in segments:
        if isinstance(s.kind, ScanOption):
            out.append(s.option)
        out.extend(_scan_options(s.children))
    return out


def step_traffic(step: Step, params, batch) -> tuple[float, float]:
    """FLOPs and memory traffic (graph.jaxpr_flops / jaxpr_bytes) of the training step of
    `step` (a step.Step: value_and_grad + optimizer update, as verify.measure compiles it),
    from its jaxpr: nothing is compiled or allocated."""
    params, batch = abstract(params), abstract(as_batch(batch))
    fn, optimizer = make_step(step.loss_fn, step.optimizer, step.has_aux), step.optimizer
    if optimizer is None:
        closed = jax.make_jaxpr(fn)(params, batch)
    else:
        closed = jax.make_jaxpr(fn)(params, jax.eval_shape(optimizer.init, params), batch)
    return jaxpr_flops(closed), jaxpr_bytes(closed)


def _calibrate_scan(an: Analysis, scanned: "scan.ScanChain", params, batch, say) -> Analysis:
    """Fit a layer-stack scan's model to XLA on two steps compiled side by side: without
    remat, and with the stack a flat scan of checkpointed bodies (scan.calibration_scheme).

    The stack's options carry their own workspaces, so _calibrate's per-stage scales do
    not apply; instead `beta` scales the iteration workspace (fitted on the checkpointed
    step, where it sets the peak) and `alpha` the plain scan's stacked residuals (fitted
    on the step without remat). Where another stage sets the checkpointed step's peak
    (the LM head), what the other stages keep is scaled to it first.
    """
    from concurrent.futures import ThreadPoolExecutor

    n, k, step = an.chain.n, scanned.stage, an.step
    store_all = [Segment(i, i + 1, STORE) for i in range(n)]
    ckpt = tuple(Segment(i, i + 1, scan.calibration_scheme(scanned.stack) if i == k else STORE)
                 for i in range(n))
    ckpt_step = step.planned(plan_from_segments(an, ckpt, 0, 0, params, batch))
    base = step
    if rebuilds_scan(an.sharding):
        # The unplanned step as plans run it: the scan rebuilt with every sub-stage stored,
        # its weight slices gathered per iteration and its collective outputs tagged
        # (apply.run_scheme), so that plans differ from it by their recomputation alone.
        store = tuple(Segment(i, i + 1, scan.store_scheme(scanned.stack) if i == k else STORE)
                      for i in range(n))
        base = step.planned(plan_from_segments(an, store, 0, 0, params, batch))
    say("measuring the step without remat and with the layer stack checkpointed (calibration)")
    with ThreadPoolExecutor(max_workers=1) as pool:  # XLA compiles release the GIL
        pending = pool.submit(measure_step, base, params, batch)
        ckpt_peak = measure_step(ckpt_step, params, batch).peak_bytes
        noremat = pending.result()

    def total(stack, segments, sc=None) -> int:
        sc = scanned if sc is None else sc
        act, _ = simulate(sc.with_stack(stack, frontier=False).chain, segments)
        return an.fixed.total + max(act, an.fixed.update_bytes)

    # Another stage's backward, the LM head's with its stored logits, may set the
    # checkpointed step's peak: fit what the other stages keep to it first (gpt2-small:
    # 0.80 of the head's profiled keep; the plans tried then within 1 MiB of XLA).
    others = lambda g: _with_other_stores(scanned, g)  # noqa: E731
    # The calibration scheme need not be on the stack's frontier: the chains fitted here
    # hold every scheme (frontier=False), as `total` does.
    fit_gamma = lambda g: total(others(g).stack, ckpt, others(g))  # noqa: E731
    if fit_gamma(0.5) != fit_gamma(1.0):
        scanned = others(_fit_scale(fit_gamma, ckpt_peak, lo=0.5))
    fit_beta = lambda b: total(scan.rescaled(scanned.stack, 1.0, b), ckpt)
    # The workspace only moves the prediction when the stack's backward sets the peak.
    beta = 1.0 if fit_beta(0.5) == fit_beta(4.0) else _fit_scale(fit_beta, ckpt_peak, lo=0.5)
    alpha = _fit_scale(lambda a: total(scan.rescaled(scanned.stack, a, beta), store_all),
                       noremat.peak_bytes, lo=0.5)
    fitted = scanned.with_stack(scan.rescaled(scanned.stack, alpha, beta))
    chain = fitted.chain
    act, _ = simulate(chain, store_all)
    offset = noremat.peak_bytes - (an.fixed.total + max(act, an.fixed.update_bytes))
    return dataclasses.replace(an, chain=chain, scan_chain=fitted, noremat=noremat,
                               step_flops=noremat.flops or an.step_flops,
                               noremat_activation_bytes=act, calibration_bytes=offset,
                               residual_scale=alpha, workspace_scale=beta,
                               calibration_compiles=2)


def _with_other_stores(sc: "scan.ScanChain", gamma: float) -> "scan.ScanChain":
    """The scan chain with what every stage but the layer stack keeps (under each of its
    options) scaled by gamma."""
    def scaled(s):
        return dataclasses.replace(s, options=tuple(
            dataclasses.replace(o, keep_bytes=int(o.keep_bytes * gamma)) for o in s.options))
    stages = tuple(s if i == sc.stage else scaled(s) for i, s in enumerate(sc.chain.stages))
    return dataclasses.replace(sc, chain=dataclasses.replace(sc.chain, stages=stages))


def _scaled(chain: ChainModel, alpha: float, beta: float) -> ChainModel:
    """The chain with `store` residuals scaled by alpha and stage workspaces by beta.

    A span's workspaces (a whole block checkpointed as one) are XLA's for the whole block
    and stay as measured: beta corrects stages compiled apart from the rest of their
    block, and carried over to whole blocks it put them far over XLA (each block of the
    corpus's HF-style GPT-2 checkpointed under nothing / dots_with_no_batch_dims / dots:
    +22.8% / +28.6% / +27.6% with beta 1.94, -2.4% / +8.8% / +9.6% without; plain JAX
    transformer +2.2% / +3.3% / +3.0% with beta 1.06, +1.0% / +2.2% / +0.0% without;
    tests/test_closed_loop.py pins the latter)."""
    def scaled(s):
        opts = tuple(dataclasses.replace(o, keep_bytes=int(o.keep_bytes * alpha))
                     if isinstance(o.kind, Store) else o for o in s.options)
        return dataclasses.replace(s, options=opts,
                                   fwd_temp_bytes=scaled_workspace(s.fwd_temp_bytes, beta),
                                   bwd_temp_bytes=scaled_workspace(s.bwd_temp_bytes, beta))
    return dataclasses.replace(chain, stages=tuple(scaled(s) for s in chain.stages))


def _fit_scale(f: Callable[[float], int], target: int, lo: float = 0.1, hi: float = 4.0) -> float:
    """Bisection for a scale s in [lo, hi] with f(s) ~= target (f non-decreasing)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _calibrate(an: Analysis, params, batch, say) -> Analysis:
    """Fit the model to XLA on two steps: without remat, and every stage but the last
    checkpointed.

    Per-stage residual bytes come from JAX's autodiff at the jaxpr level, and stage
    workspaces from XLA compiling each stage alone; in the whole program XLA's fusion
    keeps fewer or more. Two scales are fitted by alternating bisection: `alpha` on the
    residuals a stage keeps without checkpoint (it sets the no-remat peak) and `beta` on
    the stage workspaces (they set the peak when stages are checkpointed). What is
    left of the no-remat gap is an additive offset. Checkpoint options keep named tensors,
    which XLA keeps as they are, so their bytes are not scaled.
    """
    n = an.chain.n
    store_all = [Segment(i, i + 1, STORE) for i in range(n)]
    # The last stage (usually the head and loss) stays outside: checkpointing it is rarely
    # worth its recompute, so plans almost always keep it, and XLA treats a kept last
    # stage differently from a recomputed one.
    ckpt_all = tuple(Segment(i, i + 1, NOTHING if i < n - 1 else STORE) for i in range(n))
    say("measuring the step with every stage but the last checkpointed (calibration)")
    ckpt_plan = plan_from_segments(an, ckpt_all, 0, 0, params, batch)
    ckpt = measure_step(an.step.planned(ckpt_plan), params, batch)
    ckpt_measured = ckpt.peak_bytes
    # A plan XLA measured: the closed loop reuses it like its own (the corpus's ResNet with
    # an nn.max_pool stem at 3.3 MB, tests/test_closed_loop.py: every plan the model led
    # the loop to was over, this one fits).
    try:
        an.verified[(ckpt_all, an.step.optimizer)] = ckpt
    except TypeError:  # an optimizer that cannot be a dict key: no reuse
        pass

    def total(chain, segments):
        act, _ = simulate(chain, segments)
        return an.fixed.total + max(act, an.fixed.update_bytes)

    alpha = beta = 1.0
    for _ in range(4):
        beta = _fit_scale(lambda b: total(_scaled(an.chain, alpha, b), ckpt_all), ckpt_measured)
        alpha = _fit_scale(lambda a: total(_scaled(an.chain, a, beta), store_all),
                           an.noremat.peak_bytes)
    chain = _scaled(an.chain, alpha, beta)
    act, _ = simulate(chain, store_all)
    offset = an.noremat.peak_bytes - total(chain, store_all)
    return dataclasses.replace(an, chain=chain, noremat_activation_bytes=act,
                               calibration_bytes=offset, residual_scale=alpha,
                               workspace_scale=beta, calibration_compiles=2)


def plan(loss_fn: Callable, params, batch, budget, optimizer=None, *, verify: bool = True,
         max_rounds: int = 4, progress: Progress | None = None,
         analysis: Analysis | None = None, has_aux: bool = False, mesh=None,
         sharding=None, cost_model: CostModel | str | None = None,
         max_compiles: int | None = None) -> Plan:
    """Plan rematerialization of `loss_fn`'s training step to fit `budget`.

    Args:
      loss_fn: `loss_fn(params, *batch)` returning a scalar.
      params: parameter pytree (arrays or jax.ShapeDtypeStruct).
      batch: tuple of batch arguments (a single array is taken as a 1-tuple).
      budget: bytes for the whole step, an int or a string such as "12GB" / "11GiB".
      optimizer: optax GradientTransformation; without it the step is jax.grad(loss_fn).
      verify: compile the planned step and check XLA's peak (closed loop).
      max_rounds: solve/verify rounds before giving up.
      analysis: a reusable `analyze(...)` of the same step (it decides has_aux then).
      has_aux: loss_fn returns `(loss, aux)` (e.g. new BatchNorm statistics); gradients
        are of the loss, aux is returned by the step and the planned loss.
      mesh, sharding: plan the SPMD step on a device mesh, e.g. mesh="data=4,model=2"
        (or {"data": 4, "model": 2}, or a jax.sharding.Mesh) and sharding="fsdp" (dp,
        fsdp, tp, fsdp+tp; see remat_planner/sharding.py). `budget` is then per device,
        and XLA's per-device peak of the compiled SPMD step is the check.
      cost_model: what the solver minimises: "flops" (default) recompute FLOPs, "time"
        the roofline time flops/F + bytes/B (costmodel.CostModel; pass one to set the
        machine constants). Either way the plan's metadata reports the predicted
        recompute time (`recompute_time_overhead_predicted`).
      max_compiles: whole-step XLA compiles this call may make to verify plans (default
        MAX_VERIFY_COMPILES, 4; with the analysis's two calibration compiles a fresh call
        makes at most MAX_COMPILES, 6). The same whether or not `analysis` is given, so a
        plan does not depend on how the analysis was obtained. The closed loop's rounds
        and the probes share them, and a plan `analysis` measured before is free. A sweep
        over many budgets of one analysis passes fewer (its later budgets reuse the plans
        measured at earlier ones). At least 1.
    Returns:
      A Plan with predicted (and, if verified, measured) peak and recompute FLOPs.
    Raises:
      InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.
    """
    budget_bytes = parse_budget(budget)
    batch = as_batch(batch)
    say = progress or (lambda msg: None)
    an = analysis or analyze(loss_fn, params, batch, optimizer, calibrate=verify, progress=say,
                             has_aux=has_aux, mesh=mesh, sharding=sharding)
    # the step planned: this call's loss and optimizer, the analysis's has_aux and sharding
    step = an.step.replace(loss_fn=loss_fn, optimizer=optimizer)
    overhead = an.fixed.total + an.calibration_bytes
    model = resolve_cost_model(cost_model)
    costs = PlanCosts(an, model)
    solver = ChainSolver(costs.objective_chain,
                         max(an.noremat_activation_bytes, budget_bytes - overhead, 1))
    min_act = solver.min_feasible_bytes()
    min_budget = an.predicted_peak(min_act if min_act is not None else an.noremat_activation_bytes)

    def solve_for(target: int):
        act_budget = target - overhead
        if act_budget < an.fixed.update_bytes:
            return None
        return solver.solve(act_budget)

    first = solve_for(budget_bytes)
    if first is None:
        if verify and min_act is not None:
            # The model's smallest feasible budget may be one XLA does not fit (plain_jax in
            # tests/test_closed_loop_recovery.py: the model said 3.51 MB, XLA measured its
            # most frugal plan at 3,704,704 B): measure that plan, so that the budget
            # named is one a plan fits.
            frugal = make_plan(an, solver.solve(min_act), budget_bytes, params, batch,
                                correction=0, costs=costs)
            say("measuring the most frugal plan with XLA, to name the smallest budget")
            compiles = _Compiles(MAX_VERIFY_COMPILES if max_compiles is None else max_compiles)
            measured = compiles.measure(an, frugal, step, params, batch)
            fits = None
            if measured.peak_bytes <= budget_bytes:
                # The model overstates it, and XLA fits it (bert-tiny: the model's smallest
                # feasible budget 14,458,818 B, this plan 14,329,248 B by XLA).
                fits = with_measurement(frugal, measured)
            # The plans a user writes by hand with nn.remat per block may fit where the
            # model says none does (the corpus U-Net: the model puts every block under
            # nothing_saveable at 3.98 MB, XLA at 3,445,980 B).
            error = measured.peak_bytes - frugal.predicted_peak_bytes
            fits = _probe_per_block(an, fits, budget_bytes, [frugal.segments], step, params,
                                    batch, say, costs, compiles, error=error, wide=True)
            if fits is not None:
                return dataclasses.replace(fits, metadata={
                    **fits.metadata, "verify_rounds": compiles.measured,
                    "compiles": compiles.used, **_labels(an, budget)})
            min_budget = _lowest_verified_peak(an, optimizer, measured.peak_bytes)
        raise InfeasibleBudgetError(budget_bytes, min_budget)
    if not verify:
        p = make_plan(an, first, budget_bytes, params, batch, correction=0, costs=costs)
        return dataclasses.replace(p, metadata={**p.metadata, **_labels(an, budget)})

    # Closed loop. `target` is the budget handed to the model; the gap between XLA's
    # peak and the model's for the last measured plan is the correction carried into
    # the next prediction. Over budget: lower the target by the excess. Under budget
    # with slack below a target that failed: bisect upwards for a cheaper plan.
    limit = MAX_VERIFY_COMPILES if max_compiles is None else max_compiles
    if limit < 1:
        raise ValueError(f"max_compiles must be at least 1, got {max_compiles}")
    compiles = _Compiles(limit)
    target, solution, correction = budget_bytes, first, 0
    best: Plan | None = None
    best_target = budget_bytes  # the target that produced `best`
    best_cost = 0.0  # its recompute cost in the objective's units
    failed_target: int | None = None
    tried = [solution.segments]
    lowest_peak = None
    # The last compile is kept for the per-block probe when a per-block plan is within its
    # reach (the model within PER_BLOCK_MARGIN of the budget): a plan that recomputes no
    # more than nn.remat(Block, policy) must get its compile (on the corpus hf_gpt2 at
    # dots_saveable's peak, four rounds used every compile and the per-block plan that
    # fits was never measured: 6.82% against the built-in's 6.54%). Far from every
    # per-block plan the rounds keep it (scanned gpt2-small at the frontier's low end:
    # 49.46% with one round, 24.57% with two).
    reserve = int(any(an.predicted_peak(simulate(an.chain, segments)[0])
                      <= budget_bytes * (1 + PER_BLOCK_MARGIN)
                      for segments in per_block_plans(an)))
    for round_ in range(max_rounds):
        p = make_plan(an, solution, budget_bytes, params, batch, correction, costs=costs)
        if (round_ > 0 and compiles.left <= reserve
                and cached_measurement(an, p, step) is None):
            tried.remove(solution.segments)  # not measured: a probe may still try it
            break
        say(f"verifying with XLA (round {round_ + 1})")
        m = compiles.measure(an, p, step, params, batch)
        if m is None:
            break
        lowest_peak = m.peak_bytes if lowest_peak is None else min(lowest_peak, m.peak_bytes)
        p = with_measurement(p, m, verify_rounds=round_ + 1)
        correction = m.peak_bytes - (p.predicted_peak_bytes - correction)
        if m.peak_bytes <= budget_bytes:
            if best is None or solution.recompute_flops < best_cost:  # in the objective's units
                best, best_target, best_cost = p, target, solution.recompute_flops
            slack = budget_bytes - m.peak_bytes
            if slack < SLACK_STOP * budget_bytes:
                break
            # The model was conservative by `slack`: spend it, but stay below a target
            # that already failed.
            next_target = target + slack
            if failed_target is not None:
                next_target = min(next_target, (target + failed_target) // 2)
        else:
            # Lower from the failed plan's own modelled peak, not from the target: the plan
            # may have sat well below the target, and the same plan would come back.
            modelled = min(target, overhead + solution.activation_peak_bytes)
            failed_target = modelled
            excess = m.peak_bytes - budget_bytes
            say(f"XLA peak {m.peak_bytes} exceeds budget by {excess} bytes; re-solving")
            next_target = modelled - excess - solver.quantum
            if best is not None:
                next_target = max(next_target, (best_target + target) // 2)
        next_solution = solve_for(next_target)
        if next_solution is None and best is None:
            # Below what the model allows: the most frugal plan is the last thing to try.
            next_target = target
            next_solution = solver.solve(solver.min_feasible_bytes() or 0)
        if next_solution is None or next_solution.segments in tried:
            break
        tried.append(next_solution.segments)
        target, solution = next_target, next_solution
    rounds = compiles.measured
    labels = _labels(an, budget)
    if best is not None:
        # The per-block plans first: they are what a user writes by hand, and the model's
        # error on whole-block checkpoints differs from its error on the loop's plans.
        best = _probe_per_block(an, best, budget_bytes, tried, step, params, batch, say,
                                costs, compiles)
        best = _probe_cheaper(an, solver, best, budget_bytes, tried, step, params, batch, say,
                              costs, compiles)
        best = cheaper_verified(an, best, budget_bytes, step, params, batch, say, costs)
        return dataclasses.replace(best, metadata={
            **best.metadata, "verify_rounds": compiles.measured, "compiles": compiles.used,
            **labels})
    # Every plan of this call is over, but a plan with one keep rule per block, or one
    # XLA measured at another budget of this analysis (a sweep's smaller budget), may
    # fit: the model's error differs per plan.
    _probe_per_block(an, None, budget_bytes, tried, step, params, batch, say, costs, compiles)
    fallback = cheapest_verified(an, budget_bytes, step, params, batch, costs)
    if fallback is not None:
        say("a plan XLA measured at another budget of this analysis fits: taking it")
        return dataclasses.replace(fallback, metadata={
            **fallback.metadata, "verify_rounds": compiles.measured,
            "compiles": compiles.used, **labels})
    # The budget named: the lowest peak XLA measured on this analysis, a budget that plan
    # fits. The per-block probes just above and the calibration's plan are among them,
    # and may fit lower than every round of the loop (the corpus ViT at 9.10 MiB: the
    # loop's lowest 9,965,296 B, every block under nothing_saveable 9,912,136 B, the
    # calibration's plan checkpointing every stage 9,805,208 B).
    lowest = _lowest_verified_peak(an, step.optimizer, lowest_peak)
    raise InfeasibleBudgetError(
        budget_bytes, max(min_budget, lowest or 0),
        f"XLA measured every plan tried over the budget ({rounds} round(s), lowest "
        f"peak {lowest} bytes)")




def _lowest_verified_peak(an: Analysis, optimizer, default: int | None) -> int | None:
    """The lowest peak XLA measured on this analysis for `optimizer`'s step (`default`
    where none was): a budget the plan measured there fits, so the one an infeasible
    budget's error names."""
    return min((m.peak_bytes for (segments, opt), m in list(an.verified.items())
                if opt is optimizer or opt == optimizer), default=default)


def _labels(an: Analysis, budget) -> dict:
    """What a plan records for reading it later without the analysis: the unit family
    its budget was written in, and a scanned layer's sub-stage roles."""

    labels = {"units": units_of(budget).value}
    if sub_stage_labels(an):
        labels["scan_sub_stages"] = sub_stage_labels(an)
    return labels


class _Compiles:
    """XLA measurements of plans within one `plan()` call: a plan this analysis already
    measured is free (Analysis.verified), a new one spends one of `limit` compiles."""

    def __init__(self, limit: int):
        self.limit, self.used, self.measured = limit, 0, 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def measure(self, an: Analysis, p: Plan, step: Step, params, batch) -> Measurement | None:
        """XLA's figures for `p`, or None when it would need a compile and none is left."""
        cached = cached_measurement(an, p, step)
        if cached is None:
            if self.left <= 0:
                return None
            self.used += 1
        self.measured += 1
        return cached or measure_plan(an, p, step, params, batch)




def _probe_cheaper(an: Analysis, solver: ChainSolver, best: Plan, budget_bytes: int, tried: list,
                   step: Step, params, batch, say, costs: "PlanCosts",
                   compiles: _Compiles) -> Plan:
    """Try the next cheaper plans on the model's frontier with XLA.

    The model's error differs from plan to plan by a few percent (XLA packs some buffers
    better than the sum of parts), so a plan the model puts just over the budget may fit.
    While the next cheaper frontier point, shifted by the error measured on the best plan,
    lies within PROBE_MARGIN of the budget, it is compiled; the cheapest plan XLA fits wins
    (by measured FLOPs; with the time objective, by the model's time cost). At most
    MAX_PROBES extra compiles, within what `compiles` has left.
    """
    timed = costs.model.kind == "time"
    objective = (lambda segs: simulate(costs.objective_chain, segs)[1]) if timed else None
    best_cost = objective(best.segments) if timed else best.recompute_flops
    error = best.measured_peak_bytes - an.predicted_peak(
        simulate(an.chain_for(best.segments, chain=an.chain), best.segments)[0])
    probes = 0
    for act, cost in solver.frontier():
        if probes >= MAX_PROBES:
            break
        if cost >= best_cost:  # the solver's frontier is in the objective's units
            continue
        solution = solver.solve(act)
        if solution is None or solution.segments in tried:
            continue
        if an.predicted_peak(solution.activation_peak_bytes) + error > budget_bytes * (1 + PROBE_MARGIN):
            break  # frontier points come in increasing bytes: the rest are further over
        tried.append(solution.segments)
        probes += 1
        p = make_plan(an, solution, budget_bytes, params, batch, error, costs=costs)
        say(f"verifying a cheaper plan the model puts {p.predicted_peak_bytes - budget_bytes:+d} "
            "bytes from the budget (probe)")
        m = compiles.measure(an, p, step, params, batch)
        if m is None:
            break
        if m.peak_bytes > budget_bytes:
            continue  # the model's error differs per plan: a later point may still fit
        if (objective(p.segments) < best_cost) if timed else (m.flops < best.measured_flops):
            best = with_measurement(p, m)
            best_cost = objective(p.segments) if timed else best.recompute_flops
    return best


# Keep rules a per-block plan applies to every copy of a repeated block: JAX's built-in
# nothing_saveable, dots_with_no_batch_dims_saveable and dots_saveable.
PER_BLOCK_RULES = (NOTHING, DOTS_NO_BATCH, DOTS)
# Where a block's profile lacks a rule, the option keeping the same values (profiles
# drop an option whose kept set equals an earlier one's): the next narrower rule.
_NARROWER = {DOTS: (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING),
             DOTS_NO_BATCH: (DOTS_NO_BATCH, NOTHING), NOTHING: (NOTHING,)}


def per_block_plans(an: Analysis) -> list[tuple[Segment, ...]]:
    """For each of PER_BLOCK_RULES, the plan that checkpoints every copy of a repeated
    block whole under it and stores the rest: what `nn.remat(Block, policy=...)` gives.
    A copy is a span of stages (its own profile) or one stage (the stage's option under
    the rule); a layer-stack scan stage gets the scheme doing the same inside the scan
    (`scan:NxR`, R the whole-body checkpoint under the rule: _scan_whole_body), where it
    has one. Where the program repeats more than one block (a U-Net's conv blocks and its
    upsampling layers), each rule also gives the plan over each block alone, since the
    user wraps one of them."""
    chain = an.chain
    span_profiles = {(a, c): profile for a, c, profile in chain.spans}
    groups = [{a: (c, span_profiles[a, c] if c > a + 1 else chain.stages[a])
               for a, c in g if c <= chain.n and (c == a + 1 or (a, c) in span_profiles)}
              for g in an.cost.blocks]
    groups = [g for g in groups if g]
    if not groups and chain.spans:  # a chain built without the graph's groups
        groups = [{a: (c, p) for a, c, p in chain.spans}]
    # Every group's copies at once, but a group nested in one before it (its units:
    # graph.unit_groups) only where that one took nothing
    union: dict = {}
    for g in groups:
        for a, (c, profile) in g.items():
            if not any(a < hi and lo < c for lo, (hi, _) in union.items()):
                union[a] = (c, profile)
    choices = [dict(sorted(union.items()))]
    if len(groups) > 1:
        choices += [g for g in groups if g != choices[0]]
    scans = {k: s for k, s in enumerate(chain.stages)
             if any(isinstance(o.kind, ScanOption) for o in s.options)}
    plans = []
    for rule in PER_BLOCK_RULES if groups or scans else ():
        for spans in choices if groups else [{}]:
            segments, i = [], 0
            while i < chain.n:
                if i in spans:
                    c, profile = spans[i]
                    names = {o.name for o in profile.options}
                    name = next(r for r in _NARROWER[rule] if r in names)
                    segments.append(Segment(i, c, name, profile.option(name).saved))
                    i = c
                elif i in scans and (option := _scan_whole_body(scans[i], rule)) is not None:
                    segments.append(Segment(i, i + 1, option.name, option.saved))
                    i += 1
                else:
                    segments.append(Segment(i, i + 1, STORE))
                    i += 1
            checkpoints = not all(isinstance(s.kind, Store) for s in segments)
            if checkpoints and tuple(segments) not in plans:
                plans.append(tuple(segments))
    return plans


# Whole-body checkpoints of a scan body under each dots rule (scan.py's `[rule]`
# per-iteration plans). nothing_saveable has none: a flat scheme checkpointing each
# sub-stage (`nothing|nothing`) recomputes the same and the solver has it already.
_SCAN_WHOLE = {NOTHING: (), DOTS_NO_BATCH: ("[dots_no_batch]",),
               DOTS: ("[dots]", "[dots_narrow]", "[dots_no_batch]")}


def _scan_whole_body(stage: StageProfile, rule: str):
    """The option of a layer-stack scan stage that checkpoints every iteration's whole
    body under `rule` (one flat scan), as `nn.remat(Block, policy=...)` inside `nn.scan`
    does; None when the stage has none (the profile dropped it, or no such plan)."""
    by_name = {o.name: o for o in stage.options}
    # the layer count of the stage's (first) scheme: N of `scan:N...`
    layers = next(o.kind.scheme.parts[0].count for o in stage.options
                  if isinstance(o.kind, ScanOption))
    whole = (ScanOption(ScanScheme((ScanPart(layers, plan),))).name for plan in _SCAN_WHOLE[rule])
    return next((by_name[name] for name in whole if name in by_name), None)


def _probe_per_block(an: Analysis, best: Plan | None, budget_bytes: int, tried: list, step: Step,
                     params, batch, say, costs: "PlanCosts",
                     compiles: _Compiles, error: int | None = None,
                     wide: bool = False) -> Plan | None:
    """Compile the per-block plans (per_block_plans) that would recompute less than `best`
    and that the model, corrected by its error, puts within PER_BLOCK_MARGIN of the
    budget; the cheapest XLA fits wins (by XLA's FLOPs). Without `best` (every plan of
    the closed loop over, or none the model fits), those within the margin are measured,
    so the caller's reuse of verified plans finds them. Those the model puts within the
    budget first, cheapest first, then those it puts least over: the first that XLA fits
    ends the probe. At most len(PER_BLOCK_RULES) compiles, within what
    `compiles` has left.

    The error is the model's on a per-block plan XLA measured on this analysis where there
    is one, with PER_BLOCK_MARGIN (the model's error on whole-block checkpoints differs
    from its error on other plans: the corpus U-Net's per-block plans +15% to +23%, the
    closed loop's plans within 3%); before one is measured, `error`, else the model's
    error on `best`, where it is under XLA (an error over XLA is not carried over), and
    without `best` (or `wide`: the model called the budget infeasible and XLA disagreed)
    the wider PER_BLOCK_FIRST_MARGIN. It is measured again after each probe."""
    chain = costs.objective_chain
    plans = per_block_plans(an)

    def model_peak(segments) -> int:
        return an.predicted_peak(simulate(an.chain_for(segments, chain=an.chain), segments)[0])

    def block_error() -> int | None:
        errors = [m.peak_bytes - model_peak(segments) for segments in plans
                  if (m := cached_measurement(an, segments, step)) is not None]
        return min(errors) if errors else None

    def model_flops(segments) -> float:
        return simulate(an.chain_for(segments, "flops", an.chain), segments)[1]

    if best is not None:
        best_cost = simulate(chain, best.segments)[1]
        best_flops = model_flops(best.segments)
        # What the model counts of `best`'s recompute beyond what XLA counts: XLA fuses
        # elementwise recompute into the backward's fusions (the corpus CNN at
        # dots_saveable's peak: the model 0.71% of the step, XLA -0.15%). A per-block plan
        # the model puts that little dearer may be cheaper by XLA, so it is measured.
        over = (best_flops - (best.measured_flops - an.noremat.flops)
                if an.noremat is not None and best.measured_flops is not None else 0.0)
        if error is None:
            error = best.measured_peak_bytes - model_peak(best.segments)
    error = error or 0
    candidates = []
    for segments in plans:
        if segments in tried:
            continue
        act, cost = simulate(chain, segments)
        if (best is not None and cost >= best_cost
                and model_flops(segments) >= best_flops + max(0.0, over)):
            continue
        candidates.append((cost, segments, act))

    def order(candidate):
        # Those the model puts within the budget, cheapest first; then the rest, those
        # it puts least over first, cheapest first among equals (the corpus plain-JAX
        # transformer at dots_with_no_batch_dims_saveable's peak: per-block dots, the
        # cheapest but 8.8% over by the model, measured 8.8% over; per-block no-batch
        # dots, 2.2% over, fit).
        cost, _, act = candidate
        over_budget = an.predicted_peak(act) - budget_bytes
        return (0, 0, cost) if over_budget <= 0 else (1, over_budget, cost)

    for cost, segments, act in sorted(candidates, key=order):
        measured_error = block_error()
        if measured_error is None:  # the model's error on per-block plans is not known yet
            # An error under the loop's plans does not carry over as it is: the model's
            # error on whole blocks can have the other sign (the corpus U-Net at
            # dots_saveable's peak: the loop's region plans 12% under XLA, the per-block
            # plans 7% over).
            wide_first = wide or best is None
            e, margin = min(error, 0), PER_BLOCK_FIRST_MARGIN if wide_first else PER_BLOCK_MARGIN
        else:
            e, margin = measured_error, PER_BLOCK_MARGIN
        if an.predicted_peak(act) + e > budget_bytes * (1 + margin):
            continue
        p = make_plan(an, Solution(segments, cost, act), budget_bytes, params, batch, e,
                       costs=costs)
        say("verifying a plan with one keep rule per block (probe)")
        m = compiles.measure(an, p, step, params, batch)
        if m is None:
            break
        tried.append(segments)
        if m.peak_bytes <= budget_bytes:
            if best is None or m.flops < best.measured_flops:
                best = with_measurement(p, m)
            break
    return best


def cheaper_verified(an: Analysis, best: Plan, budget_bytes: int, step: Step, params, batch,
                      say, costs: "PlanCosts") -> Plan:
    """The cheapest plan XLA already measured on this analysis within `budget_bytes`.

    The closed loop's rounds end where the model's per-plan error leads them, so planning
    a larger budget can end on a dearer plan than a smaller budget did (vit-tiny: 2.77e6
    recompute FLOPs at 15.06 MB, 1.77e7 at 15.49 MB; scanned gpt2-small: 0.16% at 22.4
    GiB, 0.12% at 19.5 GiB). A plan verified earlier on the same analysis (a frontier
    sweep, a budget sweep of your own) that fits this budget and is cheaper
    is taken instead, with no compile: cheaper as the probes judge it, by XLA's FLOPs
    (by more than REUSE_TOLERANCE of the step's, below which XLA's fusion decides), or
    with the time objective by the model's time. On a fresh analysis the
    candidates are this call's own rounds, which the closed loop ranks by the model.

    A plan that recomputes nothing is kept as it is: XLA counts some remat plans below the
    step without remat (resnet-tiny: -56,880 FLOPs, -0.44%, as it fuses the replayed
    forward differently), which is not less work than recomputing nothing.
    """
    if best.recompute_flops == 0.0:
        return best
    timed = costs.model.kind == "time"
    if timed:
        best_cost, margin = simulate(costs.objective_chain, best.segments)[1], 0.0
    elif best.measured_flops is not None:
        best_cost, margin = best.measured_flops, REUSE_TOLERANCE * best.step_flops
    else:
        return best
    found, optimizer = None, step.optimizer
    for (segments, opt), m in list(an.verified.items()):
        if opt is not optimizer and opt != optimizer:
            continue
        if m.peak_bytes > budget_bytes or segments == best.segments:
            continue
        c = simulate(costs.objective_chain, segments)[1] if timed else m.flops
        if c is not None and c < best_cost - margin:
            found, best_cost, margin = (segments, m), c, 0.0
    if found is None:
        return best
    say("a plan XLA measured at another budget of this analysis fits and recomputes less: "
        "taking it")
    return _from_verified(an, *found, budget_bytes, params, batch, costs)


def cheapest_verified(an: Analysis, budget_bytes: int, step: Step, params, batch,
                       costs: "PlanCosts") -> Plan | None:
    """The plan with the fewest XLA FLOPs among those XLA measured on this analysis within
    `budget_bytes` (by the model's time with the time objective); None if there is none."""
    timed, optimizer = costs.model.kind == "time", step.optimizer
    found, best_cost = None, None
    for (segments, opt), m in list(an.verified.items()):
        if (opt is not optimizer and opt != optimizer) or m.peak_bytes > budget_bytes:
            continue
        c = simulate(costs.objective_chain, segments)[1] if timed else m.flops
        if c is not None and (best_cost is None or c < best_cost):
            found, best_cost = (segments, m), c
    if found is None:
        return None
    return _from_verified(an, *found, budget_bytes, params, batch, costs)


def _from_verified(an: Analysis, segments, m: Measurement, budget_bytes: int, params, batch,
                   costs: "PlanCosts") -> Plan:
    """The plan of `segments` with XLA's figures `m`, measured earlier on this analysis."""
    peak, objective = simulate(costs.objective_chain, segments)
    p = make_plan(an, Solution(segments, objective, peak), budget_bytes, params, batch,
                   m.peak_bytes - an.predicted_peak(peak), costs=costs)
    return with_measurement(p, m, verified_at_another_budget=True)


def with_measurement(p: Plan, m: Measurement, **metadata) -> Plan:
    """Plan `p` with XLA's figures `m` for it (and its collectives, when sharded)."""
    if m.communication is not None:
        metadata["communication"] = m.communication
    return dataclasses.replace(p, measured_peak_bytes=m.peak_bytes, measured_flops=m.flops,
                               metadata={**p.metadata, **metadata})


def cached_measurement(an: Analysis, p: "Plan | tuple[Segment, ...]",
                        step: Step) -> Measurement | None:
    """XLA's figures for plan `p` (or the plan of these segments) if this analysis
    measured it before, with `step`'s optimizer."""
    segments = p.segments if isinstance(p, Plan) else tuple(p)
    try:
        return an.verified.get((segments, step.optimizer))
    except TypeError:  # an optimizer that cannot be a dict key: no reuse
        return None


def measure_plan(an: Analysis, p: Plan, step: Step, params, batch) -> Measurement:
    """XLA's figures for plan `p` of `step` (the analysed step, or the same step with
    another loss or optimizer), compiled once per analysis."""
    try:
        key = (p.segments, step.optimizer)
        hash(key)
    except TypeError:  # an optimizer that cannot be a dict key: no reuse
        return measure_step(step.planned(p), params, batch)
    if key not in an.verified:
        an.verified[key] = measure_step(step.planned(p), params, batch)
    return an.verified[key]


class PlanCosts:
    """The chain the solver minimises over (FLOPs or time units) and the reports of a
    plan's recompute in FLOPs and predicted seconds, whichever the objective."""

    def __init__(self, an: Analysis, model: CostModel):
        self.an, self.model = an, model
        self.objective_chain = an.cost_chain(model)
        time_model = dataclasses.replace(model, kind="time")
        self.time_chain = (self.objective_chain if model.kind == "time"
                           else an.cost_chain(time_model))

    def metadata(self, segments) -> dict:
        an = self.an
        _, flops = simulate(an.chain_for(segments, "flops", an.chain), segments)
        time_model = dataclasses.replace(self.model, kind="time")
        _, time_units = simulate(an.chain_for(segments, time_model, self.time_chain), segments)
        seconds = time_units / self.model.flops_per_second
        step = self.an.step_seconds(self.model)
        return {"recompute_flops": flops, "metadata": {
            "cost_model": self.model.kind,
            "balance_flops_per_byte": self.model.balance,
            "recompute_seconds_predicted": seconds,
            "step_seconds_predicted": step,
            "recompute_time_overhead_predicted": seconds / step if step else 0.0}}


def make_plan(an: Analysis, solution, budget_bytes: int, params, batch, correction: int,
               costs: PlanCosts | None = None) -> Plan:
    extra = costs.metadata(solution.segments) if costs is not None else {
        "recompute_flops": solution.recompute_flops, "metadata": {}}
    p = plan_from_segments(an, solution.segments, budget_bytes,
                           an.predicted_peak(solution.activation_peak_bytes) + correction,
                           params, batch, extra["recompute_flops"])
    return dataclasses.replace(p, metadata={**p.metadata, **extra["metadata"]})


def plan_from_segments(an: Analysis, segments, budget_bytes: int, predicted: int, params, batch,
                       recompute_flops: float = 0.0) -> Plan:
    """The Plan of hand-chosen `segments` on the analysed step, neither solved nor measured.

    The plan `plan` would return had its solver chosen `segments` (one option on one
    stage, say): the analysis's stages, fingerprint and fixed memory, the input signature
    of `params` and `batch`; `budget_bytes`, `predicted` (peak bytes) and
    `recompute_flops` are recorded as given.
    """
    return Plan(
        segments=tuple(segments),
        stages=an.stage_infos,
        fingerprint=an.program.fingerprint(),
        budget_bytes=int(budget_bytes),
        predicted_peak_bytes=int(predicted),
        recompute_flops=float(recompute_flops),
        fixed_bytes=int(an.fixed.total),
        step_flops=float(an.step_flops),
        signature=tuple(input_signature(params, batch, an.program)),
        has_aux=an.program.has_aux,
        sharding=an.sharding,
        pinned=tuple(sorted(an.pinned)),
        metadata={"jax_version": jax.__version__},
    )


# ---------------------------------------------------------------------------------------
# Built-in JAX policies per block, for comparison
# ---------------------------------------------------------------------------------------

BUILTIN_POLICIES = baselines.POLICIES  # the table lives in baselines.py


def measure_builtin_policies(loss_fn: Callable, params, batch, optimizer=None,
                             progress: Progress | None = None,
                             has_aux: bool = False, mesh=None,
                             sharding=None) -> dict[str, Measurement]:
    """XLA peak and FLOPs of the step without remat and with each built-in policy per block
    (per device, with `mesh` and `sharding`: under tp in the layout `plan` uses, its
    unpaired kernels replicated)."""
    step = Step.make(loss_fn, optimizer, has_aux, mesh, sharding)
    step = step.replace(sharding=with_unpaired(step, params, batch))
    say = progress or (lambda msg: None)
    out = {}
    say("measuring: no remat")
    out["no_remat"] = measure_step(step, params, batch)
    for name in baselines.POLICIES:
        say(f"measuring: {name} per block")
        out[name] = baselines.measure_builtin(name, step, params, batch)
    return out
