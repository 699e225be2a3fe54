"""Stage 3: the memory model - fixed bytes, per-stage costs, and the peak of a plan.

Per stage the model needs what each keep option keeps: for `store`, what XLA keeps for
the stage's backward (read from its compiled HLO, hlo.py); for a checkpoint policy, what
JAX's autodiff keeps (measured by tracing `jax.vjp` of the stage with the policy). Also
the FLOPs a policy recomputes, and the transient workspace XLA needs for the stage's
forward and backward (its forward compiled alone: XLA's temp; its forward and backward
compiled together: the most bytes live at once in XLA's schedule, beyond the stage's
boundaries, hlo.live_peak_bytes). Identical stages
(transformer blocks) are measured once. `simulate` then walks a plan's schedule -
forward through the segments, backward in reverse with recomputation - and returns its
activation peak and recompute cost. The solver optimises exactly this model; verify
checks it against XLA.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections import Counter
from typing import Callable, ClassVar, Sequence

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import hlo
from .graph import (CostGraph, definitions, jaxpr_bytes, jaxpr_flops, last_uses,
                    value_uses, varying_values)
from .plan import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING, KeepRule, NamesAnOption, Segment,
                   Store)
from .policies import dot_is_narrow
from .trace import Literal, Program, eval_eqn, eval_range, nbytes
from .sharding import per_device_fixed, update_jit_kwargs

CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
_NOTHING = KeepRule(NOTHING)  # the checkpoint keeping only its inputs


def compiler_options() -> dict:
    """XLA options that keep remat: on CPU `cse_barrier_expander` undoes it
    (docs/jax-facts.md, fact 1)."""
    return dict(CPU_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


def measure_compiler_options() -> dict:
    """Options for compiles that are only measured, never run: LLVM's optimisation level
    does not change XLA's buffer assignment or FLOP count, and level 0 compiles faster."""
    return {**compiler_options(), "xla_backend_optimization_level": 0}


def tree_bytes(tree) -> int:
    return int(sum(nbytes(l) for l in jax.tree.leaves(tree)))


# ---------------------------------------------------------------------------------------
# Fixed memory
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FixedMemory:
    """Bytes live for the whole step, whatever the plan."""

    params_bytes: int
    grads_bytes: int
    opt_state_bytes: int
    batch_bytes: int
    update_temp_bytes: int  # XLA workspace of the optimizer update, after the backward
    aux_bytes: int = 0  # aux outputs of a has_aux step (new batch stats), live to its end
    # Of grads_bytes, the gradients charged to the backward of the one stage that uses
    # their parameter instead (stage_gradient_bytes): live only while it runs.
    staged_grads_bytes: int = 0
    # Of grads_bytes, the other gradients, charged along the step where they exist
    # (memory.with_gradient_timeline: not in the forward) and to the update.
    timed_grads_bytes: int = 0

    @property
    def total(self) -> int:
        return (self.params_bytes + self.grads_bytes - self.staged_grads_bytes
                - self.timed_grads_bytes + self.opt_state_bytes + self.batch_bytes
                + self.aux_bytes)

    @property
    def update_bytes(self) -> int:
        """What the optimizer update adds to `total` after the backward: its workspace and
        the timed gradients it reads."""
        return self.update_temp_bytes + self.timed_grads_bytes


def fixed_memory(params, batch, optimizer=None, sharding=None) -> FixedMemory:
    """Fixed bytes of the step: params, grads (floating leaves), optimizer state, batch.

    With `sharding` (a sharding.ShardingSpec) every figure is one device's: each tensor
    counts its shard (gradients are sharded like their parameters)."""
    if sharding is not None:
        return _sharded_fixed_memory(params, batch, optimizer, sharding)
    leaves = jax.tree.leaves(params)
    grads = sum(nbytes(l) for l in leaves
                if jax.dtypes.issubdtype(l.dtype, np.inexact))
    opt_bytes = 0
    update_temp = 0
    if optimizer is not None:
        opt_state = jax.eval_shape(optimizer.init, params)
        opt_bytes = tree_bytes(opt_state)
        update_temp = _update_temp_bytes(optimizer, params, opt_state)
    return FixedMemory(tree_bytes(params), grads, opt_bytes, tree_bytes(batch), update_temp)


def _sharded_fixed_memory(params, batch, optimizer, spec) -> FixedMemory:
    (p_bytes, grads, opt_bytes, b_bytes), sh = per_device_fixed(spec, params, batch, optimizer)
    update_temp = 0
    if optimizer is not None:
        opt_state = jax.eval_shape(optimizer.init, params)
        update_temp = _update_temp_bytes(optimizer, params, opt_state, sh)
    return FixedMemory(p_bytes, grads, opt_bytes, b_bytes, update_temp)


def _update_temp_bytes(optimizer, params, opt_state, shardings=None) -> int:
    import optax

    def update(grads, state, p):
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    import warnings

    grads = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, l.dtype), params)
    # In the real step the gradients are temporaries of the same program, so they are
    # donated here; XLA warns that it cannot reuse all of them, which is expected.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        kw = update_jit_kwargs(shardings)  # sharded: one device's workspace of the update
        compiled = jax.jit(update, donate_argnums=(0, 1, 2), **kw).lower(
            grads, opt_state, params).compile(measure_compiler_options())
    return int(compiled.memory_analysis().temp_size_in_bytes)


# ---------------------------------------------------------------------------------------
# Gradient lifetimes
# ---------------------------------------------------------------------------------------

def per_parameter_update(optimizer, params) -> bool:
    """Whether the optimizer's update of each parameter reads only that parameter's own
    gradient (SGD, Adam, AdamW, weight decay, per-leaf schedules): then XLA applies each
    update as soon as that gradient is complete and frees it, so a gradient lives only
    through the backward of the stages that use its parameter (measured: 8 dense layers
    of 1024 x 1024, 32 MiB of gradients, the donated AdamW step's temp is 10 MiB at batch
    64; with clip_by_global_norm first, 64 MiB). Read from
    the update's dataflow: an update that reads other gradients (clip_by_global_norm
    needs all of them first) keeps every gradient until the backward ends."""
    grads = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, l.dtype), params)
    state = jax.eval_shape(optimizer.init, params)
    closed = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p)[0])(grads, state, params)
    n = len(jax.tree.leaves(grads))
    seeds = [frozenset({i}) if i < n else frozenset()
             for i in range(len(closed.jaxpr.invars))]
    outs = _gradient_dependence(closed.jaxpr, seeds)
    return all(not (d - {i}) for i, d in enumerate(outs))


def _gradient_dependence(jaxpr, seeds: list[frozenset]) -> list[frozenset]:
    """For each output of `jaxpr`: the gradient leaves it depends on, given those of its
    inputs (`seeds`). Calls are followed inside; other structured equations (loops,
    conditionals) make every output depend on every input."""
    deps = dict(zip(jaxpr.invars, seeds))
    read = lambda v: frozenset() if isinstance(v, jax.extend.core.Literal) else deps.get(v, frozenset())  # noqa: E731
    for e in jaxpr.eqns:
        inner = None
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            sub = e.params.get(key)
            sub = getattr(sub, "jaxpr", sub)
            if sub is not None and hasattr(sub, "eqns") and e.primitive.name != "scan":
                inner = sub
                break
        if inner is not None and len(inner.invars) == len(e.invars):
            results = _gradient_dependence(inner, [read(v) for v in e.invars])
        else:
            union = frozenset().union(*(read(v) for v in e.invars))
            results = [union] * len(e.outvars)
        for o, d in zip(e.outvars, results):
            deps[o] = d
    return [read(v) for v in jaxpr.outvars]


def stage_gradient_bytes(program: Program, cost: CostGraph) -> tuple[int, ...]:
    """Per stage: bytes of the gradients of the floating parameters only that stage uses.

    Such a gradient is written by the stage's backward and, under a per-parameter update,
    applied and freed right after it. A parameter used by several stages (tied input and
    output embeddings) has its gradient accumulated from the last stage's backward to the
    first's, live over most of the step: it stays in fixed memory, as do parameters no
    stage uses."""
    return _own_parameter_bytes(program, cost, gathered_only=False)


def _own_parameter_bytes(program: Program, cost: CostGraph, gathered_only: bool) -> tuple[int, ...]:
    """Per stage: bytes of the floating parameters only that stage reads; with
    `gathered_only`, of those it reads only as a gather's operand (embedding tables)."""
    users: dict[int, set[int]] = {v: set() for v in program.invars[:program.n_param_leaves]
                                  if _is_float(program.avals[v])}
    other_use: set[int] = set()
    for k, st in enumerate(cost.stages):
        for e in program.eqns[st.start:st.stop]:
            for j, v in enumerate(e.invars):
                if isinstance(v, int) and v in users:
                    users[v].add(k)
                    if e.name != "gather" or j != 0:
                        other_use.add(v)
    out = [0] * len(cost.stages)
    for v, ks in users.items():
        if len(ks) == 1 and not (gathered_only and v in other_use):
            out[next(iter(ks))] += program.nbytes(v)
    return tuple(out)


def with_gradient_timeline(chain: "ChainModel", timed: int,
                           held: Sequence[int] | None) -> "ChainModel":
    """The chain with `timed` bytes of gradients, left out of fixed memory
    (FixedMemory.timed_grads_bytes), live where they exist: none in the step's own
    forward, before any backward has run; all of them through the backward, or, where the
    update holds every gradient until the backward ends (`held`: per stage, the bytes of
    the gradients of the parameters only that stage uses, stage_gradient_bytes), those of
    the stages whose backward has run, and of the parameters several stages use, from
    its start. Measured (docs/jax-facts.md, fact 3): with clip_by_global_norm before
    AdamW, XLA's temp holds every gradient at the end of the backward; no gradient is
    live in the forward."""
    if held is None:
        live = (int(timed),) * (chain.n + 1)
    else:
        live = tuple(int(timed - done) for done in itertools.accumulate(held, initial=0))
    return dataclasses.replace(chain, grads_live=live)


