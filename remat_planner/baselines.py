"""What a JAX user would write by hand, measured like a plan: the comparison points.

- `no_remat`: the step as written.
- `nothing_saveable`, `dots_saveable`, `dots_with_no_batch_dims_saveable`: each repeated
  block in its own `jax.checkpoint(policy=...)` (`nn.remat(block, policy=...)`; inside a
  layer-stack scan, the policy on the scan body), as `policy_loss` builds them.
- `sqrt_n_grouping`: Chen et al.'s two-level scheme. The n blocks are cut into groups of
  about sqrt(n); each group is one checkpoint that keeps only its input, and inside it
  each block is its own checkpoint (nothing_saveable), so the backward pass recomputes a
  group's blocks from the group input, then each block from its own input. For a layer
  stack written as a scan it is the grouped scan (docs/guide.md, "scan schemes"):
  an outer scan over checkpointed groups of k iterations whose body is an inner scan of
  k checkpointed iterations, k the divisor of n closest to sqrt(n).

Every point is measured by verify.measure: XLA's memory_analysis peak and FLOPs of the
donated optimizer step, compiled with the CPU option that keeps remat.

This module is the one home of the comparison points: `POLICIES` (the built-in policies'
table), `NAMES` (the points in table order), `builtin_point` (a point's loss and how it
groups the blocks) and `measure_builtin`. The planner's `measure_builtin_policies`, the
CLI's comparison, the frontier and maxbatch all build their points here. It imports only
the pipeline stages up to verify, so the planner may import it (tests/test_imports.py).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax

from . import apply, scan
from .apply import block_ranges, run_with_policy
from .graph import definitions, last_uses
from .memory import make_segment_fn, stage_io
from .trace import Literal, eval_range, trace
from .step import Step
from .verify import Measurement, as_batch, measure_step

NO_REMAT = "no_remat"
SQRT_N = "sqrt_n_grouping"
# JAX's built-in checkpoint policies, each applied to every block: the one table of them.
POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# The comparison points, in the order tables list them.
NAMES = (NO_REMAT, *POLICIES, SQRT_N)


def policy_loss(loss_fn: Callable, params, batch: Sequence, policy,
                has_aux: bool = False) -> Callable:
    """`loss_fn` with each repeated block in its own jax.checkpoint(policy=...) for any JAX
    policy (one of POLICIES, or e.g. remat_planner.dots_narrow_saveable); blocks stacked by
    a scan (nn.scan) get the policy on the scan body, as `nn.remat` of the block inside
    `nn.scan` would."""
    program = trace(loss_fn, params, *batch, has_aux=has_aux)
    blocks = block_ranges(program)
    last, defs = last_uses(program), definitions(program)
    end = len(program.eqns)
    layer_scan = scan.find_layer_scan(program)

    def evaluate(lo: int, hi: int, env: dict) -> None:
        if layer_scan is None or not lo <= layer_scan < hi:
            eval_range(program, lo, hi, env)
            return
        eval_range(program, lo, layer_scan, env)
        run_with_policy(program, layer_scan, policy, env)
        eval_range(program, layer_scan + 1, hi, env)

    def loss(p, *b):
        env = program.bind(jax.tree.leaves((p, *b)))
        pos = 0
        for lo, hi in blocks + [(end, end)]:
            evaluate(pos, lo, env)
            if hi > lo:
                ins, outs = stage_io(program, lo, hi, last, defs)
                fn = jax.checkpoint(make_segment_fn(program, lo, hi, ins, outs), policy=policy)
                env.update(zip(outs, fn(*[env[v] for v in ins])))
            pos = hi
        return program.output(env)
    return loss


def group_size(n: int) -> int:
    """Blocks per group for n blocks: about sqrt(n), at least 2 (when n >= 2)."""
    return max(1, min(n, max(2, round(math.sqrt(n)))))


def scan_group_size(n: int) -> int:
    """Iterations per group of an n-iteration scan: the divisor of n (other than 1 and n
    when there is one) closest to sqrt(n); n itself for a prime n (one group)."""
    divisors = [k for k in range(2, n) if n % k == 0]
    if not divisors:
        return n
    return min(divisors, key=lambda k: (abs(k - math.sqrt(n)), k))


def sqrt_grouping_loss(loss_fn: Callable, params, batch: Sequence,
                       has_aux: bool = False) -> tuple[Callable, str]:
    """`loss_fn` with two-level sqrt(n) checkpointing over its repeated blocks, and a
    description of the grouping (e.g. "4 blocks in groups of 2")."""
    program = trace(loss_fn, params, *batch, has_aux=has_aux)
    last, defs = last_uses(program), definitions(program)
    nothing = jax.checkpoint_policies.nothing_saveable
    layer_scan = scan.find_layer_scan(program)
    if layer_scan is not None:
        eqn = program.eqns[layer_scan]
        n = eqn.params["length"]
        k = scan_group_size(n)

        def loss(p, *b):
            env = program.bind(jax.tree.leaves((p, *b)))
            eval_range(program, 0, layer_scan, env)
            body = scan.layer_body(eqn)
            consts, carry, xs = body.split([v.val if isinstance(v, Literal) else env[v]
                                            for v in eqn.invars])
            it = apply.body_step(body, jax_policy=nothing)
            groups = (k,) if n >= 2 else ()  # a prime n is one group of n
            carry, ys = apply.nested_scan(lambda c, x: it(consts, c, x), carry, xs, groups)
            env.update(zip(eqn.outvars, list(carry) + list(ys)))
            eval_range(program, layer_scan + 1, len(program.eqns), env)
            return program.output(env)
        return loss, f"scan of {n} layers in {n // k} checkpointed group(s) of {k}"

    blocks = block_ranges(program)
    n = len(blocks)
    k = group_size(n)
    groups = [blocks[i:i + k] for i in range(0, n, k)]
    end = len(program.eqns)

    def block_fn(lo: int, hi: int):
        ins, outs = stage_io(program, lo, hi, last, defs)
        return ins, outs, jax.checkpoint(make_segment_fn(program, lo, hi, ins, outs),
                                         policy=nothing)

    def group_fn(members):
        glo, ghi = members[0][0], members[-1][1]
        ins, outs = stage_io(program, glo, ghi, last, defs)

        def body(*args):
            env = program.region_env(ins, args)
            pos = glo
            for lo, hi in members:
                eval_range(program, pos, lo, env)
                b_ins, b_outs, fn = block_fn(lo, hi)
                env.update(zip(b_outs, fn(*[env[v] for v in b_ins])))
                pos = hi
            return [env[v] for v in outs]
        return glo, ghi, ins, outs, jax.checkpoint(body, policy=nothing)

    def loss(p, *b):
        env = program.bind(jax.tree.leaves((p, *b)))
        pos = 0
        for members in groups:
            glo, ghi, ins, outs, fn = group_fn(members)
            eval_range(program, pos, glo, env)
            env.update(zip(outs, fn(*[env[v] for v in ins])))
            pos = ghi
        eval_range(program, pos, end, env)
        return program.output(env)
    return loss, f"{n} blocks in {len(groups)} checkpointed group(s) of up to {k}"


class BuiltinPoint(NamedTuple):
    """A comparison point as a loss function, and how it checkpoints the blocks."""
    loss: Callable
    grouping: str


def builtin_point(name: str, step: Step, params, batch: Sequence) -> BuiltinPoint:
    """The comparison point `name` (one of NAMES) of `step` (a step.Step): its loss as
    written, with the built-in policy POLICIES[name] per block, or with sqrt(n) grouping;
    and a description of its grouping ("no checkpoint", "per block", or
    sqrt_grouping_loss's)."""
    batch = as_batch(batch)
    loss_fn, has_aux = step.loss_fn, step.has_aux
    if name == NO_REMAT:
        return BuiltinPoint(loss_fn, "no checkpoint")
    if name == SQRT_N:
        return BuiltinPoint(*sqrt_grouping_loss(loss_fn, params, batch, has_aux))
    if name not in POLICIES:
        raise ValueError(f"unknown comparison point {name!r}: one of {', '.join(NAMES)}")
    return BuiltinPoint(policy_loss(loss_fn, params, batch, POLICIES[name], has_aux),
                        "per block")


def builtin_loss(name: str, step: Step, params, batch: Sequence) -> Callable:
    """The comparison point `name` (one of NAMES) of `step` as a loss function."""
    return builtin_point(name, step, params, batch).loss


def measure_builtin(name: str, step: Step, params, batch,
                    programs: dict | None = None) -> Measurement:
    """XLA's peak and FLOPs of `step` with comparison point `name` (per device under its
    sharding; `programs` as verify.measure takes it)."""
    return measure_step(step.with_loss(builtin_loss(name, step, params, batch)), params,
                        batch, programs)
