"""Stage 5: apply a Plan by replaying the traced loss with nested jax.checkpoint regions.

Each checkpointed segment becomes its own `jax.checkpoint` (nested where the plan nests);
values a segment keeps are tagged with `checkpoint_name` and kept by a
`save_only_these_names` policy. The forward computation is the traced one, equation for
equation, so gradients are exactly those of the original loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import scan
from .errors import PlanMismatchError
from .graph import definitions, find_blocks, last_uses
from .memory import ChainModel, make_segment_fn, stage_io, value_name
from .plan import KeepRule, Plan, ScanOption, ScanScheme, Segment, Store, layer_policies
from .scan import Body, body_chain, layer_body, parse_plan, whole_body_chain
from .sharding import gather_shardings, scan_iteration, scan_layout
from .trace import Literal, Program, eval_range, trace


def input_signature(params, batch: Sequence, program: Program | None = None) -> list[str]:
    """What a plan was made for, as `key: value` lines for mismatch messages: parameter
    count and dtypes, batch shapes and dtypes and, given the traced program, the floating
    dtypes it computes in and its equation count."""
    sig = [f"{l.dtype}{list(np.shape(l))}" for l in jax.tree.leaves(batch)]
    leaves = jax.tree.leaves(params)
    n_params = sum(int(np.prod(np.shape(l), dtype=np.int64)) for l in leaves)
    dtypes = ", ".join(sorted({str(l.dtype) for l in leaves}))
    lines = [f"params: {n_params} values ({dtypes})"]
    lines += [f"batch[{i}]: {s}" for i, s in enumerate(sig)]
    if program is not None:
        computed = sorted({str(program.avals[v].dtype) for e in program.eqns for v in e.outvars
                           if jax.numpy.issubdtype(program.avals[v].dtype, np.floating)})
        lines += [f"compute dtypes: {', '.join(computed)}", f"equations: {len(program.eqns)}"]
    return lines


def apply_plan(plan: Plan, loss_fn: Callable, has_aux: bool | None = None) -> Callable:
    """`loss_fn(params, *batch)` whose forward is split into the plan's checkpoints.

    With `has_aux` (by default: as the plan was made) loss_fn returns `(loss, aux)` and so
    does the planned function.
    """
    programs: dict = {}
    if has_aux is None:
        has_aux = plan.has_aux
    # A plan that stores every stage of an unsharded step is the step without remat.
    stores_all = (plan.sharding is None
                  and all(not s.is_checkpoint for s in plan.segments))

    def planned_loss(params, *batch):
        leaves, treedef = jax.tree.flatten((params, *batch))
        key = (treedef, tuple((tuple(l.shape), str(l.dtype)) for l in leaves))
        if key not in programs:
            program = trace(loss_fn, params, *batch, has_aux=has_aux)
            check_matches(plan, program, params, batch)
            programs[key] = (program, last_uses(program), definitions(program))
        program, last, defs = programs[key]
        if stores_all:  # nothing to checkpoint: the loss as written, the same XLA program
            return loss_fn(params, *batch)
        env = program.bind(leaves)
        pinned = frozenset(plan.pinned)
        run_segments(program, plan, plan.segments, env, last, defs, pinned,
                     gather_shardings(program, params, plan.sharding),
                     scan_sharding=scan_layout(program, params, plan.sharding))
        return program.output(env)

    planned_loss.__name__ = f"planned_{getattr(loss_fn, '__name__', 'loss')}"
    planned_loss.__doc__ = f"{getattr(loss_fn, '__name__', 'loss_fn')} with remat plan applied."
    return planned_loss


def gather_name(vid: int) -> str:
    return f"rp:gathered{vid}"


def check_matches(plan: Plan, program: Program, params, batch) -> None:
    """PlanMismatchError naming what differs unless `plan` was made for `program`."""
    if program.fingerprint() == plan.fingerprint:
        if plan.stages[-1].stop != len(program.eqns):
            raise PlanMismatchError(
                f"plan stages cover {plan.stages[-1].stop} equations but the computation has "
                f"{len(program.eqns)}; re-plan for these inputs")
        return
    here = _by_key(input_signature(params, batch, program))
    there = _by_key(plan.signature)
    diffs = [f"{key}: {here[key]} (plan: {there[key]})" for key in here
             if key in there and here[key] != there[key]]
    what = "; ".join(diffs) if diffs else "the traced equations differ (model code changed)"
    raise PlanMismatchError(f"plan does not match this computation: {what}; "
                            "re-plan for these inputs")


def _by_key(lines) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in lines if ": " in line)


def run_segments(program: Program, plan: Plan, segments: Sequence[Segment], env: dict,
                 last: dict, defs: dict, pinned: frozenset[int] = frozenset(),
                 gathers: dict | None = None, *, in_scan: bool = False,
                 scan_sharding=None) -> None:
    """Evaluate `segments` in order on `env`, checkpointing the checkpointed ones.

    `pinned` values (outputs of collectives in a sharded step) are tagged wherever they
    are computed and kept by every checkpoint region containing them, nested or not, so
    no recomputation repeats their communication. `gathers` (fsdp: parameter id ->
    sharding of the all-gathered weight): a checkpointed segment all-gathers the
    parameters it uses once, at its start (`with_sharding_constraint`), and keeps the
    gathered weights by name, so its recomputation in the backward does not all-gather
    them again; nested segments receive them gathered.

    With `in_scan=True` (a layer-stack scan's body, body_step), a checkpoint over
    the whole body (what `nn.remat(Block)` inside `nn.scan` makes) has
    `prevent_cse=False`, as scanned layer stacks are written: the scan already keeps XLA
    from merging the recomputation with the forward, and the barriers change XLA's
    buffer assignment (docs/jax-facts.md, fact 5). Every other checkpoint keeps JAX's
    default: with prevent_cse=False on every checkpoint of the schemes, XLA's peaks grew
    on the real-size scanned configs (the README's bert-base row went from 1.64% to
    35.4% recompute, fact 5). And (sharded, sharding.scan_body_shardings) the gathered weight
    matrices are never kept: every segment using them, checkpointed or
    not, gathers them inside a checkpoint that does not save them, so the backward gathers
    each once more instead of stacking every iteration's gathered weights (gathered
    vectors, biases and norm scales, are kept: see _vectors). `scan_sharding` (a
    ShardingSpec and parameter specs by id) is passed on to a layer-stack scan."""
    replay = _Replay(program, plan, last, defs, pinned, gathers or {}, in_scan, scan_sharding)
    for seg in segments:
        kind = seg.kind
        try:
            run = REPLAY[type(kind)]
        except KeyError:
            raise NotImplementedError(f"apply has no replay for keep options of kind "
                                      f"{type(kind).__name__} ({seg.option!r}): add one to "
                                      "apply.REPLAY") from None
        run(replay, seg, kind, env)


@dataclasses.dataclass(frozen=True)
class _Replay:
    """What replaying one level of segments needs besides the segment and `env` (see
    run_segments). `gathers` is {} inside a region: the weights arrive gathered."""

    program: Program
    plan: Plan
    last: dict
    defs: dict
    pinned: frozenset[int]
    gathers: dict
    in_scan: bool
    scan_sharding: object

    def equations(self, seg: Segment) -> tuple[int, int]:
        return self.plan.stages[seg.start].start, self.plan.stages[seg.stop - 1].stop

    def pins(self, lo: int, hi: int) -> list[int]:
        return [v for e in self.program.eqns[lo:hi] for v in e.outvars if v in self.pinned]


def _replay_store(r: _Replay, seg: Segment, kind: Store, env: dict) -> None:
    """A stored stage: evaluated as traced, outside any checkpoint."""
    program, gathers = r.program, r.gathers
    lo, hi = r.equations(seg)
    pins = r.pins(lo, hi)
    if not (pins or gathers):
        eval_range(program, lo, hi, env)
        return
    # Outside checkpoints too: pinned values tagged (for enclosing regions) and
    # weights gathered the same way, so the unplanned (all-store) step and the
    # planned one partition alike and differ only by their recomputation.
    ins, outs = stage_io(program, lo, hi, r.last, r.defs)
    to_gather = [i for i, v in enumerate(ins) if v in gathers]
    if to_gather and r.in_scan:
        # Stored, but what depends on the weights alone (the gathered weights,
        # their casts) is computed again in the backward, not kept: everything
        # else is tagged and kept by name.
        keep = tuple(dict.fromkeys((*pins, *_activations(
            program, lo, hi, {ins[i] for i in to_gather}))))
        fn = _gathering(make_segment_fn(program, lo, hi, ins, outs, tag=keep),
                        ins, to_gather, gathers)
        fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(
            *[value_name(v) for v in keep],
            *[gather_name(ins[i]) for i in _vectors(program, ins, to_gather)]))
    else:
        fn = make_segment_fn(program, lo, hi, ins, outs, tag=pins)
        if to_gather:
            fn = _gathering(fn, ins, to_gather, gathers)
    env.update(zip(outs, fn(*[env[v] for v in ins])))


def _replay_keep_rule(r: _Replay, seg: Segment, kind: KeepRule, env: dict) -> None:
    """A checkpoint region keeping the segment's `saved` values (what its rule names) and
    the pinned ones; over several stages, its children replayed inside it."""
    program, gathers, in_scan = r.program, r.gathers, r.in_scan
    lo, hi = r.equations(seg)
    ins, outs = stage_io(program, lo, hi, r.last, r.defs)
    saved = tuple(dict.fromkeys((*seg.saved, *r.pins(lo, hi))))
    if seg.children:
        def body(*args, _seg=seg, _ins=ins, _outs=outs):
            inner = program.region_env(_ins, args)
            # (scan bodies: the weights arrive gathered; their children need no own)
            run_segments(program, r.plan, _seg.children, inner, r.last, r.defs, r.pinned,
                         None if in_scan else gathers, in_scan=in_scan,
                         scan_sharding=r.scan_sharding)
            return [inner[v] for v in _outs]
    else:
        body = make_segment_fn(program, lo, hi, ins, outs, tag=saved)
    names = [value_name(v) for v in saved]
    to_gather = [i for i, v in enumerate(ins) if v in gathers]
    if to_gather:
        kept = _vectors(program, ins, to_gather) if in_scan else to_gather
        names += [gather_name(ins[i]) for i in kept]
        body = _gathering(body, ins, to_gather, gathers)
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    whole_body = in_scan and lo == 0 and hi == len(program.eqns) and not seg.children
    results = jax.checkpoint(body, policy=policy, prevent_cse=not whole_body)(
        *[env[v] for v in ins])
    env.update(zip(outs, results))


def _replay_scan(r: _Replay, seg: Segment, kind: ScanOption, env: dict) -> None:
    """The layer stack, rebuilt as the scheme says (run_stage)."""
    lo, hi = r.equations(seg)
    run_stage(r.program, lo, hi, kind.scheme, env, r.scan_sharding)


# The replay of each kind of keep option (options.option_kinds(): a new kind adds its own).
REPLAY: dict[type, Callable] = {Store: _replay_store, KeepRule: _replay_keep_rule,
                                ScanOption: _replay_scan}


def _vectors(program: Program, ins, positions) -> list[int]:
    """The positions among `positions` whose values are vectors (biases, norm scales).
    Inside a scan body their gathered copies are kept all the same: a stacked copy of the
    model's vectors is small, and without it the recomputation all-gathers them again
    while the stored backward (which needs no bias) does not."""
    return [i for i in positions if len(getattr(program.avals.get(ins[i]), "shape", (0, 0))) <= 1]


def _activations(program: Program, lo: int, hi: int, weights: set[int]) -> list[int]:
    """Values computed in [lo, hi) that depend on something besides `weights` (and
    literals): what a stored segment keeps when its weights are gathered again."""
    derived = set(weights)
    out = []
    for e in program.eqns[lo:hi]:
        ids = [v for v in e.invars if isinstance(v, int)]
        if ids and all(v in derived for v in ids):
            derived.update(e.outvars)
        else:
            out.extend(e.outvars)
    return out


def _gathering(body: Callable, ins, positions, gathers) -> Callable:
    """`body` whose parameter arguments at `positions` are all-gathered first (a sharding
    constraint to the gathered layout; XLA's partitioner emits the all-gather) and named.
    A callable in `gathers` is applied instead (a layer's slice of a mixed scan
    iteration's parameters, body_step)."""
    from jax.ad_checkpoint import checkpoint_name

    def fn(*args):
        args = list(args)
        for i in positions:
            how = gathers[ins[i]]
            g = how(args[i]) if callable(how) else jax.lax.with_sharding_constraint(args[i], how)
            args[i] = checkpoint_name(g, gather_name(ins[i]))
        return body(*args)
    return fn


# ---------------------------------------------------------------------------------------
# Built-in JAX policies per block, for comparison
# ---------------------------------------------------------------------------------------

_NUMBERED = re.compile(r"(^|_)\d+$")


def _stem(scope: str) -> str:
    """A module path with the number of its last module taken off (`a/h/3` -> `a/h/`)."""
    head, _, last = scope.rpartition("/")
    return f"{head}/{_NUMBERED.sub('', last)}"


def block_ranges(program: Program) -> list[tuple[int, int]]:
    """Equation ranges of the blocks a user would wrap in `nn.remat` one by one.

    With module paths, the runs of equations under the same module named by a number
    (`h/0`, `Block_3`, `layers_11`, at any depth), at the outermost level of numbered
    modules where two or more share a name but for the number (`LM/Decoder_0/Block_3`:
    the Block_i, not the lone Decoder_0 or Embed_0). Without
    (plain JAX), or with fewer than two such modules, the copies of repeated blocks
    found from the program's structure (graph.find_blocks); also where those copies are
    fewer and each holds whole numbered modules: the numbers then name layers inside
    the block (one layer module called at every depth, as ALBERT shares it: its
    `Dense_0` and `Dense_1`, not the layer, are numbered).
    """
    found = [r for g in find_blocks(program) for r in g.ranges]
    named = _numbered_ranges(program)
    if named is None:
        return found
    if found and len(found) < len(named) and all(
            any(lo <= a and b <= hi for lo, hi in found) for a, b in named):
        return found
    return named


def _numbered_ranges(program: Program) -> list[tuple[int, int]] | None:
    """block_ranges by module path; None without two modules named alike but for a
    number."""
    numbered = []
    for e in program.eqns:
        parts = [p for p in e.module_path.split("/") if p]
        numbered.append(["/".join(parts[:d + 1]) for d, part in enumerate(parts)
                         if d > 0 and _NUMBERED.search(part)])
    depth = max((len(s) for s in numbered), default=0)
    for level in range(depth):
        scopes = [s[level] if len(s) > level else None for s in numbered]
        stems = Counter(_stem(s) for s in set(scopes) - {None})
        repeated = {s for s in set(scopes) - {None} if stems[_stem(s)] >= 2}
        if repeated:
            scopes = [s if s in repeated else None for s in scopes]
            break
    else:
        return None
    ranges, current, start = [], None, 0
    for i, scope in enumerate(scopes + [None]):
        if scope != current:
            if current is not None:
                ranges.append((start, i))
            current, start = scope, i
    return ranges


# ---------------------------------------------------------------------------------------
# Layer-stack scans: a scan scheme (plan.ScanScheme) replayed; its cost model is scan.py's
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _body_uses(body: Body):
    return last_uses(body.program), definitions(body.program)


def body_step(body: Body, segments: Sequence | None = None, jax_policy=None, *,
              regather: dict | None = None, pinned: frozenset[int] = frozenset(),
              take: int | None = None) -> Callable:
    """One iteration `(consts, carry, x) -> (carry, y)`: the body replayed with the
    per-iteration plan `segments` over its sub-stages (run_segments, as for a
    whole program), or checkpointed whole under a JAX policy (`nn.remat` per block).

    Sharded (sharding.scan_body_shardings): `regather` weight slices are all-gathered
    in every sub-stage using them and never kept; `pinned` values (tensor-parallel
    partial sums, all-reduced) are kept by every checkpoint.

    With `take=j` (layer j of a mixed iteration, see run_scheme) the xs arrive as the
    iteration's group of g layers and layer j's slice is taken inside every sub-stage
    that uses it, like a regathered weight: the checkpoints' inputs are then the
    scan's own xs, which JAX's scan forwards to the backward without stacking a copy,
    where slices taken outside them would be stacked (one copy of the parameters)."""
    program, ncar = body.program, body.num_carry
    outs = program.outvars
    xs_ids = program.invars[body.num_consts + ncar:]
    if take is not None:
        regather = dict(regather or {})
        for v in xs_ids:
            regather[v] = _taking(take, regather.get(v))

    def fn(*args):
        env = program.bind(args)
        if segments is None:
            eval_range(program, 0, len(program.eqns), env)
        else:
            last, defs = _body_uses(body)
            run_segments(program, body, segments, env, last, defs, pinned, regather,
                         in_scan=True)
        return [jnp.asarray(v.val, a.dtype) if isinstance(v, Literal)
                else env[v][take] if take is not None and v in xs_ids else env[v]
                for v, a in zip(outs, program.avals_out)]

    f = fn if jax_policy is None else jax.checkpoint(fn, policy=jax_policy, prevent_cse=False)

    def it(consts, carry, x):
        out = f(*consts, *carry, *x)
        return list(out[:ncar]), list(out[ncar:])
    return it


def run_stage(program: Program, lo: int, hi: int, option: ScanScheme | str, env: dict,
              scan_sharding=None) -> None:
    """Evaluate equations [lo, hi) on `env`, the layer-stack scan among them following
    scheme `option` (a ScanScheme or its name; sharded: see run_scheme)."""
    index = max((i for i in range(lo, hi) if program.eqns[i].name == "scan"),
                key=lambda i: scan.eqn_flops_of(program, program.eqns[i]), default=None)
    if index is None:
        raise PlanMismatchError(f"the plan runs stage equations [{lo}, {hi}) as a scan, "
                                "but they hold none; re-plan for this model")
    eval_range(program, lo, index, env)
    run_scheme(program, index, option, env, scan_sharding)
    eval_range(program, index + 1, hi, env)


def run_scheme(program: Program, index: int, option: ScanScheme | str, env: dict,
               scan_sharding=None) -> None:
    """Evaluate the scan at equation `index` on `env` following scheme `option`; with
    `scan_sharding` (sharding.scan_layout's: fsdp or tp), each iteration gathers its
    weight slices and keeps its collective outputs (body_step), and under tp its carry is
    replicated over `model` (sharding.scan_iteration)."""
    eqn = program.eqns[index]
    body = layer_body(eqn)
    regather, pinned, pin_carry = scan_iteration(eqn, body.program, scan_sharding)
    scheme = option if isinstance(option, ScanScheme) else ScanScheme.parse(option)
    if scheme.length != body.length:
        raise PlanMismatchError(f"scan scheme {scheme.label()!r} covers {scheme.length} iterations, the "
                                f"scan has {body.length}; re-plan for this model")
    chain, whole = _named_chain(body)
    try:
        plans = [[parse_plan(name, chain, whole=whole) for name in layer_policies(part.policy)]
                 for part in scheme.parts]
    except ValueError as e:
        raise PlanMismatchError(f"{e}; re-plan for this model") from None
    consts, carry, xs = body.split([v.val if isinstance(v, Literal) else env[v]
                                    for v in eqn.invars])
    pos, ys_parts = 0, []
    for part, layer_segments in zip(scheme.parts, plans):
        part_xs = xs if part.count == body.length else [
            jax.lax.slice_in_dim(x, pos, pos + part.count) for x in xs]
        g = len(layer_segments)
        its = [body_step(body, segments, regather=regather, pinned=pinned,
                         take=j if g > 1 else None)
               for j, segments in enumerate(layer_segments)]
        if pin_carry is not None:
            carry = pin_carry(carry)
            its = [_pinning_carry(f, pin_carry) for f in its]
        if g == 1:
            step = lambda c, x, _it=its[0]: _it(consts, c, x)  # noqa: E731
        else:
            # g layers per iteration: the stacked xs are reshaped (free), not sliced.
            part_xs = [x.reshape((part.count // g, g, *x.shape[1:])) for x in part_xs]
            step = functools.partial(_mixed_step, its, consts)
        carry, ys = nested_scan(step, carry, part_xs, part.groups)
        if g > 1:
            ys = [y.reshape((part.count, *y.shape[2:])) for y in ys]
        ys_parts.append(ys)
        pos += part.count
    ys = [p[0] if len(p) == 1 else jnp.concatenate(p, axis=0) for p in zip(*ys_parts)]
    env.update(zip(eqn.outvars, list(carry) + ys))


@functools.lru_cache(maxsize=16)
def _named_chain(body: Body) -> tuple[ChainModel, ChainModel | None]:
    """The body chain and its one-stage form, for the values their options keep by name
    (what applying a plan needs): profiled from the body's structure alone (no XLA), so
    a plan loaded in a fresh process replays exactly as the one just made."""
    return (body_chain(body, measure_xla=False), whole_body_chain(body, measure_xla=False))


def _taking(j: int, sharding=None) -> Callable:
    """Layer j's slice of a group of stacked xs, then (fsdp) its gathered layout."""
    def take(group):
        x = group[j]
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
    return take


def _pinning_carry(it: Callable, pin: Callable) -> Callable:
    """Iteration `it` with its carry in and out laid out by `pin`."""
    def step(consts, carry, x):
        carry, ys = it(consts, pin(carry), x)
        return pin(carry), ys
    return step


def _mixed_step(its: Sequence[Callable], consts, carry, x):
    """One iteration of a mixed scan: layer j of the g runs its[j], which takes its slice
    x[j] of the group inside its checkpoints (body_step(take=j))."""
    ys_all = []
    for it in its:
        carry, ys = it(consts, carry, x)
        ys_all.append(ys)
    return carry, [jnp.stack(y) for y in zip(*ys_all)]


def nested_scan(it: Callable, carry, xs, groups: tuple[int, ...]):
    """Scan `it` over xs; with groups (k, ...), an outer scan over checkpointed groups."""
    if not groups:
        return jax.lax.scan(it, carry, xs)
    k = math.prod(groups)
    n = xs[0].shape[0] if xs else None
    if n is None:
        raise ValueError("a nested scan needs xs to size its groups")
    grouped = [x.reshape((n // k, k, *x.shape[1:])) for x in xs]

    @jax.checkpoint
    def group(c, xg):
        return nested_scan(it, c, xg, groups[1:])

    carry, ys = jax.lax.scan(group, carry, grouped)
    return carry, [y.reshape((n, *y.shape[2:])) for y in ys]


def run_with_policy(program: Program, index: int, policy, env: dict) -> None:
    """Evaluate the scan at `index` with its body under a JAX checkpoint policy, as
    `nn.remat(block, policy=...)` inside `nn.scan` would (the built-in comparison)."""
    eqn = program.eqns[index]
    body = layer_body(eqn)
    consts, carry, xs = body.split([v.val if isinstance(v, Literal) else env[v]
                                    for v in eqn.invars])
    it = body_step(body, jax_policy=policy)
    carry, ys = jax.lax.scan(lambda c, x: it(consts, c, x), carry, xs)
    env.update(zip(eqn.outvars, list(carry) + list(ys)))