def carried_values(program: Program, cost: CostGraph) -> dict[int, tuple[int, int, int]]:
    """Values computed in the step that cross a cut without being differentiated: masks,
    position ids, rotary tables, RNG keys passed into every block, the output of a frozen
    prefix. Per value id: (the stage defining it, the first stage reading it, its bytes).

    XLA holds each as one buffer from its definition until the backward of the first
    stage that reads it has run, whatever the plan: every later stage reads it in its
    forward, and in its backward or its recomputation, which run before that one's
    (docs/jax-facts.md, fact 11). Counted in the boundaries and in the keep of every
    region it enters, a mask passed into n blocks would count n times."""
    stage_of, defined = _stage_definitions(program, cost, differentiated=False)
    out = {}
    for v, uses in sorted(value_uses(program).items()):  # equations reading v, in order
        if v in defined and int(stage_of[uses[-1]]) > defined[v]:
            out[v] = (defined[v], int(stage_of[uses[0]]), program.nbytes(v))
    return out


def shared_differentiated(program: Program, cost: CostGraph) -> dict[int, tuple[int, int, int, int]]:
    """Differentiated values that two or more copies of a repeated block read, computed
    before them: a Perceiver's input array every block cross-attends to, an encoder's
    output every decoder block reads. Per value id: (the stage defining it, the first and
    the last stage reading it, its bytes).

    Each is one buffer, held from its definition until the backward of the first stage
    reading it, as a carried value is (carried_values); profiled as a stage's input, it
    would count once in the keep of every stage reading it (the Perceiver's four
    cross-attention stages). Its cotangent is one buffer too, accumulated from the
    backward of the last stage reading it to that of the stage defining it
    (with_shared_cotangents)."""
    stage_of, defined = _stage_definitions(program, cost, differentiated=True)
    copy_of = {}  # stage -> (group, copy), the first group's where groups nest (units)
    for g, group in enumerate(cost.blocks):
        for j, (a, c) in enumerate(group):
            for k in range(a, c):
                copy_of.setdefault(k, (g, j))
    out = {}
    for v, uses in sorted(value_uses(program).items()):
        if v not in defined:
            continue
        readers = sorted({int(stage_of[u]) for u in uses} - {defined[v]})
        copies = Counter(g for g, _ in {copy_of[k] for k in readers if k in copy_of})
        if copies and max(copies.values()) >= 2:
            out[v] = (defined[v], readers[0], readers[-1], program.nbytes(v))
    return out


def _stage_definitions(program: Program, cost: CostGraph, differentiated: bool):
    """The stage of every equation, and per value computed in the step (not a weight,
    batch or aux output) that is differentiated or not as asked, the stage defining it."""
    varying = varying_values(program)
    skip = program.free | program.aux_outputs
    stage_of = np.zeros(len(program.eqns), dtype=np.int64)
    for k, st in enumerate(cost.stages):
        stage_of[st.start:st.stop] = k
    defined = {v: int(stage_of[i]) for i, e in enumerate(program.eqns) for v in e.outvars
               if isinstance(v, int) and (v in varying) == differentiated and v not in skip}
    return stage_of, defined


def with_shared_cotangents(chain: "ChainModel",
                           shared: dict[int, tuple[int, int, int, int]]) -> "ChainModel":
    """The chain with the cotangent of each shared differentiated value
    (shared_differentiated) live in the backward of every segment ending at a cut k after
    its defining stage and at or before its last reader (ChainModel.carried_bwd): summed
    there from its readers' backwards, read by its defining stage's."""
    if not shared:
        return chain
    base = chain.carried_bwd or (0,) * (chain.n + 1)
    extra = [sum(b for d, _, last, b in shared.values() if d < k <= last)
             for k in range(chain.n + 1)]
    fwd = chain.carried_fwd or (0,) * (chain.n + 1)
    return dataclasses.replace(chain, carried_fwd=tuple(fwd),
                               carried_bwd=tuple(int(x + y) for x, y in zip(base, extra)))


def with_carried_values(chain: "ChainModel",
                        carried: dict[int, tuple[int, int, int]]) -> "ChainModel":
    """The chain with the `carried` values (carried_values) live where XLA holds them:
    in the step's own forward from their stage on, in the backward until the first stage
    reading them has run (ChainModel.carried_fwd, carried_bwd). The chain must have been
    profiled without them (profile_stages' `carried`)."""
    if not carried:
        return chain
    def before_cut(stage_of_value: int) -> tuple[int, ...]:
        # per cut k, the bytes of the values whose given stage is before it
        return tuple(sum(b for *stages, b in carried.values() if stages[stage_of_value] < k)
                     for k in range(chain.n + 1))

    return dataclasses.replace(chain, carried_fwd=before_cut(0), carried_bwd=before_cut(1))


def table_gradient_bytes(program: Program, cost: CostGraph) -> tuple[int, ...]:
    """Per stage: bytes of the gradients of the tables only it reads, and only by gathers
    (embedding lookups: `table[tokens]`, `jnp.take`). The transpose of a gather is a
    scatter-add into zeros of the table's shape; the zeros depend on nothing, XLA's CPU
    scheduler makes them at the start of the step, and the scatter writes the gradient
    into them in the stage's backward, so the buffer lives from the step's start
    (docs/jax-facts.md, fact 12). A table read otherwise too (the output head of tied
    embeddings) gets its gradient added onto that use's: no zeros are made for it."""
    return _own_parameter_bytes(program, cost, gathered_only=True)


def with_table_gradients(chain: "ChainModel", per_stage: Sequence[int]) -> "ChainModel":
    """The chain with the zero buffers of the tables' gradients (table_gradient_bytes) live
    where XLA holds them: made at the step's start and held, as each table's gradient,
    through the backward of the stage gathering from it (with_held_from_start). The
    stage's own gradients (with_stage_gradients) must leave them out."""
    return with_held_from_start(chain, per_stage)


def with_held_from_start(chain: "ChainModel", per_stage: Sequence[int]) -> "ChainModel":
    """The chain with `per_stage` bytes per stage made at the step's start (they depend on
    nothing) and held through that stage's backward, whatever the plan: charged as
    carried values (ChainModel.carried_fwd, carried_bwd) made before the first stage and
    read by that stage's backward."""
    if not any(per_stage):
        return chain
    n = chain.n
    fwd = chain.carried_fwd or (0,) * (n + 1)
    bwd = chain.carried_bwd or (0,) * (n + 1)
    total = sum(per_stage)
    return dataclasses.replace(
        chain, carried_fwd=tuple(int(f + (total if k > 0 else 0)) for k, f in enumerate(fwd)),
        carried_bwd=tuple(int(b + sum(per_stage[:k])) for k, b in enumerate(bwd)))


def random_bits_bytes(program: Program, eqn) -> int:
    """Bytes XLA holds for the random bits one equation generates (0 for any other): JAX's
    threefry makes `random_bits` from a pair of uint32 arrays of the output's shape and
    combines them where the bits are used (with jax_threefry_partitionable, the default;
    without, each array covers half the output), so both halves are live until then
    (docs/jax-facts.md, fact 8). A raw `threefry2x32` holds its outputs. Other generators
    (an `rbg` key's) are not charged: they are not measured."""
    if eqn.name == "threefry2x32":
        return sum(program.nbytes(v) for v in eqn.outvars)
    if eqn.name != "random_bits" or "fry" not in str(program.avals[eqn.invars[0]].dtype):
        return 0
    pair = 2 if getattr(eqn.ctx, "threefry_partitionable", True) else 1
    return pair * 4 * int(np.prod(eqn.params["shape"], dtype=np.int64))


def with_random_bits(chain: "ChainModel", program: Program, cost: CostGraph) -> "ChainModel":
    """The chain with the random bits that later stages generate live in the step's own
    forward (ChainModel.ahead_pending). They depend on RNG keys alone, and XLA's CPU
    scheduler generates every stage's bits at the start of the forward, each held until
    its stage consumes it (docs/jax-facts.md, fact 8). A stage's own bits are in its
    measured workspace. A recomputation's bits, generated when it starts, are not
    charged."""
    per_stage = [sum(random_bits_bytes(program, e) for e in program.eqns[st.start:st.stop])
                 for st in cost.stages]
    if not any(per_stage):
        return chain
    return dataclasses.replace(chain, ahead_pending=_with_pending(chain, per_stage))


def _with_pending(chain: "ChainModel", per_stage: Sequence[int]) -> tuple[int, ...]:
    """chain.ahead_pending with `per_stage` bytes more made ahead for each stage: at cut k,
    those of stages k and later."""
    pending = list(reversed(list(itertools.accumulate(reversed([*per_stage, 0])))))
    old = chain.ahead_pending or (0,) * (chain.n + 1)
    return tuple(int(a + b) for a, b in zip(old, pending))


def _pooled_input(program: Program, eqn, varying: frozenset[int]):
    """(aval, padded shape) of a max or min pooling's differentiated input; None for any
    other equation, and for a pooling of a value not differentiated."""
    if eqn.name not in ("reduce_window_max", "reduce_window_min"):
        return None
    x = eqn.invars[0]
    if not isinstance(x, int) or x not in varying:
        return None
    aval = program.avals[x]
    dilation = eqn.params.get("base_dilation") or (1,) * aval.ndim
    return aval, [(d - 1) * b + 1 + lo + hi
                  for d, b, (lo, hi) in zip(aval.shape, dilation, eqn.params["padding"])]


