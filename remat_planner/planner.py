"""The pipeline end to end: trace -> graph -> memory -> solve -> apply -> verify.

`plan()` is the public entry point. It solves against the memory model, then compiles
the planned step and reads XLA's peak; when XLA's peak exceeds the budget it tightens
the solver's budget by the measured excess and solves again (a bounded number of
rounds), so a plan is never returned as fitting when XLA says it does not.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax

from .apply import input_signature
from .budget import parse_budget
from .errors import InfeasibleBudgetError
from .graph import CostGraph, build_cost_graph
from .memory import ChainModel, FixedMemory, fixed_memory, profile_stages, simulate
from .plan import STORE, Plan, Segment, StageInfo
from .solve import ChainSolver
from .trace import Program, trace
from .verify import Measurement, as_batch, measure

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

    @property
    def noremat_predicted_peak(self) -> int:
        return self.predicted_peak(self.noremat_activation_bytes)

    def predicted_peak(self, activation_bytes: int) -> int:
        return self.fixed.total + max(activation_bytes, self.fixed.update_temp_bytes)

    @property
    def stage_infos(self) -> tuple[StageInfo, ...]:
        return tuple(StageInfo(s.start, s.stop, s.name) for s in self.cost.stages)


def analyze(loss_fn: Callable, params, batch, optimizer=None, *, measure_xla: bool = True,
            progress: Progress | None = None) -> Analysis:
    """Trace, build the cost graph and profile every stage (nothing allocated)."""
    batch = as_batch(batch)
    say = progress or (lambda msg: None)
    say("tracing")
    program = trace(loss_fn, params, *batch)
    cost = build_cost_graph(program)
    say(f"{len(program.eqns)} equations, {len(cost.stages)} stages")
    fixed = fixed_memory(params, batch, optimizer)
    chain = profile_stages(program, cost, measure_xla=measure_xla, progress=say)
    store_all = [Segment(i, i + 1, STORE) for i in range(chain.n)]
    noremat_peak, _ = simulate(chain, store_all)
    # forward + backward of the unplanned step: backward ~ 2x forward for dots
    step_flops = 3.0 * cost.total_flops
    return Analysis(program, cost, chain, fixed, noremat_peak, step_flops)


def plan(loss_fn: Callable, params, batch, budget, optimizer=None, *, verify: bool = True,
         max_rounds: int = 4, progress: Progress | None = None,
         analysis: Analysis | None = None) -> Plan:
    """Plan rematerialization of `loss_fn`'s training step to fit `budget`.

    Args:
      loss_fn: `loss_fn(params, *batch)` returning a scalar.
      params: parameter pytree (arrays or jax.ShapeDtypeStruct).
      batch: tuple of batch arguments (a single array is taken as a 1-tuple).
      budget: bytes for the whole step, an int or a string such as "12GB" / "11GiB".
      optimizer: optax GradientTransformation; without it the step is jax.grad(loss_fn).
      verify: compile the planned step and check XLA's peak (closed loop).
      max_rounds: solve/verify rounds before giving up.
    Returns:
      A Plan with predicted (and, if verified, measured) peak and recompute FLOPs.
    Raises:
      InfeasibleBudgetError: no plan fits; the message names the smallest feasible budget.
    """
    budget_bytes = parse_budget(budget)
    batch = as_batch(batch)
    say = progress or (lambda msg: None)
    an = analysis or analyze(loss_fn, params, batch, optimizer, progress=say)
    solver = ChainSolver(an.chain, max(an.noremat_activation_bytes, budget_bytes - an.fixed.total, 1))
    min_act = solver.min_feasible_bytes() or 0
    min_budget = an.predicted_peak(min_act)
    target = budget_bytes
    last_measure: Measurement | None = None
    for round_ in range(max_rounds):
        act_budget = target - an.fixed.total
        if an.fixed.total + an.fixed.update_temp_bytes > target:
            act_budget = -1
        solution = solver.solve(act_budget) if act_budget >= 0 else None
        if solution is None:
            floor = max(min_budget, budget_bytes + (budget_bytes - target))
            detail = "" if round_ == 0 else (
                f"XLA measured {last_measure.peak_bytes} bytes for the best plan")
            raise InfeasibleBudgetError(budget_bytes, floor, detail)
        p = _make_plan(an, solution, budget_bytes, params, batch)
        if not verify:
            return p
        say(f"verifying with XLA (round {round_ + 1})")
        m = measure(p.apply(loss_fn), params, batch, optimizer)
        last_measure = m
        p = dataclasses.replace(p, measured_peak_bytes=m.peak_bytes, measured_flops=m.flops)
        if m.peak_bytes <= budget_bytes:
            return p
        excess = m.peak_bytes - budget_bytes
        say(f"XLA peak {m.peak_bytes} exceeds budget by {excess} bytes; re-solving")
        target -= excess + max(1, solver.quantum)
    raise InfeasibleBudgetError(
        budget_bytes, budget_bytes + (budget_bytes - target),
        f"after {max_rounds} rounds XLA still measured {last_measure.peak_bytes} bytes")


def _make_plan(an: Analysis, solution, budget_bytes: int, params, batch) -> Plan:
    return Plan(
        segments=solution.segments,
        stages=an.stage_infos,
        fingerprint=an.program.fingerprint(),
        budget_bytes=int(budget_bytes),
        predicted_peak_bytes=int(an.predicted_peak(solution.activation_peak_bytes)),
        recompute_flops=float(solution.recompute_flops),
        fixed_bytes=int(an.fixed.total),
        step_flops=float(an.step_flops),
        metadata={"signature": input_signature(params, batch),
                  "jax_version": jax.__version__},
    )


# ---------------------------------------------------------------------------------------
# Built-in JAX policies per block, for comparison
# ---------------------------------------------------------------------------------------

BUILTIN_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

_REPEATED = re.compile(r".+_\d+$")


def block_ranges(program: Program) -> list[tuple[int, int]]:
    """Equation ranges of repeated blocks: runs sharing a depth-2 module path that ends in
    `_<number>` (h_0, Block_3, layers_11), as `nn.remat` per block would wrap them."""
    ranges, current, start = [], None, 0
    for i, e in enumerate(program.eqns + (None,)):
        scope = None
        if e is not None:
            parts = [p for p in e.module_path.split("/") if p]
            scope = "/".join(parts[:2]) if len(parts) >= 2 and _REPEATED.match(parts[1]) else None
        if scope != current:
            if current is not None:
                ranges.append((start, i))
            current, start = scope, i
    return ranges


def builtin_policy_loss(loss_fn: Callable, params, batch, policy) -> Callable:
    """`loss_fn` with each repeated block in its own jax.checkpoint(policy=...)."""
    from .apply import check_matches  # noqa: F401  (same replay machinery)
    from .graph import definitions, last_uses
    from .memory import make_segment_fn, stage_io
    from .trace import eval_range

    batch = as_batch(batch)
    program = trace(loss_fn, params, *batch)
    blocks = block_ranges(program)
    last, defs = last_uses(program), definitions(program)

    def loss(p, *b):
        leaves = jax.tree.leaves((p, *b))
        env = dict(zip(program.invars, leaves))
        env.update(program.consts)
        pos = 0
        for lo, hi in blocks + [(len(program.eqns), len(program.eqns))]:
            eval_range(program, pos, lo, env)
            if hi > lo:
                ins, outs = stage_io(program, lo, hi, last, defs)
                fn = jax.checkpoint(make_segment_fn(program, lo, hi, ins, outs), policy=policy)
                env.update(zip(outs, fn(*[env[v] for v in ins])))
            pos = hi
        return env[program.outvars[0]]
    return loss


def measure_builtin_policies(loss_fn: Callable, params, batch, optimizer=None,
                             progress: Progress | None = None) -> dict[str, Measurement]:
    """XLA peak and FLOPs of the step without remat and with each built-in policy per block."""
    say = progress or (lambda msg: None)
    out = {}
    say("measuring: no remat")
    out["no_remat"] = measure(loss_fn, params, batch, optimizer)
    for name, policy in BUILTIN_POLICIES.items():
        say(f"measuring: {name} per block")
        out[name] = measure(builtin_policy_loss(loss_fn, params, batch, policy), params, batch,
                            optimizer)
    return out
