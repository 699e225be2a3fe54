"""Scan over layers: plan a `lax.scan` layer stack (Flax `nn.scan`) as one stage.

A model that stacks its blocks with `nn.scan` traces to one `scan` equation whose body is
one block and whose `xs` are the per-layer parameters stacked on a leading axis. When
such an equation holds most of the step's FLOPs, the planner makes it a stage of its own
and gives that stage keep options that are *scan schemes*:

- per iteration, a plan over the body's sub-stages (attention | MLP in a transformer
  block, cut as graph.find_stages cuts a program): each sub-stage stored, or its own
  checkpoint keeping its inputs (plus, for `dots_no_batch` / `dots`, named dot outputs),
  or a region over the whole body with those as children. These are exactly the plans
  an unrolled block can have, profiled the same way (memory.profile_stages on the body,
  memory.simulate for one iteration), and replayed the same way (apply.run_segments);
- across iterations: keep what every iteration's plan keeps (a flat scan), or only every
  k-th carry (an outer scan over groups whose body is a checkpointed inner scan of k
  iterations: the sqrt(n) scheme), nesting deeper (k1, k2) where the budget demands it;
- the stack may be split into two consecutive scans with different schemes, which
  mixes options the way an unrolled plan mixes them per block.

The body is profiled once, whatever the number of layers. A scheme's memory and
recompute are then arithmetic on the per-iteration figures (`scheme_cost`): kept bytes
stacked over iterations, the carries of groups, the peak of the iteration being run on
top. Planning time does not grow with depth beyond enumerating the split points.

Measured facts this relies on (jax 0.10.2, CPU): remat inside a scan body survives XLA's
CPU pipeline even without `cse_barrier_expander` disabled; residuals that are `xs` (the
stacked parameters) are forwarded, not copied, by a flat scan over all of them, but a
scan over a slice or over groups gets its own copy of its parameters (an XLA while loop
owns its operands) and the parameter gradients are assembled by another copy:
`scheme_cost` charges both. XLA's cost analysis counts a loop body once (verify.measure
counts a scan's FLOPs from the jaxpr instead).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .constants import MAX_LAYERS_PER_ITERATION, MAX_SUB_STAGES, SCAN_MIN_SHARE
from .graph import (CostGraph, Stage, stage_name, build_graph, crossing_bytes, definitions,
                    eqn_flops, find_stages, jaxpr_bytes, jaxpr_flops, last_uses, stage_bytes)
from .memory import (ChainModel, KeepOption, StageProfile, cut_overlap, profile_stages,
                     region_inputs, scale_chain, scaled_workspace, segment_keep, simulate,
                     stage_io, weighted_chain)
from .plan import (NOTHING, STORE, ScanPart, ScanScheme, Segment, StageInfo, Store,
                   layer_policies, mixed_name)
from .solve import enumerate_plans
from .trace import Eqn, Program, Flattener, nbytes



# ---------------------------------------------------------------------------------------
# Recognising the layer stack
# ---------------------------------------------------------------------------------------

def eqn_flops_of(program: Program, e: Eqn) -> float:
    in_avals = [program.avals[v] if isinstance(v, int) else np.asarray(v.val) for v in e.invars]
    return eqn_flops(e.name, e.params, in_avals, [program.avals[v] for v in e.outvars])


def find_layer_scan(program: Program) -> int | None:
    """Index of the `scan` equation that is the layer stack, or None.

    It is a forward scan of at least two iterations with a floating carry that holds at
    least half of the program's forward FLOPs (the blocks of a transformer); any other
    scan (a cumulative op, a small recurrence) stays an opaque equation.
    """
    flops = [eqn_flops_of(program, e) for e in program.eqns]
    total = sum(flops)
    best = None
    for i, e in enumerate(program.eqns):
        if e.name != "scan" or e.params["length"] < 2 or e.params["reverse"]:
            continue
        carry = e.invars[e.params["num_consts"]: e.params["num_consts"] + e.params["num_carry"]]
        if not any(isinstance(v, int) and jax.dtypes.issubdtype(program.avals[v].dtype,
                                                                  jnp.floating)
                   for v in carry):
            continue
        if total > 0 and flops[i] >= SCAN_MIN_SHARE * total and (best is None or flops[i] > flops[best]):
            best = i
    return best


def isolate(program: Program, cost: CostGraph, index: int) -> tuple[CostGraph, int]:
    """`cost` with equation `index` alone in its stage; returns it and that stage's index.

    The stage holding the equation is split in up to three: the equations before it
    (an embedding, say), the scan, and the equations after it.
    """
    stages = []
    scan_stage = -1
    for st in cost.stages:
        if not st.start <= index < st.stop:
            stages.append(st)
            continue
        for lo, hi in ((st.start, index), (index, index + 1), (index + 1, st.stop)):
            if hi > lo:
                if lo == index:
                    scan_stage = len(stages)
                flops = float(sum(cost.graph.nodes[("eqn", i)]["flops"] for i in range(lo, hi)))
                stages.append(Stage(lo, hi, stage_name(program, lo, hi), flops,
                                    stage_bytes(cost.graph, lo, hi)))
    name = _stack_name(program, index)
    stages[scan_stage] = dataclasses.replace(stages[scan_stage], name=name)
    return dataclasses.replace(cost, stages=tuple(stages)), scan_stage


def _stack_name(program: Program, index: int) -> str:
    """`GPT2/h`: the scan equation's module path joined with its body's common scope."""
    eqn = program.eqns[index]
    paths = [str(e.source_info.name_stack) for e in eqn.params["jaxpr"].jaxpr.eqns]
    parts = [p.split("/") for p in paths if p]
    common = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) != 1:
            break
        common.append(level[0])
    inner = common[0] if common else "scan"
    return f"{eqn.module_path}/{inner}" if eqn.module_path else inner


# ---------------------------------------------------------------------------------------
# The body: a small chain of its own
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _BodyProgram(Program):
    """A scan body as a Program. Its carry is an activation (it differs per iteration:
    a checkpoint over the body keeps it), not a free argument like consts and xs; its
    outputs (carry, ys) are ordinary values, never aux."""

    avals_out: tuple = ()
    n_consts: int = 0
    n_carry: int = 0

    @functools.cached_property
    def free(self) -> frozenset[int]:
        carry = self.invars[self.n_consts:self.n_consts + self.n_carry]
        return (frozenset(self.invars) - frozenset(carry)) | frozenset(self.consts)

    @functools.cached_property
    def aux_outputs(self) -> frozenset[int]:
        return frozenset()


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """The scan body flattened to a Program, cut into sub-stages (attention | MLP in a
    transformer block) as graph.find_stages cuts a program."""

    eqn: Eqn
    program: _BodyProgram
    cost: CostGraph

    @property
    def length(self) -> int:
        return self.eqn.params["length"]

    @property
    def num_consts(self) -> int:
        return self.eqn.params["num_consts"]

    @property
    def num_carry(self) -> int:
        return self.eqn.params["num_carry"]

    def split(self, invals: Sequence) -> tuple[list, list, list]:
        nc, ncar = self.num_consts, self.num_carry
        return list(invals[:nc]), list(invals[nc:nc + ncar]), list(invals[nc + ncar:])

    @property
    def stages(self) -> tuple[StageInfo, ...]:
        """Sub-stages as a Plan's stages (what apply.run_segments reads)."""
        return tuple(StageInfo(st.start, st.stop, st.name) for st in self.cost.stages)