def pooling_index_bytes(program: Program, eqn, varying: frozenset[int]) -> int:
    """Bytes of the index arrays XLA's CPU backend makes for the gradient of one max or min
    pooling (0 for any other equation, and for a pooling of a value not differentiated):
    one `s32` iota per dimension of the padded input, from which it computes the argmax
    (docs/jax-facts.md, fact 9)."""
    pooled = _pooled_input(program, eqn, varying)
    if pooled is None:
        return 0
    aval, shape = pooled
    return aval.ndim * 4 * int(np.prod(shape, dtype=np.int64))


def pooling_zeros_bytes(program: Program, eqn, varying: frozenset[int],
                        uses: dict[int, list[int]]) -> int:
    """Bytes of the zeros the gradient of one max or min pooling is scattered into (0 for
    any other equation, a pooling of a value not differentiated, or of a value read
    elsewhere too): XLA's CPU backend computes the pooling's transpose as a scatter-add
    into zeros of the padded input's shape and dtype, which depend on nothing and are
    made at the step's start. Where the input has another reader (a U-Net's skip), the
    scatter adds onto that reader's cotangent instead, as a gathered table's does
    (docs/jax-facts.md, facts 12 and 15)."""
    pooled = _pooled_input(program, eqn, varying)
    if pooled is None or len(uses.get(eqn.invars[0], ())) != 1:
        return 0
    aval, shape = pooled
    return aval.dtype.itemsize * int(np.prod(shape, dtype=np.int64))


def with_pooling_zeros(chain: "ChainModel", program: Program, cost: CostGraph) -> "ChainModel":
    """The chain with the zeros its poolings' gradients are scattered into
    (pooling_zeros_bytes) live where XLA holds them: from the step's start through the
    pooling stage's backward, whatever the plan (with_held_from_start; docs/jax-facts.md,
    fact 15). The stage's backward workspace (its forward and backward compiled alone,
    where XLA makes them at its start too) holds its own: taken out there, so that each
    is counted once; so are a whole block's."""
    varying = varying_values(program)
    uses = value_uses(program)
    per_stage = [sum(pooling_zeros_bytes(program, e, varying, uses)
                     for e in program.eqns[st.start:st.stop]) for st in cost.stages]
    if not any(per_stage):
        return chain
    prefix = np.concatenate([[0], np.cumsum(per_stage)])

    def without(profile: StageProfile, z: int) -> StageProfile:
        options = tuple(o if o.bwd_temp_bytes is None
                        else dataclasses.replace(o, bwd_temp_bytes=int(o.bwd_temp_bytes - z))
                        for o in profile.options)
        return dataclasses.replace(profile, bwd_temp_bytes=int(profile.bwd_temp_bytes - z),
                                   options=options)

    chain = dataclasses.replace(
        chain, stages=tuple(without(s, z) for s, z in zip(chain.stages, per_stage)),
        spans=tuple((a, c, without(p, int(prefix[c] - prefix[a]))) for a, c, p in chain.spans))
    return with_held_from_start(chain, per_stage)


def with_pooling_indices(chain: "ChainModel", program: Program, cost: CostGraph) -> "ChainModel":
    """The chain with the index arrays of its poolings' gradients (pooling_index_bytes)
    where XLA holds them (docs/jax-facts.md, fact 9). XLA's CPU scheduler makes them at
    the start of the step, as it makes random bits (ChainModel.ahead_pending: from the
    step's start until the pooling's stage runs), and they stay live until the pooling's
    argmax: in the forward for a stored stage, in the backward for one recomputed there.
    So every option of the stage but `store` keeps them to its backward
    (KeepOption.keep_bytes), and a checkpointed region keeps those of its stages
    (ChainModel.inputs). The stage's backward workspace (its forward and backward
    compiled together) holds them too, its forward's (compiled alone) does not: each is
    counted once (StageProfile.index_bytes: leaf_fwd_peak, leaf_bwd_peak,
    region_fwd_peak). Spans (whole blocks) the same, with their stages' sum."""
    varying = varying_values(program)
    per_stage = [sum(pooling_index_bytes(program, e, varying)
                     for e in program.eqns[st.start:st.stop]) for st in cost.stages]
    return with_index_arrays(chain, per_stage) if any(per_stage) else chain


def with_index_arrays(chain: "ChainModel", per_stage: Sequence[int]) -> "ChainModel":
    """The chain with `per_stage` bytes of index arrays per stage, made at the step's start
    and held until the stage's backward unless it is stored (with_pooling_indices)."""
    def held(profile: StageProfile, g: int) -> StageProfile:
        return dataclasses.replace(profile, index_bytes=int(g), options=tuple(
            o if isinstance(o.kind, Store) else dataclasses.replace(o, keep_bytes=o.keep_bytes + g)
            for o in profile.options))

    n = chain.n
    prefix = np.concatenate([[0], np.cumsum(per_stage)])
    inputs = tuple(tuple(int(chain.region_input_bytes(a, b) + prefix[b] - prefix[a])
                         if 0 <= a < b <= n else 0 for b in range(n + 1))
                   for a in range(n + 1))
    return dataclasses.replace(
        chain, stages=tuple(held(s, g) for s, g in zip(chain.stages, per_stage)),
        spans=tuple((a, c, held(p, prefix[c] - prefix[a])) for a, c, p in chain.spans),
        inputs=inputs, ahead_pending=_with_pending(chain, per_stage))


def with_stage_gradients(chain: "ChainModel", grads: Sequence[int]) -> "ChainModel":
    """The chain with each stage's own gradients (stage_gradient_bytes) live in its backward."""
    stages = tuple(dataclasses.replace(s, grad_bytes=int(g)) for s, g in zip(chain.stages, grads))
    spans = tuple((a, c, dataclasses.replace(p, grad_bytes=int(sum(grads[a:c]))))
                  for a, c, p in chain.spans)
    return dataclasses.replace(chain, stages=stages, spans=spans)


# ---------------------------------------------------------------------------------------
# Stage profiles
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KeepOption(NamesAnOption):
    """One way to run a stage: what it keeps for the backward and what that costs.

    `name` is the keep option's name (an `Option` given here is stored by its name);
    `kind` is the typed option (options.py), parsed once, on first use: code dispatches
    on its class, never on the name."""

    name: str
    saved: tuple[int, ...]      # value ids tagged and kept by name (checkpoint options)
    keep_bytes: int              # activation bytes kept from forward to backward
    recompute_flops: float       # extra FLOPs in the backward, vs. `store`
    # Workspaces of this option when they depend on it (scan schemes, see scan.py);
    # None: the stage's own fwd_temp_bytes / bwd_temp_bytes.
    fwd_temp_bytes: int | None = None
    bwd_temp_bytes: int | None = None
    # Extra memory traffic in the backward, vs. `store` (graph.eqn_bytes): with
    # recompute_flops, the time cost model's input (costmodel.CostModel).
    recompute_bytes: float = 0.0
    # A whole block's option (a span's) whose backward runs stage by stage: every inner
    # cut's values are made from kept ones by elementwise work, so XLA recomputes each
    # stage just before its backward (span_is_stagewise).
    stagewise: bool = False

    OPTION_FIELD: ClassVar[str] = "name"


