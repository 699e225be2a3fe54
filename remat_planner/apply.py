"""Stage 5: apply a Plan by replaying the traced loss with nested jax.checkpoint regions.

Each checkpointed segment becomes its own `jax.checkpoint` (nested where the plan nests);
values a segment keeps are tagged with `checkpoint_name` and kept by a
`save_only_these_names` policy. The forward computation is the traced one, equation for
equation, so gradients are exactly those of the original loss.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from .errors import PlanMismatchError
from .graph import definitions, last_uses
from .memory import make_segment_fn, stage_io, value_name
from .plan import Plan, Segment
from .trace import Literal, Program, eval_range, trace


def input_signature(params, batch: Sequence) -> list[str]:
    """Shapes and dtypes of the batch leaves plus the parameter count, for messages."""
    sig = [f"{l.dtype}{list(np.shape(l))}" for l in jax.tree.leaves(batch)]
    n_params = sum(int(np.prod(np.shape(l), dtype=np.int64)) for l in jax.tree.leaves(params))
    return [f"params: {n_params} values"] + [f"batch[{i}]: {s}" for i, s in enumerate(sig)]


def apply_plan(plan: Plan, loss_fn: Callable) -> Callable:
    """`loss_fn(params, *batch)` whose forward is split into the plan's checkpoints."""
    programs: dict = {}

    def planned_loss(params, *batch):
        leaves, treedef = jax.tree.flatten((params, *batch))
        key = (treedef, tuple((tuple(l.shape), str(l.dtype)) for l in leaves))
        if key not in programs:
            program = trace(loss_fn, params, *batch)
            check_matches(plan, program, params, batch)
            programs[key] = (program, last_uses(program), definitions(program))
        program, last, defs = programs[key]
        env = dict(zip(program.invars, leaves))
        env.update(program.consts)
        run_segments(program, plan, plan.segments, env, last, defs)
        out = program.outvars[0]
        return out.val if isinstance(out, Literal) else env[out]

    planned_loss.__name__ = f"planned_{getattr(loss_fn, '__name__', 'loss')}"
    planned_loss.__doc__ = f"{getattr(loss_fn, '__name__', 'loss_fn')} with remat plan applied."
    return planned_loss


def check_matches(plan: Plan, program: Program, params, batch) -> None:
    if program.fingerprint() == plan.fingerprint:
        return
    here = input_signature(params, batch)
    there = plan.metadata.get("signature", [])
    diffs = [f"{b} (plan: {a})" for a, b in zip(there, here) if a != b]
    what = "; ".join(diffs) if diffs else "the traced equations differ (model code or dtype)"
    raise PlanMismatchError(f"plan does not match this computation: {what}; "
                            "re-plan for these inputs")


def run_segments(program: Program, plan: Plan, segments: Sequence[Segment], env: dict,
                 last: dict, defs: dict) -> None:
    """Evaluate `segments` in order on `env`, checkpointing the checkpointed ones."""
    for seg in segments:
        lo, hi = plan.stages[seg.start].start, plan.stages[seg.stop - 1].stop
        if not seg.is_checkpoint:
            eval_range(program, lo, hi, env)
            continue
        ins, outs = stage_io(program, lo, hi, last, defs)
        if seg.children:
            def body(*args, _seg=seg, _ins=ins, _outs=outs):
                inner = dict(zip(_ins, args))
                run_segments(program, plan, _seg.children, inner, last, defs)
                return [inner[v] for v in _outs]
        else:
            body = make_segment_fn(program, lo, hi, ins, outs, tag=seg.saved)
        policy = jax.checkpoint_policies.save_only_these_names(*map(value_name, seg.saved))
        results = jax.checkpoint(body, policy=policy)(*[env[v] for v in ins])
        env.update(zip(outs, results))