@functools.lru_cache(maxsize=32)
def layer_body(eqn: Eqn) -> Body:
    """The body of scan equation `eqn` as a Body (cached per equation)."""
    closed = eqn.params["jaxpr"]
    flat = Flattener()
    invars = tuple(flat.new(v.aval) for v in closed.jaxpr.invars)
    env = dict(zip(closed.jaxpr.invars, invars))
    for cv, val in zip(closed.jaxpr.constvars, closed.consts):
        env[cv] = flat.const(cv.aval, val)
    outvars = tuple(flat.inline(closed.jaxpr, env, prefix=""))
    # Every body input counts as a parameter leaf: the carry and xs depend on the step's
    # parameters, so the backward reaches them all (memory.varying_values).
    program = _BodyProgram(tuple(flat.eqns), invars, len(invars), flat.consts, outvars,
                           flat.avals, None,
                           avals_out=tuple(v.aval for v in closed.jaxpr.outvars),
                           n_consts=eqn.params["num_consts"], n_carry=eqn.params["num_carry"],
                           calls=tuple(flat.calls))
    graph = build_graph(program)
    cuts = _sub_stage_cuts(program, graph)
    stages = tuple(Stage(lo, hi, stage_name(program, lo, hi),
                         float(sum(graph.nodes[("eqn", i)]["flops"] for i in range(lo, hi))),
                         stage_bytes(graph, lo, hi))
                   for lo, hi in zip([0, *cuts], [*cuts, len(program.eqns)]))
    cost = CostGraph(graph, stages, crossing_bytes(program, graph),
                     float(sum(st.flops for st in stages)))
    return Body(eqn, program, cost)


def _sub_stage_cuts(body: _BodyProgram, graph) -> list[int]:
    """Where graph.find_stages cuts the body, at most MAX_SUB_STAGES pieces: with more,
    the cut that best balances the FLOPs is kept.

    The carry is a body input, which the crossing bytes find_stages reads do not count;
    in an unrolled program it is the residual stream, and a cut it crosses alongside
    another value is no cut. So a cut moves past the carry's last use (attention's
    residual add stays with attention, as in the unrolled program).
    """
    n = len(body.eqns)
    carry = set(body.invars[body.n_consts:body.n_consts + body.n_carry])
    carry_last = max((i for i, e in enumerate(body.eqns)
                      if any(isinstance(v, int) and v in carry for v in e.invars)), default=-1)
    stages = find_stages(body, graph)
    cuts = sorted({max(st.start, carry_last + 1) for st in stages[1:]} - {n})
    if len(cuts) + 1 <= MAX_SUB_STAGES:
        return cuts
    flops = np.cumsum([graph.nodes[("eqn", i)]["flops"] for i in range(n)])
    return [min(cuts, key=lambda k: abs(flops[k - 1] - flops[-1] / 2))]