@dataclasses.dataclass(frozen=True)
class StageProfile:
    """Measured costs of one stage (see module docstring)."""

    name: str
    flops: float
    options: tuple[KeepOption, ...]  # options[0] is `store`
    fwd_temp_bytes: int   # XLA temp of the forward compiled alone (see _xla_workspace)
    # forward+backward compiled together: its live peak less its boundaries (may be < 0)
    bwd_temp_bytes: int
    bytes_accessed: float = 0.0  # memory traffic of the forward (graph.eqn_bytes)
    # Gradients of the parameters only this stage uses: written by its backward, then
    # applied and freed (per-parameter updates; memory.stage_gradient_bytes).
    grad_bytes: int = 0
    # Index arrays of its poolings' gradients (with_pooling_indices): in its backward's
    # workspace and, under every option but `store`, in its keep too; counted once.
    index_bytes: int = 0

    def option(self, name: str) -> KeepOption:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class ChainModel:
    """Everything the solver needs: per-stage profiles and boundary bytes.

    boundary[k] is the activation bytes crossing into stage k (boundary[0] = 0) and
    boundary[n] out of the last stage (0: the loss is a scalar). overlap[a][b] (a < b) is
    the bytes of the values crossing both cut a and cut b, hence every cut between:
    tensors that pass over stages (skip connections). Empty: none (a chain).
    inputs[a][b] (a < b) is the bytes of the values crossing cut a that stages [a, b) use:
    what a checkpointed region over them keeps. Empty: all of boundary[a] (a chain).
    """

    stages: tuple[StageProfile, ...]
    boundary: tuple[int, ...]
    overlap: tuple[tuple[int, ...], ...] = ()
    inputs: tuple[tuple[int, ...], ...] = ()
    # (a, c, profile): stages [a, c) run as one checkpoint under a keep rule (a copy of a
    # repeated block, exactly what nn.remat(Block, policy=...) does); no `store` option.
    spans: tuple[tuple[int, int, "StageProfile"], ...] = ()
    # grads_live[k]: bytes of the gradients fixed memory leaves out (FixedMemory.
    # timed_grads_bytes) that exist while stage k's backward runs, or a recomputation
    # ending at cut k (with_gradient_timeline). None exists in the step's own forward.
    # Empty: none are left out.
    grads_live: tuple[int, ...] = ()
    # ahead_pending[k]: bytes of the buffers that depend on nothing and that stages k and
    # later use, which XLA makes at the start of the step and holds until their stage
    # runs: random bits (dropout masks' source, with_random_bits) and the index arrays of
    # poolings' gradients (with_pooling_indices). Empty: none.
    ahead_pending: tuple[int, ...] = ()
    # Values that cross cuts without being differentiated (masks, position ids, rotary
    # tables, a frozen prefix's output: carried_values), left out of the boundaries,
    # the keeps and the workspaces: one buffer each, from its definition to the
    # backward of the first stage that reads it (docs/jax-facts.md, fact 11).
    # carried_fwd[k]: bytes of those defined before cut k (live in the step's own
    # forward of a segment ending at cut k); carried_bwd[k]: of those whose first
    # reader is before cut k (live in the backward or recomputation of a segment ending
    # at cut k). Empty: none (with_carried_values).
    carried_fwd: tuple[int, ...] = ()
    carried_bwd: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        return len(self.stages)

    def leaf_profile(self, a: int, c: int) -> "StageProfile":
        """The profile of a leaf segment over stages [a, c): a stage, or a span."""
        if c == a + 1:
            return self.stages[a]
        for lo, hi, profile in self.spans:
            if (lo, hi) == (a, c):
                return profile
        raise KeyError(f"no span over stages [{a}, {c})")

    def spans_from(self, a: int) -> list[tuple[int, "StageProfile"]]:
        """(c, profile) of the spans starting at stage a."""
        return [(hi, profile) for lo, hi, profile in self.spans if lo == a]

    def map_profiles(self, f) -> "ChainModel":
        """This chain with f applied to every stage and span profile."""
        return dataclasses.replace(self, stages=tuple(f(s) for s in self.stages),
                                   spans=tuple((a, c, f(p)) for a, c, p in self.spans))

    def overlap_bytes(self, a: int, b: int) -> int:
        """Bytes crossing both cut a and cut b (a < b): counted once, not twice."""
        return self.overlap[a][b] if self.overlap else 0

    def gradients_at(self, k: int) -> int:
        """Bytes of the timed gradients that exist while stage k's backward runs, or a
        recomputation ending at cut k: grads_live[k]."""
        return self.grads_live[k] if self.grads_live else 0

    def ahead_bytes_pending(self, k: int) -> int:
        """Bytes made ahead for stages k and later (random bits, pooling indices), live in
        the step's own forward before stage k runs: ahead_pending[k]."""
        return self.ahead_pending[k] if self.ahead_pending else 0

    def carried_bytes(self, stop: int, top: bool) -> int:
        """Bytes of the carried values (carried_fwd, carried_bwd) live while a segment
        ending at cut `stop` runs: its forward in the step's own forward (`top`), else
        its backward or its recomputation."""
        table = self.carried_fwd if top else self.carried_bwd
        return table[stop] if table else 0

    def region_input_bytes(self, a: int, b: int) -> int:
        """Bytes a checkpointed region over stages [a, b) keeps: the activations crossing
        into it that it uses; a skip passing over it is kept by its consumer instead."""
        return self.inputs[a][b] if self.inputs else self.boundary[a]

    def first_child_shared_bytes(self, a: int, b: int, c: int,
                                 option: KeepOption | None) -> int:
        """Bytes of what the first child of a checkpointed region over [a, b) keeps that
        are arrays the region keeps already: its own inputs, which JAX holds once.

        The child covers [a, c): a leaf (c = a + 1) run with keep `option`, or a nested
        region (`option` None). The region's recomputation starts with its input,
        region_input_bytes(a, b), live; counted once more as the child's keep, the same
        arrays would count twice. Only what is provably the same is counted as shared:

        - a nested region keeps region_input_bytes(a, c): the values crossing cut a that
          [a, c) uses, a subset of those [a, b) uses (and, under fsdp, of the gathered
          weights it keeps: with_gathered_weights), so all of it;
        - a `nothing` leaf over [a, c) without pinned values keeps only its own inputs
          (activations and, under fsdp, its gathered weights: the residuals of a
          checkpoint that saves nothing), which are region_input_bytes(a, c), a
          subset of the region's input, so all of it;
        - any other leaf, none: a `store` or `dots` leaf's residuals may include inputs
          too (x of x @ w), but how many of its kept bytes they are is not measured, and
          a `nothing` leaf with pinned values (collective outputs) keeps those besides.

        The min with the region's own input only guards tables where a subset would not
        be smaller (the planner's tables grow with b: a region further right uses more).
        """
        held = self.region_input_bytes(a, b)
        if option is None:
            return min(self.region_input_bytes(a, c), held)
        if option.kind == _NOTHING and not option.saved:
            return min(option.keep_bytes, self.region_input_bytes(a, c), held)
        return 0


def stage_io(program: Program, start: int, stop: int, last=None, defs=None):
    """Input value ids (used in [start, stop), defined before) and output ids (defined in
    it, used after it), both sorted. The program's constants are not inputs: a replayed
    region closes over them (make_segment_fn), so that XLA sees them as constants, as in
    the user's own step, and a checkpoint keeps no copy of them as a residual."""
    last = last_uses(program) if last is None else last
    defs = definitions(program) if defs is None else defs
    consts = program.consts
    ins, outs = set(), set()
    for e in program.eqns[start:stop]:
        for v in e.invars:
            if isinstance(v, int) and defs[v] < start and v not in consts:
                ins.add(v)
        for v in e.outvars:
            if last.get(v, -1) >= stop:
                outs.add(v)
    return sorted(ins), sorted(outs)


def make_segment_fn(program: Program, start: int, stop: int, ins, outs,
                    tag: Sequence[int] = ()) -> Callable:
    """A function of `ins` values returning `outs` values that replays [start, stop)
    equation by equation (nested calls inlined, as a checkpointed region replays); values
    in `tag` are wrapped in checkpoint_name so a policy can keep them. The program's
    constants are closed over, not arguments (stage_io)."""
    tag = frozenset(tag)

    def fn(*args):
        env = program.region_env(ins, args)
        if tag:
            for e in program.eqns[start:stop]:
                eval_eqn(e, env)
                for v in e.outvars:
                    if v in tag:
                        env[v] = checkpoint_name(env[v], value_name(v))
        else:
            eval_range(program, start, stop, env, calls=False)
        return [env[v] for v in outs]

    return fn


def value_name(vid: int) -> str:
    return f"rp:v{vid}"


def _is_float(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)


def dot_outputs(program: Program, start: int, stop: int, rule: str) -> tuple[int, ...]:
    """Outputs of the dot_generals in equations [start, stop) of `program` that keep rule
    `rule` (DOTS_NO_BATCH, DOTS_NARROW or DOTS) saves; DOTS also keeps convolutions'
    outputs, as JAX's dots_saveable does. The value ids a Segment with that option keeps
    over those equations (`Segment.saved`), as the planner and the Flax export read them."""
    picked = []
    for e in program.eqns[start:stop]:
        if e.name == "conv_general_dilated" and rule == DOTS:
            picked.extend(e.outvars)
            continue
        if e.name != "dot_general":
            continue
        dims = e.params["dimension_numbers"]
        (_, _), (lhs_batch, _) = dims
        if rule == DOTS_NO_BATCH and lhs_batch:
            continue
        if rule == DOTS_NARROW:
            shapes = [np.shape(v.val) if isinstance(v, Literal) else program.avals[v].shape
                      for v in e.invars[:2]]
            if not dot_is_narrow(*shapes, dims):
                continue
        picked.extend(e.outvars)
    return tuple(picked)


def _structure_key(program: Program, start: int, stop: int, ins, outs) -> str:
    """Same key <=> same computation up to renaming of values (identical blocks).

    An integer literal counts by its type alone: blocks differ in the salt each folds
    into its dropout key (random_fold_in of a per-layer constant) or in an index, which
    changes no shape, byte or FLOP; a float literal counts by its value (XLA simplifies
    a product by 1.0 away)."""
    local = {v: i for i, v in enumerate(ins)}
    h = hashlib.sha256()
    for v in ins:
        h.update(program.avals[v].str_short().encode())
    for e in program.eqns[start:stop]:
        args = []
        for v in e.invars:
            args.append(_literal_key(v) if isinstance(v, Literal) else str(local.get(v, "?")))
        for v in e.outvars:
            local[v] = len(local)
        h.update(f"{e.name}|{sorted((k, repr(p)) for k, p in e.params.items())}|{args};".encode())
    h.update(str([local[v] for v in outs]).encode())
    return h.hexdigest()


def _literal_key(v: Literal) -> str:
    """_structure_key's text for a literal operand."""
    dtype = np.dtype(v.val.dtype) if hasattr(v.val, "dtype") else np.asarray(v.val).dtype
    if np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_):
        return f"L{dtype}{list(np.shape(v.val))}"
    return f"L{v.val!r}"


def profile_stages(program: Program, cost: CostGraph, *, measure_xla: bool = True,
                   progress: Callable[[str], None] | None = None,
                   pinned: frozenset[int] = frozenset(),
                   profiles: dict | None = None, xla_keeps: bool = True,
                   forward_alone: bool = True,
                   carried: frozenset[int] = frozenset(),
                   returns_loss: bool = True) -> ChainModel:
    """Measure every stage's keep options, residual bytes and XLA workspace.

    With `measure_xla` and `xla_keeps`, a stored stage keeps what XLA keeps for its
    backward (hlo.py; docs/jax-facts.md, fact 7); else JAX's residual list. A scan
    body's stages pass `xla_keeps=False`: the scan's forward loop writes JAX's residuals
    out as stacked outputs, which XLA's fusion cannot drop (scan.body_chain).
    With `forward_alone` a stage's forward workspace is its forward compiled alone, else
    its forward and backward compiled together (a scan body's sub-stages, whose
    iteration computes its residuals in its own temp before writing them to the stack;
    tests/test_scan.py pins the mixed schemes within 3.5% of XLA with it).

    `pinned` values (outputs of collectives in a sharded step, sharding.collective_outputs)
    are kept by every checkpoint option: recomputing them would repeat communication.

    `carried` values (carried_values) are left out of the boundaries, the keeps and the
    workspaces, as the weights are: with_carried_values then adds each once, where XLA
    holds it.

    With `returns_loss` (a step's program, not a scan body's) the stage making the loss
    is profiled returning it, as the step returns it (_xla_workspace's `returned`).

    Identical stages (transformer blocks) are profiled once per call. `profiles`: a dict
    the caller keeps to reuse profiles across calls on the same program (one analysis
    per sharding scheme of one step: scripts/shard_report.py); its keys name the program
    (its fingerprint), so one dict may serve several programs. Without it nothing is
    kept between calls."""
    last, defs = last_uses(program), definitions(program)
    free = program.free | carried
    varying = varying_values(program)
    loss = program.outvars[0] if program.outvars else None
    returned = frozenset({loss}) if returns_loss and isinstance(loss, int) else frozenset()
    if profiles is None:
        cache = _Profiles({}, "")
    else:
        cache = _Profiles(profiles, f"{program.fingerprint()}|{measure_xla}|{xla_keeps}|"
                                    f"{forward_alone}|{bool(carried)}|{bool(returned)}|")
    stages = []
    for k, st in enumerate(cost.stages):
        ins, outs = stage_io(program, st.start, st.stop, last, defs)
        wrt = differentiated(ins, varying)
        # blocks before the first trainable parameter have no backward: not identical to later ones
        key = _structure_key(program, st.start, st.stop, ins, outs) + str(wrt)
        local_pins = _local_pins(program, st.start, st.stop, pinned)
        key += str(local_pins)
        if key not in cache:
            if progress:
                progress(f"profiling stage {k + 1}/{len(cost.stages)} {st.name}")
            cache[key] = _profile_one(program, st.start, st.stop, ins, outs, free, wrt, measure_xla,
                                      pinned, xla_keeps, forward_alone, returned)
        opts_local, wf, wb, local_names = cache[key]
        # Saved value ids are local to the first stage with this structure: map them over.
        mapping = _value_mapping(program, local_names, st.start, st.stop)
        options = tuple(dataclasses.replace(o, saved=tuple(mapping[v] for v in o.saved))
                        for o in opts_local)
        stages.append(StageProfile(st.name, st.flops, options, wf, wb, st.bytes_accessed))
    spans = []
    for a, c in cost.spans:  # one checkpoint over a whole block copy, under each keep rule
        lo, hi = cost.stages[a].start, cost.stages[c - 1].stop
        ins, outs = stage_io(program, lo, hi, last, defs)
        wrt = differentiated(ins, varying)
        key = (_structure_key(program, lo, hi, ins, outs) + str(wrt)
               + str(_local_pins(program, lo, hi, pinned)))
        if key not in cache:
            if progress:
                progress(f"profiling block of stages {a + 1}-{c}/{len(cost.stages)}")
            cache[key] = _profile_one(program, lo, hi, ins, outs, free, wrt, measure_xla, pinned,
                                      xla_keeps)
        opts_local, wf, wb, local_names = cache[key]
        mapping = _value_mapping(program, local_names, lo, hi)
        options = tuple(dataclasses.replace(o, saved=tuple(mapping[v] for v in o.saved))
                        for o in opts_local if not isinstance(o.kind, Store))
        options = tuple(dataclasses.replace(o, stagewise=span_is_stagewise(
            program, [st.start for st in cost.stages[a:c]] + [hi], set(o.saved), defs))
            for o in options)
        flops = sum(s.flops for s in cost.stages[a:c])
        traffic = sum(s.bytes_accessed for s in cost.stages[a:c])
        name = f"{cost.stages[a].name} .. {cost.stages[c - 1].name}"
        spans.append((a, c, StageProfile(name, flops, options, wf, wb, traffic)))
    boundary = [0] + [cost.boundary_bytes(k) for k in range(1, len(cost.stages))] + [0]
    for k, b in enumerate(_carried_crossing(program, cost, carried, last, defs)):
        boundary[k] -= b
    return ChainModel(tuple(stages), tuple(int(b) for b in boundary),
                      cut_overlap(program, cost, last, defs, carried),
                      region_inputs(program, cost, boundary, last, defs, carried), tuple(spans))


def _carried_crossing(program: Program, cost: CostGraph, carried, last, defs) -> list[int]:
    """Per cut k (0..n): the bytes of the `carried` values crossing it, as counted in
    CostGraph.boundary_bytes."""
    n = len(cost.stages)
    out = [0] * (n + 1)
    for k in range(1, n):
        at = cost.stages[k - 1].stop
        out[k] = sum(program.nbytes(v) for v in carried if defs[v] < at <= last.get(v, -1))
    return out


def region_inputs(program: Program, cost: CostGraph, boundary, last=None, defs=None,
                  carried: frozenset[int] = frozenset()):
    """inputs[a][b]: bytes of the activations crossing cut a that stages [a, b) use; ()
    when that is always all of boundary[a] (every value crossing a cut is used by the
    next stage: a chain)."""
    last = last_uses(program) if last is None else last
    defs = definitions(program) if defs is None else defs
    n = len(cost.stages)
    starts = [s.start for s in cost.stages]
    stage_of = np.zeros(len(program.eqns) + 1, dtype=np.int64)
    for k, st in enumerate(cost.stages):
        stage_of[st.start:st.stop] = k
    stage_of[-1] = n
    first_use = value_uses(program)  # value -> sorted equations using it
    skip = program.free | program.aux_outputs | carried
    table = np.zeros((n + 1, n + 1), dtype=np.int64)
    import bisect
    for v, uses in first_use.items():
        if v in skip:
            continue
        for a in range(1, n):
            if not defs[v] < starts[a] <= last[v]:
                continue
            j = bisect.bisect_left(uses, starts[a])
            used_in = int(stage_of[uses[j]]) if j < len(uses) else n  # first stage using it
            table[a, used_in + 1:] += program.nbytes(v)
    if all(table[a, b] == boundary[a] for a in range(1, n) for b in range(a + 1, n + 1)):
        return ()
    return tuple(tuple(int(x) for x in row) for row in table)


def cut_overlap(program: Program, cost: CostGraph, last=None, defs=None,
                carried: frozenset[int] = frozenset()):
    """overlap[a][b]: bytes of the activations crossing both cut a and cut b (cut k is the
    start of stage k), as counted in the boundaries; () when no value crosses two cuts."""
    last = last_uses(program) if last is None else last
    defs = definitions(program) if defs is None else defs
    n = len(cost.stages)
    starts = np.asarray([s.start for s in cost.stages[1:]], dtype=np.int64)  # cuts 1..n-1
    table = np.zeros((n + 1, n + 1), dtype=np.int64)
    skip = program.free | program.aux_outputs | carried
    for v, used in last.items():
        if v in skip or used <= defs[v]:
            continue
        lo = int(np.searchsorted(starts, defs[v], side="right")) + 1  # first cut with start > def
        hi = int(np.searchsorted(starts, used, side="right"))         # last cut with start <= use
        if hi > lo:
            table[lo:hi + 1, lo:hi + 1] += program.nbytes(v)
    if not table.any():
        return ()
    return tuple(tuple(int(x) for x in row) for row in table)


@dataclasses.dataclass(frozen=True)
class _Profiles:
    """profile_stages' view of a profiles dict under one program's prefix (its
    fingerprint and whether XLA's workspace was measured)."""

    store: dict
    prefix: str

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.store

    def __getitem__(self, key: str):
        return self.store[self.prefix + key]

    def __setitem__(self, key: str, value) -> None:
        self.store[self.prefix + key] = value


def _local_pins(program: Program, start: int, stop: int, pinned) -> tuple:
    """Positions (equation, output) of the pinned values defined in [start, stop)."""
    if not pinned:
        return ()
    return tuple((i, j) for i, e in enumerate(program.eqns[start:stop])
                 for j, v in enumerate(e.outvars) if v in pinned)


def _value_mapping(program: Program, ref, start: int, stop: int) -> dict[int, int]:
    """Map value ids defined in the reference stage to the same position in [start, stop)."""
    ref_start, ref_stop = ref
    mapping = {}
    for ea, eb in zip(program.eqns[ref_start:ref_stop], program.eqns[start:stop]):
        mapping.update(zip(ea.outvars, eb.outvars))
    return mapping