def body_chain(body: Body, *, measure_xla: bool = True, profiles: dict | None = None
               ) -> ChainModel:
    """The body's sub-stages profiled like any stages (memory.profile_stages: keep options,
    residual bytes, recompute, XLA workspace; `profiles` as there), with the carry
    crossing into the first and the body's outputs out of the last. A stored sub-stage
    keeps JAX's residual list: the forward loop writes it out as stacked outputs, which
    XLA cannot fuse away as it does in an unrolled stage (docs/jax-facts.md, fact 7); its
    forward workspace is the sub-stage's forward and backward compiled together
    (memory.profile_stages' `forward_alone`)."""
    program = body.program
    chain = profile_stages(program, body.cost, measure_xla=measure_xla, profiles=profiles,
                           xla_keeps=False, forward_alone=False, returns_loss=False)
    carry = program.invars[body.num_consts:body.num_consts + body.num_carry]
    consts_xs = program.free
    boundary = list(chain.boundary)
    boundary[0] = sum(program.nbytes(v) for v in carry)
    boundary[-1] = sum(program.nbytes(v) for v in program.outvars if isinstance(v, int))
    # A carry value used past the first cut crosses it too (the tracer's crossing counts
    # only values defined by equations).
    last = last_uses(program)
    for k, st in enumerate(body.cost.stages[1:], start=1):
        boundary[k] += sum(program.nbytes(v) for v in carry
                           if v not in consts_xs and last.get(v, -1) >= st.start)
    return ChainModel(chain.stages, tuple(int(b) for b in boundary))


def whole_body_chain(body: Body, *, measure_xla: bool = True,
                     profiles: dict | None = None) -> ChainModel | None:
    """The body as one stage, profiled like any stage: its options are one checkpoint
    over the whole block under a keep rule, exactly what `nn.remat(block, policy=...)`
    inside `nn.scan` does with JAX's dots / dots-without-batch-dims policies. None when
    the body has a single sub-stage (its options are the sub-stage's already).
    `profiles` as memory.profile_stages'."""
    if body.cost.stages.__len__() < 2:
        return None
    program = body.program
    n = len(program.eqns)
    one = dataclasses.replace(body.cost, stages=(Stage(0, n, body.cost.stages[0].name,
                                                       body.cost.total_flops,
                                                       stage_bytes(body.cost.graph, 0, n)),))
    chain = profile_stages(program, one, measure_xla=measure_xla, profiles=profiles,
                           xla_keeps=False, returns_loss=False)
    carry = program.invars[body.num_consts:body.num_consts + body.num_carry]
    out = sum(program.nbytes(v) for v in program.outvars if isinstance(v, int))
    return ChainModel(chain.stages, (sum(program.nbytes(v) for v in carry), int(out)))


# ---------------------------------------------------------------------------------------
# Per-iteration plans
# ---------------------------------------------------------------------------------------

# A per-iteration plan that is one checkpoint over the whole body with a keep rule is
# written `[rule]` (e.g. `[dots_no_batch]`, JAX's policy on the block).
_WHOLE_RULES = ("dots_no_batch", "dots_narrow", "dots")

@dataclasses.dataclass(frozen=True)
class IterationPlan:
    """A plan for one iteration over the body's sub-stages, and its figures by
    memory.simulate on the body chain (the same model as an unrolled block)."""

    name: str
    segments: tuple[Segment, ...]
    keep_bytes: int         # kept from the iteration's forward to its backward
    peak_bytes: int         # the iteration's own peak: its keeps, boundaries, workspaces
    recompute_flops: float
    # One checkpoint over the whole body (`[rule]`, nn.remat(Block) inside the scan): never
    # one of several layers in an iteration (_mixed_singles says why).
    whole_body: bool = False


def plan_name(segments: Sequence[Segment]) -> str:
    """`store|nothing`: sub-stage options in order; `(...)` a region over sub-stages."""
    return "|".join(f"({plan_name(s.children)})" if s.children else s.option for s in segments)


def parse_plan(name: str, chain: ChainModel, start: int = 0,
               whole: ChainModel | None = None) -> tuple[Segment, ...]:
    """The per-iteration segments named `name` (see plan_name; `[rule]` is one checkpoint
    over the whole body, `whole` its one-stage chain); ValueError if malformed."""
    if name.startswith("[") and name.endswith("]") and start == 0:
        rule = name[1:-1]
        if whole is None or rule not in _WHOLE_RULES:
            raise ValueError(f"per-iteration plan {name!r}: no whole-body keep rule {rule!r}")
        option = whole.stages[0].option(rule)
        return (Segment(0, chain.n, option.name, option.saved),)
    segments, pos, i = [], start, 0
    while i < len(name):
        if name[i] == "(":
            depth, j = 0, i
            while j < len(name):
                depth += {"(": 1, ")": -1}.get(name[j], 0)
                if depth == 0:
                    break
                j += 1
            children = parse_plan(name[i + 1:j], chain, pos)
            stop = children[-1].stop if children else pos
            segments.append(Segment(pos, stop, NOTHING, (), children))
            pos, i = stop, j + 1
        else:
            j = name.find("|", i)
            j = len(name) if j < 0 else j
            if pos >= chain.n:
                raise ValueError(f"per-iteration plan {name!r} has more segments than sub-stages")
            try:
                option = chain.stages[pos].option(name[i:j])
            except KeyError:
                raise ValueError(f"per-iteration plan {name!r}: sub-stage {pos} has no keep "
                                 f"option {name[i:j]!r}") from None
            segments.append(Segment(pos, pos + 1, option.name,
                                    () if isinstance(option.kind, Store) else option.saved))
            pos, i = pos + 1, j
        if i < len(name):
            if name[i] != "|":
                raise ValueError(f"bad per-iteration plan {name!r}")
            i += 1
    return tuple(segments)