def _profile_one(program, start, stop, ins, outs, free, wrt, measure_xla, pinned=frozenset(),
                 xla_keeps=True, forward_alone=True, returned=frozenset()):
    # outputs in `free` (carried values) are not differentiated: no cotangent
    fn_outs = [v for v in outs if _is_float(program.avals[v]) and v not in free]
    step_outputs = tuple(i for i, v in enumerate(fn_outs) if v in returned)
    in_avals = [jax.ShapeDtypeStruct(program.avals[v].shape, program.avals[v].dtype) for v in ins]
    ct_avals = [jax.ShapeDtypeStruct(program.avals[v].shape, program.avals[v].dtype)
                for v in fn_outs]
    act_inputs = {i for i, v in enumerate(ins) if v not in free}

    def residual_bytes(f):
        # params, batch and constants are live anyway
        return sum(r.nbytes for r in residuals(f, in_avals, wrt)
                   if r.input is None or r.input in act_inputs)

    def step_cost(f):
        """FLOPs and memory traffic of the stage's forward + backward."""
        closed = jax.make_jaxpr(lambda a, ct: vjp_wrt(f, a, wrt)[1](ct))(in_avals, ct_avals)
        return np.array([jaxpr_flops(closed), jaxpr_bytes(closed)])

    pins = tuple(v for e in program.eqns[start:stop] for v in e.outvars if v in pinned)
    with_pins = lambda saved: tuple(sorted(set(saved) | set(pins))) if pins else saved
    candidates = [(Store(), ()), (KeepRule(NOTHING), with_pins(())),
                  *((KeepRule(rule), with_pins(dot_outputs(program, start, stop, rule)))
                    for rule in (DOTS_NO_BATCH, DOTS_NARROW, DOTS))]
    base = make_segment_fn(program, start, stop, ins, fn_outs)
    base_cost = step_cost(base)
    options, seen_saved = [], set()
    for kind, saved in candidates:
        stored = isinstance(kind, Store)
        if not stored:
            if saved in seen_saved:
                continue  # same keep set as an earlier option
            seen_saved.add(saved)
            tagged = make_segment_fn(program, start, stop, ins, fn_outs, tag=saved)
            policy = jax.checkpoint_policies.save_only_these_names(*map(value_name, saved))
            f = jax.checkpoint(tagged, policy=policy)
        else:
            f = base
        rc = np.zeros(2) if stored else np.maximum(0.0, step_cost(f) - base_cost)
        options.append(KeepOption(kind, saved, residual_bytes(f), float(rc[0]),
                                  recompute_bytes=float(rc[1])))
    wf = wb = 0
    if measure_xla and fn_outs:
        wf, wb, xla_kept, stored_fwd = _xla_workspace(
            base, in_avals, ct_avals, wrt, frozenset(act_inputs), forward_alone, step_outputs)
        if xla_kept is not None and xla_keeps and any(c.shape for c in ct_avals):
            # A stored stage keeps what XLA's fusion keeps, not JAX's residual list
            # (hlo.py; docs/jax-facts.md, fact 7). The checkpoint options keep the
            # values they name, which XLA keeps as they are. Not for a stage whose
            # cotangents are all scalars (the loss): XLA runs its backward's products
            # ahead of the scalar and keeps their results, which the step, whose
            # cotangent is a constant, does not.
            # Its forward holds what it keeps with its workspace, not beside the
            # workspace of the forward compiled alone (fact 16).
            options[0] = dataclasses.replace(options[0], keep_bytes=xla_kept,
                                             fwd_temp_bytes=stored_fwd)
    return tuple(options), wf, wb, (start, stop)


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array JAX's autodiff keeps from a stage's forward for its backward."""

    aval: object            # its jax aval (JAX's own shape and dtype)
    primitive: str          # the primitive that produced it; "" for one of the inputs
    input: int | None       # its position in the stage's inputs, when it is one
    output: int | None      # its position in the stage's outputs, when it is one
    nbytes: int             # bytes XLA keeps for it (kept_bytes)


def residuals(f, in_avals, wrt) -> list[Residual]:
    """The arrays `jax.vjp` of `f` (a function of `in_avals` returning a list, the
    positions `wrt` differentiated) keeps for the backward, each once: what the memory
    model sizes a stage by, and what explain lists. An input or an output of `f` kept as
    a residual says so (`input`, `output`), so a caller can tell it is the same array as
    a neighbouring stage's. Sizes are kept_bytes: a sub-float32 dot's result counts at
    float32 where XLA keeps it wide (narrow_dots_kept_wide)."""
    n_out = []

    def forward(*a):
        out, back = vjp_wrt(f, a, wrt)
        n_out.append(len(jax.tree.leaves(out)))
        return jax.tree.leaves(out) + jax.tree.leaves(back)

    jaxpr = jax.make_jaxpr(forward)(*in_avals).jaxpr
    outs, kept = jaxpr.outvars[:n_out[0]], jaxpr.outvars[n_out[0]:]
    producers = {id(o): e for e in jaxpr.eqns for o in e.outvars}
    widen = narrow_dots_kept_wide()

    def position(vars_, v):
        return next((i for i, o in enumerate(vars_) if o is v), None)

    found, seen = [], set()
    for v in kept:
        if isinstance(v, jax.extend.core.Literal) or id(v) in seen:
            continue
        seen.add(id(v))
        eqn = producers.get(id(v))
        found.append(Residual(v.aval, eqn.primitive.name if eqn else "",
                              position(jaxpr.invars, v), position(outs, v),
                              kept_bytes(jaxpr, v) if widen else nbytes(v.aval)))
    return found


def narrow_dots_kept_wide() -> bool:
    """Whether the model sizes a kept bfloat16/float16 dot's result at float32 width.

    XLA:CPU runs such dots in float32 on converted operands. Sizing their kept results
    at float32 was measured right on the scanned bf16 llama (sized at bf16, `dots` plans
    were 2-4 MiB under XLA on the tiny llama and ~10 GiB under it on llama-1b). A flat
    checkpoint keeps them at bf16 width across its optimization barrier
    (docs/jax-facts.md, fact 17): there the float32 sizing over-counts them, which on
    the bf16 models measured offsets the parameter copies the model leaves out (fact 6);
    sized at bf16 their plans went from mixed errors to all under XLA, so it stays until
    the copies are charged. Accelerators with native bf16 dots keep the narrow result."""
    return jax.default_backend() == "cpu"


# Primitives that pass a value through unchanged in storage: a residual produced by one
# of them is the buffer of its operand (a checkpoint_name tag, the rounding JAX adds
# after one).
_PASS_THROUGH = frozenset({"name", "reduce_precision"})


def kept_bytes(jaxpr, v) -> int:
    """Bytes XLA keeps for residual `v` of `jaxpr`: its own, or float32's for the result
    of a sub-float32 dot_general (narrow_dots_kept_wide), also through tags and nested
    jits (jnp.einsum)."""
    size = nbytes(v.aval)
    if not _is_float(v.aval) or v.aval.dtype.itemsize >= 4 or not _produced_by_dot(jaxpr, v):
        return size
    return size // v.aval.dtype.itemsize * 4


def _produced_by_dot(jaxpr, v) -> bool:
    for e in reversed(jaxpr.eqns):
        if not any(o is v for o in e.outvars):
            continue
        name = e.primitive.name
        if name == "dot_general":
            return True
        if name in _PASS_THROUGH and not isinstance(e.invars[0], jax.extend.core.Literal):
            return _produced_by_dot(jaxpr, e.invars[0])
        inner = e.params.get("jaxpr")
        if name in ("pjit", "jit", "closed_call") and inner is not None:
            inner = getattr(inner, "jaxpr", inner)
            out = inner.outvars[[id(o) for o in e.outvars].index(id(v))]
            return not isinstance(out, jax.extend.core.Literal) and _produced_by_dot(inner, out)
        return False
    return False


def differentiated(ins, varying: frozenset[int]) -> tuple[int, ...]:
    """Positions in a stage's inputs `ins` that its backward differentiates."""
    return tuple(i for i, v in enumerate(ins) if v in varying)


def vjp_wrt(f, args, wrt):
    """`jax.vjp` of `f(*args)` with respect to `args[i]` for i in `wrt` only."""
    def partial(*diff):
        full = list(args)
        for i, x in zip(wrt, diff):
            full[i] = x
        return f(*full)
    return jax.vjp(partial, *[args[i] for i in wrt])


def _xla_workspace(f, in_avals, ct_avals, wrt, activation_inputs: frozenset[int] = frozenset(),
                   forward_alone: bool = True,
                   returned: tuple[int, ...] = ()) -> tuple[int, int, int | None, int | None]:
    """A stage's forward and backward workspaces, the bytes XLA keeps from its forward for
    its backward (hlo.kept_bytes; None without a backward), and the forward's workspace
    when the stage is stored (None without a backward): what its forward holds at once
    beyond its inputs and what it keeps (hlo.forward_peak_bytes), which the forward
    compiled alone, freeing what it would keep, does not show (docs/jax-facts.md, fact 16).

    The forward's is the stage's forward compiled alone: XLA's temp, what it needs beyond
    its inputs, outputs and what it keeps (those the model counts apart), as it runs in
    the step's forward or in a recomputation. The backward's is read from the forward
    and backward compiled together, where XLA's fusion decides what is really kept: the
    most bytes live at once in its schedule (hlo.live_peak_bytes: its activation inputs
    and output cotangents until their last use, its input cotangents from when they are
    made, its temporaries; not its weights nor their gradients, counted apart), less its
    activation inputs, output cotangents and input cotangents, which leaf_bwd_peak adds
    as the stage's boundaries. It is negative when those are not all live at once
    (docs/jax-facts.md, fact 10). That compile's temp bounds the forward's too, so the
    smaller of the two is the forward's. A stage with nothing to differentiate has no
    backward: its forward alone is compiled. `activation_inputs`: positions in
    `in_avals` of the activations (the rest are weights, batch and constants, live
    anyway). Without `forward_alone` the forward's is the forward+backward compile's
    temp, and the forward is not compiled alone (profile_stages). `returned`: positions
    of f's outputs the step returns (the loss): that compile returns them too, as the
    step does, and XLA computes them after the backward, holding what they read
    (docs/jax-facts.md, fact 13)."""
    def forward_temp() -> int:
        fwd = jax.jit(f).lower(*in_avals).compile(measure_compiler_options())
        return int(fwd.memory_analysis().temp_size_in_bytes)

    if not wrt:
        temp = forward_temp()
        return temp, temp, None, None
    # every argument kept, so that entry parameter k of the HLO is argument k
    # (the returned outputs after the cotangents: output k is input cotangent k)
    def fwd_bwd(a, ct):
        out, vjp = vjp_wrt(f, a, wrt)
        return (*vjp(ct), *(out[i] for i in returned))

    both = jax.jit(fwd_bwd, keep_unused=True)
    compiled = both.lower(in_avals, ct_avals).compile(measure_compiler_options())
    n_in, n_ct = len(in_avals), len(ct_avals)
    text = compiled.as_text()
    kept = hlo.kept_bytes(text, set(activation_inputs), set(range(n_in, n_in + n_ct)))
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    weight_grads = {k for k, i in enumerate(wrt) if i not in activation_inputs}
    live = hlo.live_peak_bytes(text, set(activation_inputs) | set(range(n_in, n_in + n_ct)),
                               weight_grads)
    inputs = sum(nbytes(in_avals[i]) for i in activation_inputs)
    io = (inputs + sum(nbytes(in_avals[i]) for i in wrt if i in activation_inputs)
          + sum(nbytes(c) for c in ct_avals) + sum(nbytes(ct_avals[i]) for i in returned))
    stored = hlo.forward_peak_bytes(text, set(activation_inputs), set(range(n_in, n_in + n_ct)))
    return ((min(forward_temp(), temp) if forward_alone else temp), live - io, kept,
            stored - inputs - kept)


def scaled_workspace(w: int, beta: float) -> int:
    """A stage workspace times the calibration's workspace scale beta. A negative one is
    not workspace but boundaries not live at the stage's backward peak (_xla_workspace):
    it is not scaled, so that a prediction stays non-decreasing in beta, as the
    calibration's bisection needs."""
    return int(w * beta) if w > 0 else w


def scale_chain(chain: ChainModel, f: float) -> ChainModel:
    """Every activation byte count of `chain` times `f`: one device's share when the batch
    is split over 1/f devices (sharded steps; calibration fits the rest to XLA)."""
    sc = lambda b: int(round(b * f))
    stages = []
    for s in chain.stages:
        opts = tuple(dataclasses.replace(
            o, keep_bytes=sc(o.keep_bytes),
            fwd_temp_bytes=None if o.fwd_temp_bytes is None else sc(o.fwd_temp_bytes),
            bwd_temp_bytes=None if o.bwd_temp_bytes is None else sc(o.bwd_temp_bytes))
            for o in s.options)
        stages.append(dataclasses.replace(s, options=opts, fwd_temp_bytes=sc(s.fwd_temp_bytes),
                                          bwd_temp_bytes=sc(s.bwd_temp_bytes)))
    table = lambda t: tuple(tuple(sc(x) for x in row) for row in t)
    return ChainModel(tuple(stages), tuple(sc(b) for b in chain.boundary),
                      table(chain.overlap), table(chain.inputs),
                      carried_fwd=tuple(sc(b) for b in chain.carried_fwd),
                      carried_bwd=tuple(sc(b) for b in chain.carried_bwd))


def with_gathered_weights(chain: ChainModel, program: Program, cost: CostGraph,
                          gathered: dict[int, int]) -> ChainModel:
    """Under fsdp a checkpointed segment keeps the all-gathered weights it uses (apply
    gathers them once and keeps them, so the backward does not all-gather again; a stage
    outside checkpoints keeps them as residuals of its backward): `gathered` is parameter
    id -> one device's bytes of the gathered weight. Each stage's options keep its
    weights' bytes, and a region over stages [a, b) keeps
    those of all its stages on top of its inputs (a nested child inside it then counts
    them again: conservative)."""
    if not gathered:
        return chain
    per_stage = []
    for st in cost.stages:
        used = {v for e in program.eqns[st.start:st.stop] for v in e.invars
                if isinstance(v, int) and v in gathered}
        per_stage.append(sum(gathered[v] for v in used))
    stages = tuple(dataclasses.replace(s, options=tuple(
        dataclasses.replace(o, keep_bytes=o.keep_bytes + g) for o in s.options))
        for s, g in zip(chain.stages, per_stage))
    n = chain.n
    prefix = np.concatenate([[0], np.cumsum(per_stage)])
    inputs = tuple(tuple(int(chain.region_input_bytes(a, b) + prefix[b] - prefix[a])
                         if 0 <= a < b <= n else 0 for b in range(n + 1))
                   for a in range(n + 1))
    return dataclasses.replace(chain, stages=stages, inputs=inputs)


# ---------------------------------------------------------------------------------------
# The model of a plan
# ---------------------------------------------------------------------------------------

def forward_need(chain: ChainModel, fwd_peak: int, stop: int, top: bool) -> int:
    """What a segment's forward peak `fwd_peak` (leaf_fwd_peak, region_fwd_peak) adds to
    what is live: in the step's own forward (`top`) no gradient exists yet, but what
    the stages from the segment's end on use and XLA made ahead (random bits, pooling
    indices) does (ChainModel.ahead_bytes_pending); in a recomputation during the
    backward, the gradients of the stages from the segment's end on do (ChainModel.gradients_at, an
    upper bound: those of its region's later stages do not yet). The carried values
    live by then (ChainModel.carried_bytes) in both."""
    carried = chain.carried_bytes(stop, top)
    if top:
        return fwd_peak + chain.ahead_bytes_pending(stop) + carried
    return fwd_peak + chain.gradients_at(stop) + carried


def backward_need(chain: ChainModel, bwd_peak: int, start: int, stop: int) -> int:
    """What the backward peak (leaf_bwd_peak) of a leaf over stages [start, stop) adds to
    what is live: the gradients computed by then with it (ChainModel.gradients_at), and
    the carried values its stages or earlier ones read (ChainModel.carried_bytes)."""
    return bwd_peak + chain.gradients_at(start) + chain.carried_bytes(stop, top=False)


def leaf_fwd_peak(chain: ChainModel, i: int, option: KeepOption, stop: int | None = None,
                  top: bool = True) -> int:
    """Forward of the leaf over stages [i, stop) (one stage by default) run with `option`;
    `top`: in the step's own forward, else in a recomputation."""
    stop = i + 1 if stop is None else stop
    s = chain.leaf_profile(i, stop)
    temp = s.fwd_temp_bytes if option.fwd_temp_bytes is None else option.fwd_temp_bytes
    return (chain.boundary[i] + chain.boundary[stop] - chain.overlap_bytes(i, stop)
            + option.keep_bytes + temp - _counted_again(s, option, top))


def _counted_again(s: StageProfile, option: KeepOption, top: bool) -> int:
    """Bytes of a leaf's pooling indices (with_pooling_indices) counted more or less than
    once in its forward: the keep of every option but `store` holds them and, in a
    recomputation, so does its region's kept input; the forward's own workspace (compiled
    alone, no argmax) does not. A stored leaf of the step's forward holds them until its
    argmax, in the forward: -1 times, added."""
    return s.index_bytes * ((not isinstance(option.kind, Store)) + (not top) - 1)


def leaf_bwd_peak(chain: ChainModel, i: int, option: KeepOption | None = None,
                  stop: int | None = None, top: bool = True) -> int:
    """Backward of the leaf over stages [i, stop) (one stage by default); `top`: a leaf of
    the step's own forward, else of a recomputation (whose region keeps the leaf's pooling
    indices: its workspace does not add them again)."""
    # bwd_temp_bytes is the live peak of the stage's forward+backward compiled together,
    # less the boundaries counted here (_xla_workspace): it holds the residuals as XLA
    # keeps them (after fusion) and the backward's workspace.
    stop = i + 1 if stop is None else stop
    if stop > i + 1 and option is not None and option.stagewise:
        per_stage = _span_stage_options(chain, i, stop, option)
        if per_stage is not None:
            return _span_bwd_peak(chain, i, per_stage, top)
    s = chain.leaf_profile(i, stop)
    temp = s.bwd_temp_bytes
    if option is not None and option.bwd_temp_bytes is not None:
        temp = option.bwd_temp_bytes
    return (2 * chain.boundary[i] + chain.boundary[stop] - chain.overlap_bytes(i, stop) + temp
            + s.grad_bytes - (0 if top else s.index_bytes))


_HEAVY = frozenset({"dot_general", "conv_general_dilated", "random_bits", "threefry2x32",
                    "pjit", "custom_jvp_call", "custom_vjp_call", "while", "scan", "cond"})


def _heavy(name: str) -> bool:
    """An equation whose recomputation XLA schedules with the rest of its block, not
    lazily: a matmul, a convolution, a reduction (a norm's statistics), random bits."""
    return name in _HEAVY or name.startswith("reduce_") or name.startswith("argm")


def span_is_stagewise(program: Program, bounds: Sequence[int], saved: set[int],
                      defs: dict[int, int]) -> bool:
    """Whether a block over stages with these bounds, run as one checkpoint keeping
    `saved`, is recomputed stage by stage in its backward: at every inner cut, the values
    crossing it that later stages of the block read are made from the block's input and
    `saved` by elementwise work alone (a pre-norm block's residual add of a saved
    projection), no matmul, convolution, reduction or random bits (_heavy). Otherwise
    XLA recomputes the earlier stage with the later one and holds its values through the
    later stage's backward: the block's stored forward and backward compiled together
    is its peak. Measured on the corpus (scripts/model_error.py, each block under one
    rule): under `nothing` the stagewise model put the transformers 7-13% under XLA;
    under `dots_with_no_batch_dims` the whole-block one put the pre-norm
    `nn.SelfAttention` and nnx LMs 8-10% over, while it fits the GPT-2 with dropout
    (random bits) within 1%. The post-norm BERT passes this test but XLA recomputes its
    attention with the MLP: its plan is put 6.5% under XLA (docs/jax-facts.md, fact 14)."""
    lo, hi = bounds[0], bounds[-1]
    for cut in bounds[1:-1]:
        crossing = {v for e in program.eqns[cut:hi] for v in e.invars
                    if isinstance(v, int) and lo <= defs.get(v, -1) < cut}
        todo, seen = list(crossing - saved), set()
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            e = program.eqns[defs[v]]
            if _heavy(e.name):
                return False
            todo.extend(u for u in e.invars if isinstance(u, int) and u not in saved
                        and lo <= defs.get(u, -1))
    return True