def iteration_plans(chain: ChainModel, whole: ChainModel | None = None
                    ) -> tuple[IterationPlan, ...]:
    """Every plan of one iteration (solve.enumerate_plans over the body's sub-stages),
    and the whole-body checkpoints `[rule]` measured on `whole`."""
    plans = []
    for segments in enumerate_plans(chain):
        peak, cost = simulate(chain, segments)
        keep = sum(segment_keep(chain, s) for s in segments)
        plans.append(IterationPlan(plan_name(segments), tuple(segments), int(keep), int(peak),
                                   float(cost)))
    if whole is not None:
        names = {o.name for o in whole.stages[0].options}
        for rule in _WHOLE_RULES:
            if rule not in names:
                continue  # the same keep set as an earlier rule (or none)
            option = whole.stages[0].option(rule)
            seg = Segment(0, 1, option.name, option.saved)
            peak, cost = simulate(whole, [seg])
            plans.append(IterationPlan(f"[{rule}]", (Segment(0, chain.n, option.name,
                                                              option.saved),),
                                       int(segment_keep(whole, seg)), int(peak), float(cost),
                                       whole_body=True))
    return tuple(plans)


def _useful(plans: Sequence[IterationPlan]) -> list[IterationPlan]:
    """The per-iteration plans no other beats on kept bytes, peak and recompute together
    (and the plain one): the only ones worth a scheme."""
    points = np.array([[p.keep_bytes, p.peak_bytes, p.recompute_flops] for p in plans], dtype=float)
    chosen = set(_pareto(points[:, 0], points[:, 1], points[:, 2]))
    return [p for i, p in enumerate(plans)
            if i in chosen or all(isinstance(s.kind, Store) for s in p.segments)]