def _span_stage_options(chain: ChainModel, a: int, c: int,
                        option: KeepOption) -> list[KeepOption] | None:
    """Per stage of the span over [a, c) run as one checkpoint under `option`: the stage's
    own option keeping the same values (the largest of its keep sets inside the span's;
    rules keep the same dots in a stage as in the block). None when a stage has none."""
    saved = set(option.saved)
    out = []
    for j in range(a, c):
        inside = [o for o in chain.stages[j].options
                  if not isinstance(o.kind, Store) and set(o.saved) <= saved]
        if not inside:
            return None
        out.append(max(inside, key=lambda o: len(o.saved)))
    return out


def _span_bwd_peak(chain: ChainModel, a: int, per_stage: Sequence[KeepOption],
                   top: bool) -> int:
    """Backward of a whole block run as one checkpoint (a span) whose option is
    `stagewise`: XLA recomputes each stage's values just before that stage's backward,
    so the block's backward is its stages' backwards in turn, each with what the stages
    before it keep under the rule (their inputs and saved values) still live. The
    block's forward and backward compiled as one function hold every stage's residuals
    at once; on the corpus `nn.SelfAttention` LM with each block under
    `dots_with_no_batch_dims` that put the step 8.3% over XLA, this -0.1%."""
    peak, kept = 0, 0
    for j, opt in enumerate(per_stage, start=a):
        peak = max(peak, kept + leaf_bwd_peak(chain, j, opt, top=top))
        kept += opt.keep_bytes
    return peak


def region_fwd_peak(chain: ChainModel, a: int, b: int, top: bool = False) -> int:
    """Forward of a checkpointed region over stages [a, b): its input is kept, each stage
    runs without keeping residuals. While stage j runs, the values crossing cut a (the
    kept input, and skips passing over), cut j and cut j + 1 are live, each counted once
    however many of these cuts it crosses: a value crossing cuts a and j + 1 crosses cut
    j too, so the union is |a| + |j| + |j + 1| - |a & j| - |j & j + 1|. At j = a the
    stage's input is the region's input, the same arrays (|a & a| = |a|). In the step's own
    forward (`top`) what the region's later stages use and XLA made ahead (random bits,
    pooling indices) is live too (what stages past the region use: forward_need), and
    the pooling indices of the stages run so far, stage j's included, stay (the region
    keeps them to its backward). In a recomputation the enclosing region's kept input
    holds every stage's (the workspaces, compiled forward alone, hold none)."""
    index = [s.index_bytes for s in chain.stages]
    if top:
        def ahead(j: int) -> int:
            return (chain.ahead_bytes_pending(j + 1) - chain.ahead_bytes_pending(b)
                    + sum(index[a:j + 1]))
    else:
        def ahead(j: int) -> int:
            return 0
    return max(
        chain.boundary[a] + chain.boundary[j] + chain.boundary[j + 1]
        - chain.overlap_bytes(j, j + 1)
        - (chain.overlap_bytes(a, j) if j > a else chain.boundary[a])
        + chain.stages[j].fwd_temp_bytes + ahead(j)
        for j in range(a, b))


def segment_keep(chain: ChainModel, seg: Segment, region: tuple[int, int] | None = None) -> int:
    """Bytes `seg` adds to what is live from its forward to its backward. `region`: the
    checkpointed region (a, b) whose recomputation `seg` starts (its first child), whose
    input is live already: what of it `seg` keeps is not added again
    (ChainModel.first_child_shared_bytes)."""
    if seg.children:
        keep, option = chain.region_input_bytes(seg.start, seg.stop), None
    else:
        option = chain.leaf_profile(seg.start, seg.stop).option(seg.option)
        keep = option.keep_bytes
    if region is not None:
        keep -= chain.first_child_shared_bytes(region[0], region[1], seg.stop, option)
    return keep


def weighted_chain(chain: ChainModel, bytes_weight: float) -> ChainModel:
    """The chain with recompute costs in the time model's units: every stage's forward
    FLOPs and every option's recompute FLOPs get `bytes_weight` x their memory traffic
    added (FLOP-equivalents: seconds x the machine's FLOP rate, see costmodel). The
    solver and `simulate` then minimise and report time instead of FLOPs. Memory is
    unchanged. The result carries no traffic of its own (weighting it again is a no-op)."""
    if not bytes_weight:
        return chain

    def weighted(s):
        opts = tuple(dataclasses.replace(o, recompute_flops=o.recompute_flops
                                         + bytes_weight * o.recompute_bytes, recompute_bytes=0.0)
                     for o in s.options)
        return dataclasses.replace(s, flops=s.flops + bytes_weight * s.bytes_accessed,
                                   bytes_accessed=0.0, options=opts)
    return chain.map_profiles(weighted)


@dataclasses.dataclass(frozen=True)
class TimelinePoint:
    """Modelled activation bytes live (above fixed memory) at one step of the schedule."""

    phase: str         # "forward", "recompute" (a region's forward in the backward) or "backward"
    start: int         # stage range [start, stop) being run
    stop: int
    live_bytes: int    # kept activations plus this step's transient peak
    kept_bytes: int    # of which: kept from earlier stages (what is "live" before it)


def simulate(chain: ChainModel, segments: Sequence[Segment]) -> tuple[int, float]:
    """Activation peak (bytes above fixed memory) and recompute FLOPs of a plan.

    Walks the schedule explicitly: forward through the segments keeping what each keeps,
    then backward in reverse; a checkpointed region's backward recomputes its forward
    with its children's plan, keeping its input meanwhile (which its first child, keeping
    the same arrays, does not add again: ChainModel.first_child_shared_bytes).
    """
    return run_chain(chain, segments, 0, inside_region=False)


def timeline(chain: ChainModel, segments: Sequence[Segment]) -> list[TimelinePoint]:
    """The schedule `simulate` walks, one point per segment step; max(live) is the peak."""
    events: list[TimelinePoint] = []
    run_chain(chain, segments, 0, inside_region=False, events=events)
    return events


def run_chain(chain, segments, live: int, inside_region: bool, events=None,
         region: tuple[int, int] | None = None) -> tuple[int, float]:
    """Peak and recompute FLOPs of the segment list `segments` run with `live` bytes
    already live. `inside_region`: the list is a region's recomputation (its forward
    costs FLOPs). `region`: (a, b) when the list is the body of the checkpointed region
    over [a, b), whose input `live` holds: what its first child keeps of those arrays is
    not added again (segment_keep), also while a nested first region's body runs."""
    peak, cost = live, 0.0
    kept_before, keeps = [], []
    fwd_phase = "recompute" if inside_region else "forward"
    for idx, seg in enumerate(segments):
        kept_before.append(live)
        if seg.children:
            fwd = region_fwd_peak(chain, seg.start, seg.stop, top=not inside_region)
        else:
            opt = chain.leaf_profile(seg.start, seg.stop).option(seg.option)
            fwd = leaf_fwd_peak(chain, seg.start, opt, seg.stop, top=not inside_region)
        step = live + forward_need(chain, fwd, seg.stop, top=not inside_region)
        peak = max(peak, step)
        if events is not None:
            events.append(TimelinePoint(fwd_phase, seg.start, seg.stop, step, live))
        keeps.append(segment_keep(chain, seg, region if idx == 0 else None))
        live += keeps[-1]
        if inside_region:
            cost += _recompute_forward_cost(chain, seg, last=idx == len(segments) - 1)
    for seg, before, keep in zip(reversed(segments), reversed(kept_before), reversed(keeps)):
        if seg.children:
            # The region's input is live again for its recomputation: what it kept (less,
            # as a first child, what its parent holds already).
            sub_peak, sub_cost = run_chain(chain, seg.children, before + keep, inside_region=True,
                                      events=events, region=(seg.start, seg.stop))
            peak = max(peak, sub_peak)
            cost += sub_cost
        else:
            opt = chain.leaf_profile(seg.start, seg.stop).option(seg.option)
            step = before + backward_need(
                chain, leaf_bwd_peak(chain, seg.start, opt, seg.stop, top=not inside_region),
                seg.start, seg.stop)
            peak = max(peak, step)
            if events is not None:
                events.append(TimelinePoint("backward", seg.start, seg.stop, step, before))
            cost += opt.recompute_flops
    return peak, cost


def _recompute_forward_cost(chain: ChainModel, seg: Segment, last: bool) -> float:
    """FLOPs a region's recomputation spends on this child's forward.

    A child that is not last runs its whole forward (its output feeds the next child).
    The last child's output feeds nothing inside the region, so only the work its kept
    values need is done (JAX's partial evaluation drops the rest): for a stage kept
    whole that is the forward part its backward needs, which is exactly what the
    `nothing` option recomputes; for a checkpoint option it is that minus what the
    option itself still recomputes; for a region, nothing (it keeps only its input).
    """
    if not last:
        return sum(chain.stages[j].flops for j in range(seg.start, seg.stop))
    if seg.children:
        return 0.0
    return last_child_forward_flops(chain.leaf_profile(seg.start, seg.stop), seg.option)


def last_child_forward_flops(stage: StageProfile, option: str) -> float:
    nothing = next((o for o in stage.options if o.kind == _NOTHING), None)
    needed = nothing.recompute_flops if nothing is not None else stage.flops
    return max(0.0, needed - stage.option(option).recompute_flops)