# ---------------------------------------------------------------------------------------
# The layer stack
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The measured layer stack: everything `scheme_cost` needs.

    carry_bytes: the carry (residual stream) of one iteration.
    xs_bytes: floating `xs` (one layer's parameters) of one iteration.
    body_flops: forward FLOPs of one iteration.
    body_bytes: forward memory traffic of one iteration (graph.eqn_bytes).
    chain: the body's sub-stages (body_chain); plans: every per-iteration plan over them.
    """

    length: int
    carry_bytes: int
    xs_bytes: int
    body_flops: float
    chain: ChainModel
    plans: tuple[IterationPlan, ...]
    whole: ChainModel | None = None   # the body as one stage (whole_body_chain)
    body_bytes: float = 0.0

    def plan(self, name: str) -> IterationPlan:
        for p in self.plans:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def store_name(self) -> str:
        return plan_name([Segment(i, i + 1, STORE) for i in range(self.chain.n)])


def _is_float(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jnp.inexact)  # numpy's does not know bfloat16


def profile_layer_stack(program: Program, index: int, *, measure_xla: bool = True,
                        profiles: dict | None = None) -> LayerStack:
    """Profile the scan at equation `index` once, whatever its length (`profiles` as
    memory.profile_stages')."""
    eqn = program.eqns[index]
    body = layer_body(eqn)
    _, carry, xs = body.split([program.avals[v] if isinstance(v, int) else np.asarray(v.val)
                               for v in eqn.invars])
    chain = body_chain(body, measure_xla=measure_xla, profiles=profiles)
    whole = whole_body_chain(body, measure_xla=measure_xla, profiles=profiles)
    return LayerStack(eqn.params["length"], sum(nbytes(a) for a in carry),
                      sum(nbytes(a) // a.shape[0] for a in xs if _is_float(a)),
                      jaxpr_flops(eqn.params["jaxpr"]), chain, iteration_plans(chain, whole),
                      whole, jaxpr_bytes(eqn.params["jaxpr"]))


def rescaled(stack: LayerStack, alpha: float, beta: float) -> LayerStack:
    """`stack` with the body's `store` residuals scaled by alpha and its sub-stage
    workspaces by beta (fitted to XLA by planner._calibrate_scan), its per-iteration
    plans re-evaluated."""
    def scaled(chain: ChainModel | None) -> ChainModel | None:
        if chain is None:
            return None
        stages = []
        for s in chain.stages:
            opts = (dataclasses.replace(s.options[0],
                                        keep_bytes=int(s.options[0].keep_bytes * alpha)),
                    *s.options[1:])
            stages.append(dataclasses.replace(s, options=opts,
                                              fwd_temp_bytes=scaled_workspace(s.fwd_temp_bytes,
                                                                              beta),
                                              bwd_temp_bytes=scaled_workspace(s.bwd_temp_bytes,
                                                                              beta)))
        return dataclasses.replace(chain, stages=tuple(stages))

    chain, whole = scaled(stack.chain), scaled(stack.whole)
    return dataclasses.replace(stack, chain=chain, whole=whole,
                               plans=iteration_plans(chain, whole))


def weighted(stack: LayerStack, bytes_weight: float) -> LayerStack:
    """`stack` with recompute costs in the time model's units (memory.weighted_chain):
    the body's sub-stage costs and its forward get `bytes_weight` x their memory
    traffic added, and the per-iteration plans are re-evaluated, so every scheme's
    recompute cost (built from them by part_cost) is a time cost."""
    chain = weighted_chain(stack.chain, bytes_weight)
    whole = None if stack.whole is None else weighted_chain(stack.whole, bytes_weight)
    return dataclasses.replace(stack, chain=chain, whole=whole,
                               plans=iteration_plans(chain, whole),
                               body_flops=stack.body_flops + bytes_weight * stack.body_bytes,
                               body_bytes=0.0)


# ---------------------------------------------------------------------------------------
# The memory and recompute model of a scheme
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SchemeCost:
    """A scheme as the chain model sees a stage option."""

    keep_bytes: int        # kept from the stage's forward to its backward
    peak_bytes: int        # the stage's own peak (with its input and output boundaries)
    recompute_flops: float


def mixed_plan(stack: LayerStack, names: Sequence[str]) -> IterationPlan:
    """One iteration running len(names) layers with these plans, in order: kept bytes and
    recompute add up. Its backward reads the iteration's slice of the stacked residuals
    while the stack stays whole, so at layer j's backward the iteration's keeps are held
    twice over for the layers not yet differentiated: once in the stack (the iteration's
    whole keep) and once as the working copies of layers before j, besides layer j's own
    peak. One layer per iteration: its own peak, as before.

    Measured on a scanned 6-layer GPT (d 128, batch 8 x 128): from one layer per
    iteration to two and three, XLA's peak grew by 7.32 and 6.03 MB under
    `dots_no_batch|dots_no_batch` (one layer's keep: 5.24 MB), 5.29 MB under
    `nothing|dots_no_batch` (3.15 MB) and 9.48 MB under `dots|dots_no_batch` (7.86 MB):
    one more layer's keep per layer added, with the parameter terms of
    mixed_cotangent_bytes. Without the copies the model put these schemes 8-13% under
    XLA; on configs/bert-base.yaml `3*dots_narrow|dots_no_batch;dots|dots_no_batch` was
    predicted at 11.96 GB and measured 14.23 GB."""
    plans = [stack.plan(n) for n in names]
    if len(plans) == 1:
        return plans[0]
    kept = sum(p.keep_bytes for p in plans)
    before, peak = 0, 0
    for p in plans:
        peak = max(peak, before + p.peak_bytes - p.keep_bytes)
        before += p.keep_bytes
    return IterationPlan(mixed_name(names), (), kept, kept + peak,
                         sum(p.recompute_flops for p in plans))


def mixed_cotangent_bytes(stack: LayerStack, g: int) -> int:
    """What the backward of an iteration running g > 1 layers holds besides its layers'
    own peaks, as the model charges it: 2 g - 1 layers' parameters (the cotangent of the
    iteration's g-layer parameter slice and its copy into the stacked gradient, less the
    one layer's that a single layer's measured peak already holds).

    Measured on the test corpus's scan_lm (nn.scan over 6 blocks, tests/test_closed_loop.py):
    XLA held 2.3-2.6 layers' parameters more than the model without the term at g = 2 and
    2.9-4.4 at g = 3; with it two such schemes are predicted +1.1% and +1.5% from XLA.
    This is a first-order charge, not the whole mechanism: in a plain-JAX stack
    (scripts/jax_facts.py, docs/jax-facts.md fact 4) the temp grows by about 3 layers'
    parameters per layer added to an iteration from g = 2 on, while g = 1 holds more than
    g = 2."""
    return (2 * g - 1) * stack.xs_bytes if g > 1 else 0


def part_cost(stack: LayerStack, part: ScanPart) -> SchemeCost:
    """One scan over `part.count` layers, parameters not copied.

    Flat: every iteration keeps what its plan keeps (stacked by the scan), and the peak
    is the last iteration's own on top of the others'. An iteration of g layers takes
    each layer's parameter slice inside its checkpoints (apply.body_step(take=j)), so the
    parameters are forwarded to the backward as xs, not copied (measured on GPT-2 small:
    a `a;b` iteration peaks at the mean of the `a` and `b` scans, 9.102 GiB against 8.961
    and 9.243; slicing outside the checkpoints cost +340 MB, a copy of the parameters).
    Nested: only each group's input carry is kept; in the backward a group is recomputed (its sub-groups' carries, then
    its iterations' keeps, are held while it runs) and its slice of the parameters and
    of their gradients is copied for the inner loop. Each level of nesting recomputes
    the forward once more. An iteration of g layers (mixed plans) counts as one of a
    g-times larger body.
    """
    names = layer_policies(part.policy)
    g = len(names)
    it = mixed_plan(stack, names)
    m, c, x1, body_flops = part.iterations, stack.carry_bytes, stack.xs_bytes * g, stack.body_flops * g
    it_peak = it.peak_bytes + mixed_cotangent_bytes(stack, g)
    if not part.groups:
        return SchemeCost(m * it.keep_bytes, (m - 1) * it.keep_bytes + it_peak,
                          m * it.recompute_flops)
    keep = part.n_groups * c
    peak = (keep + sum(part.groups[:-1]) * c + (part.groups[-1] - 1) * it.keep_bytes
            + it_peak + 2 * x1 * sum(part.spans()))
    cost = len(part.groups) * m * body_flops + m * it.recompute_flops
    return SchemeCost(keep, peak, cost)


def scheme_cost(stack: LayerStack, scheme: ScanScheme) -> SchemeCost:
    """Memory and recompute of a whole scheme (parts in forward order).

    Split into several scans, each part's parameters are sliced (a copy, held until its
    backward) and the gradients are concatenated at the end (another copy).
    """
    costs = [part_cost(stack, p) for p in scheme.parts]
    if len(costs) == 1:
        return costs[0]
    xs = [stack.xs_bytes * p.count for p in scheme.parts]
    total_xs = sum(xs)
    peak, before = total_xs, 0
    for c, x in zip(costs, xs):
        peak = max(peak, before + c.peak_bytes + total_xs)
        before += c.keep_bytes + x
    return SchemeCost(sum(c.keep_bytes for c in costs) + total_xs, peak,
                      sum(c.recompute_flops for c in costs))


def _nestings(m: int) -> list[tuple[int, ...]]:
    """Group structures for m iterations: flat, two levels (k | m), three levels."""
    out = [()]
    divisors = [k for k in range(2, m // 2 + 1) if m % k == 0]
    out += [(k,) for k in divisors]
    for k1 in divisors:
        for k2 in divisors:
            if m % (k1 * k2) == 0 and m // (k1 * k2) >= 2:
                out.append((k1, k2))
    return out


def _parts(stack: LayerStack, plans: Sequence[IterationPlan], m: int
           ) -> list[tuple[ScanPart, SchemeCost]]:
    """Every part over m iterations: each per-iteration plan flat, and in two levels for
    every k | m."""
    groups = [()] + [(k,) for k in range(2, m // 2 + 1) if m % k == 0]
    return [(part, part_cost(stack, part))
            for part in (ScanPart(m, p.name, g) for p in plans for g in groups)]


def frontier_schemes(stack: LayerStack) -> list[tuple[ScanScheme, SchemeCost]]:
    """The schemes no other beats on kept bytes, peak and recompute together, each with
    its cost (scheme_cost): the options the scan stage of the chain model offers
    (scan_stage_profile).

    Candidates: one scan with any per-iteration plan and nesting (flat, two or three
    levels); two consecutive scans (flat + flat with different plans, flat + two-level
    nested in either order) split at every point. Split costs are computed with numpy
    over all split points at once, as scheme_cost does for one; only the survivors become
    ScanScheme objects.
    """
    n, x1 = stack.length, stack.xs_bytes
    useful = _useful(stack.plans)
    singles = [ScanScheme((ScanPart(n, p.name, g),)) for p in useful for g in _nestings(n)]
    singles += _mixed_singles(stack, useful)
    single_costs = [scheme_cost(stack, sch) for sch in singles]
    tables = {m: _parts(stack, useful, m) for m in range(1, n)}
    arrays = {m: np.array([[c.keep_bytes, c.peak_bytes, c.recompute_flops] for _, c in t],
                          dtype=np.float64) for m, t in tables.items()}
    flat = {m: np.array([not p.groups for p, _ in t]) for m, t in tables.items()}
    plan = {m: np.array([p.policy for p, _ in t]) for m, t in tables.items()}
    total_xs = n * x1
    blocks = []
    for m_a in range(1, n):
        a, b = arrays[m_a], arrays[n - m_a]
        fa, fb = flat[m_a][:, None], flat[n - m_a][None, :]
        ok = (fa | fb) & ~(fa & fb & (plan[m_a][:, None] == plan[n - m_a][None, :]))
        ia, ib = np.nonzero(ok)
        keep = a[ia, 0] + b[ib, 0] + total_xs
        peak = np.maximum(a[ia, 1], a[ia, 0] + x1 * m_a + b[ib, 1]) + total_xs
        blocks.append((m_a, ia, ib, keep, peak, a[ia, 2] + b[ib, 2]))
    keep = np.concatenate([[c.keep_bytes for c in single_costs]] + [blk[3] for blk in blocks])
    peak = np.concatenate([[c.peak_bytes for c in single_costs]] + [blk[4] for blk in blocks])
    cost = np.concatenate([[c.recompute_flops for c in single_costs]] + [blk[5] for blk in blocks])
    chosen = _pareto(keep, peak, cost)
    owners = np.concatenate([[0], np.cumsum([len(singles)] + [len(blk[1]) for blk in blocks])])
    out = []
    for i in chosen:
        if i < len(singles):
            out.append((singles[i], single_costs[i]))
            continue
        j = int(np.searchsorted(owners, i, side="right")) - 2
        m_a, ia, ib = blocks[j][:3]
        r = i - owners[j + 1]
        sch = ScanScheme((tables[m_a][ia[r]][0], tables[n - m_a][ib[r]][0]))
        out.append((sch, SchemeCost(int(keep[i]), int(peak[i]), float(cost[i]))))
    return out


def _mixed_singles(stack: LayerStack, useful: Sequence[IterationPlan]) -> list[ScanScheme]:
    """One scan whose iterations run g layers mixing two per-layer plans (k of one, g-k of
    the other, either first), flat or grouped, for every g | n up to
    MAX_LAYERS_PER_ITERATION. Mixing this way copies nothing (see part_cost); a split
    copies the parameters and concatenates their gradients. Not all n layers in one
    iteration: XLA then holds 17 to 18.5 layers' parameters more than the flat scan at
    n = 6 on the corpus scan_lm, not the 2 g - 1 = 11 of mixed_cotangent_bytes, and a
    split mixes two plans without it.

    Whole-body checkpoints (`[rule]`) are left out of these iterations: XLA recomputes the
    whole-body checkpoints of one iteration together in its backward instead of one
    layer at a time, which the model does not charge. Measured on a scanned 6-layer GPT
    (d 128, batch 8 x 128; tests/test_scan.py): `2*[dots_no_batch]` -10.2% and
    `3*[dots_no_batch]` -24.7% from XLA, `[dots_no_batch];nothing|nothing` -16.1%,
    against +7.9% for `[dots_no_batch]` alone; on configs/bert-base.yaml
    `2*[dots_narrow];dots|dots_no_batch` was predicted at 11.9 GB and measured 16.8 GB,
    `5*[dots_no_batch];nothing|dots_no_batch` 9.5 GB and 21.7 GB."""
    n, out, seen = stack.length, [], set()
    names = [p.name for p in useful if not p.whole_body]
    for g in range(2, min(n - 1, MAX_LAYERS_PER_ITERATION) + 1):
        if n % g:
            continue
        m = n // g
        groups = [()] + [(k,) for k in range(2, m // 2 + 1) if m % k == 0]
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                for k in range(1, g):
                    for order in ([a] * k + [b] * (g - k), [b] * (g - k) + [a] * k):
                        policy = mixed_name(order)
                        if policy in seen:
                            continue
                        seen.add(policy)
                        out += [ScanScheme((ScanPart(n, policy, gr),)) for gr in groups]
    return out


def _pareto(keep: np.ndarray, need: np.ndarray, cost: np.ndarray) -> list[int]:
    """Indices of the points (keep, need, cost) no other point beats on all three."""
    order = np.lexsort((need, keep, cost))
    keeps: list[float] = []   # staircase of kept points: keep ascending, need descending
    needs: list[float] = []
    chosen = []
    for i in order.tolist():
        k, nd = keep[i], need[i]
        j = bisect.bisect_right(keeps, k)
        if j > 0 and needs[j - 1] <= nd:
            continue  # a point as cheap or cheaper keeps and needs no more
        chosen.append(i)
        hi = j
        while hi < len(keeps) and needs[hi] >= nd:
            hi += 1
        keeps[j:hi] = [k]
        needs[j:hi] = [nd]
    return sorted(chosen)


def with_schemes(chain: ChainModel, k: int, stack: LayerStack, names) -> ChainModel:
    """`chain` with scan stage k's options extended by the schemes `names` it lacks,
    costed on `stack`: a plan solved on one chain (say, the time model's, whose frontier
    of schemes differs) can then be simulated on another."""
    st = chain.stages[k]
    have = {o.name for o in st.options}
    extra = tuple(_option(n, scheme_cost(stack, ScanScheme.parse(n)), chain.boundary[k],
                          chain.boundary[k + 1]) for n in dict.fromkeys(names) if n not in have)
    if not extra:
        return chain
    stages = chain.stages[:k] + (dataclasses.replace(st, options=st.options + extra),) \
        + chain.stages[k + 1:]
    return dataclasses.replace(chain, stages=stages)


def _option(name: str, c: SchemeCost, b_in: int, b_out: int) -> KeepOption:
    """A scheme as a KeepOption: its peak split into the workspaces memory.leaf_fwd_peak
    and leaf_bwd_peak add to the stage's boundaries (the same peak either way)."""
    return KeepOption(name, (), c.keep_bytes, c.recompute_flops,
                      fwd_temp_bytes=c.peak_bytes - (b_in + b_out + c.keep_bytes),
                      bwd_temp_bytes=c.peak_bytes - (2 * b_in + b_out))


def scan_stage_profile(stack: LayerStack, name: str, flops: float, b_in: int, b_out: int,
                       input_bytes: int, frontier: bool = True) -> StageProfile:
    """The scan stage for the chain model: `store` (the plain scan), `nothing` (one
    checkpoint around the whole scan) and every scheme not beaten on kept bytes, peak
    and recompute (without `frontier`: only the calibration scheme, to fit the model).

    input_bytes: activation bytes of the stage's inputs (what `nothing` keeps).
    """
    n = stack.length
    store = part_cost(stack, ScanPart(n, stack.store_name))
    whole = SchemeCost(input_bytes, input_bytes + store.peak_bytes, n * stack.body_flops)
    options = [_option(STORE, store, b_in, b_out), _option(NOTHING, whole, b_in, b_out)]
    if frontier:
        schemes = frontier_schemes(stack)
    else:
        sch = ScanScheme.parse(calibration_scheme(stack))
        schemes = [(sch, scheme_cost(stack, sch))]
    for sch, c in schemes:
        if sch.parts != (ScanPart(n, stack.store_name),):
            options.append(_option(sch.option, c, b_in, b_out))
    opt = options[0]
    return StageProfile(name, flops, tuple(options), opt.fwd_temp_bytes, opt.bwd_temp_bytes)


def store_scheme(stack: LayerStack) -> str:
    """Every iteration replayed with its sub-stages stored: the scan without remat, as a
    plan's scheme (for sharded steps, which gather weight slices per sub-stage)."""
    return ScanScheme((ScanPart(stack.length, stack.store_name),)).option


def calibration_scheme(stack: LayerStack) -> str:
    """Every iteration with each sub-stage checkpointed keeping only its inputs: with the
    plain scan, the two points the stack's model is fitted on."""
    name = plan_name([Segment(i, i + 1, NOTHING) for i in range(stack.chain.n)])
    return ScanScheme((ScanPart(stack.length, name),)).option


# ---------------------------------------------------------------------------------------
# Rebuilding the scan (apply)
# ---------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------
# The chain with the layer stack as one stage
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScanChain:
    """What `profile_chain` returns: the stages with the scan isolated, the chain model,
    and the profiled layer stack."""

    cost: CostGraph
    chain: ChainModel
    stage: int          # index of the scan stage
    eqn_index: int      # index of the scan equation in the program
    stack: LayerStack
    input_bytes: int    # activation bytes of the scan's inputs

    def with_stack(self, stack: LayerStack, frontier: bool = True) -> "ScanChain":
        """This chain with the scan stage re-profiled from `stack` (see scan_stage_profile)."""
        k, old = self.stage, self.chain.stages[self.stage]
        profile = scan_stage_profile(stack, old.name, old.flops, self.chain.boundary[k],
                                     self.chain.boundary[k + 1], self.input_bytes, frontier)
        profile = dataclasses.replace(profile, bytes_accessed=old.bytes_accessed,
                                      grad_bytes=old.grad_bytes)
        stages = self.chain.stages[:k] + (profile,) + self.chain.stages[k + 1:]
        return dataclasses.replace(self, chain=dataclasses.replace(self.chain, stages=stages),
                                   stack=stack)


def scaled(sc: ScanChain, f: float) -> ScanChain:
    """`sc` with every activation byte count times `f` (one device's share of a batch
    split over 1/f devices, memory.scale_chain); the stacked parameters are unchanged
    (replicated under dp)."""
    stack = sc.stack
    chain = scale_chain(stack.chain, f)
    whole = None if stack.whole is None else scale_chain(stack.whole, f)
    stack = dataclasses.replace(stack, carry_bytes=int(round(stack.carry_bytes * f)),
                                chain=chain, whole=whole, plans=iteration_plans(chain, whole))
    out = dataclasses.replace(sc, chain=scale_chain(sc.chain, f),
                              input_bytes=int(round(sc.input_bytes * f)))
    return out.with_stack(stack)


def profile_chain(program: Program, cost: CostGraph, *, measure_xla: bool = True,
                  progress: Callable[[str], None] | None = None,
                  profiles: dict | None = None) -> ScanChain | None:
    """The chain model of a program whose layers are a scan, or None if it has none.

    The other stages are profiled by memory.profile_stages as usual; the scan stage's
    options are the scan schemes (scan_stage_profile). `profiles`: a dict kept by the
    caller to reuse profiles across calls (memory.profile_stages), body's included.
    """
    index = find_layer_scan(program)
    if index is None:
        return None
    cost, k = isolate(program, cost, index)
    if progress:
        progress(f"profiling the layer stack {cost.stages[k].name} "
                 f"({program.eqns[index].params['length']} iterations, one body)")
    stack = profile_layer_stack(program, index, measure_xla=measure_xla, profiles=profiles)
    others = dataclasses.replace(cost, stages=cost.stages[:k] + cost.stages[k + 1:])
    rest = profile_stages(program, others, measure_xla=measure_xla, progress=progress,
                          profiles=profiles)
    boundary = tuple([0] + [int(cost.boundary_bytes(j)) for j in range(1, len(cost.stages))] + [0])
    ins, _ = stage_io(program, index, index + 1)
    input_bytes = sum(program.nbytes(v) for v in ins if v not in program.free)
    st = cost.stages[k]
    profile = scan_stage_profile(stack, st.name, st.flops, boundary[k], boundary[k + 1],
                                 input_bytes)
    profile = dataclasses.replace(profile, bytes_accessed=st.bytes_accessed)
    stages = rest.stages[:k] + (profile,) + rest.stages[k:]
    last, defs = last_uses(program), definitions(program)
    chain = ChainModel(stages, boundary, cut_overlap(program, cost, last, defs),
                       region_inputs(program, cost, boundary, last, defs))
    return ScanChain(cost, chain, k, index, stack, input_bytes)


def describe(option: str) -> str:
    """A scan scheme in words, for hand-written Flax (`nn.scan` over `nn.remat` blocks)."""
    scheme = ScanScheme.parse(option)
    texts = []
    for part in scheme.parts:
        where = f"{part.count} layers"
        if part.groups:
            levels = " of ".join(f"{part.n_groups if j == 0 else part.groups[j - 1]} "
                                 f"{'groups' if j < len(part.groups) else 'layers'}"
                                 for j in range(len(part.groups) + 1))
            where += (f" as {levels} (each group an nn.remat around an inner nn.scan; only "
                      "group inputs are kept)")
        g = part.layers_per_iteration
        if g > 1:
            where += (f" scanned {g} at a time (nn.scan over a module of {g} blocks, each with "
                      "its own plan: the stacked parameters reshaped, not copied)")
        texts.append(f"{where}; per layer, sub-stages (attention | MLP for a transformer "
                     f"block): {part.policy}")
    return "; then ".join(texts)
