"""Sharded training steps: a device mesh and a sharding scheme, per-device memory.

The distributed engine is JAX's own SPMD machinery: a `jax.sharding.Mesh`,
`NamedSharding` / `PartitionSpec` on params, optimizer state and batch, and `jax.jit`
with `in_shardings` / `out_shardings`; XLA's SPMD partitioner inserts the collectives.
Nothing here moves data by hand.

Schemes (`--sharding`):

- `dp`: parameters and optimizer state replicated; the batch split over every mesh axis.
- `fsdp`: as dp, and every parameter (with its gradient and optimizer state) split over
  every mesh axis along its largest divisible dimension (ZeRO-3); XLA all-gathers
  weights where they are used and reduce-scatters gradients.
- `tp`: Megatron-style tensor parallelism over the axis named `model`: column-parallel
  kernels split on their output dimension, row-parallel ones (`o_proj`, `down_proj`,
  `c_proj`, `out`, ...) on their input dimension, embeddings on the vocabulary; the batch
  split over the other axes (data parallel).
- `fsdp+tp`: tp over `model`, and fsdp over the other axes on a remaining dimension.

The budget is per device: every byte count here is one device's shard
(`NamedSharding.shard_shape`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .errors import ConfigError
from .sharding_spec import MODEL_AXIS, SCHEMES, ShardingSpec, parse_mesh, resolve  # noqa: F401
from .trace import abstract, as_batch, nbytes, trace


# Kernels whose input dimension is split under tp (their output is a partial sum that
# XLA all-reduces): attention output and MLP down projections of the sample models.
_ROW_PARALLEL = re.compile(r"(^|/)(o_proj|out_proj|down_proj|c_proj|proj_out|out|wo|fc2|"
                           r"output|mlp_out|attn_out)(/|$)")
# Parameter leaves that are per-feature vectors (Flax names), stacked or not.
_VECTOR_LEAVES = frozenset({"scale", "bias"})


# ---------------------------------------------------------------------------------------
# Partition specs
# ---------------------------------------------------------------------------------------

def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _tp_dim(path: str, shape) -> int | None:
    """Which dimension of a parameter tensor parallelism splits, or None (replicated).
    Kernels (ndim >= 2, the last two dims are in/out): row-parallel ones on the input
    dim, the others on the output dim; embeddings (`embedding`) on the vocabulary (the
    first of the last two dims); vectors (norm scales, biases) replicated, also when a
    scan over layers stacks them into a matrix (leaf `scale` or `bias`): splitting a norm
    scale over `model` makes XLA split the residual stream and all-reduce the norm."""
    leaf = path.rsplit("/", 1)[-1]
    if len(shape) < 2 or leaf in _VECTOR_LEAVES:
        return None
    if leaf == "embedding":
        return len(shape) - 2
    if _ROW_PARALLEL.search(path.rsplit("/", 1)[0]):
        return len(shape) - 2
    return len(shape) - 1


def param_spec(path: str, shape, spec: ShardingSpec) -> P:
    """PartitionSpec of one parameter under `spec` (see the module docstring)."""
    dims: list[Any] = [None] * len(shape)
    if spec.model_axis is not None and path not in spec.replicated:
        d = _tp_dim(path, shape)
        if d is not None:
            if shape[d] % spec.model_size:
                raise ConfigError(
                    f"parameter {path} {list(shape)}: dimension {d} ({shape[d]}) is not "
                    f"divisible by mesh axis '{MODEL_AXIS}' ({spec.model_size}); choose a "
                    f"model axis size that divides it")
            dims[d] = MODEL_AXIS
    if spec.scheme in ("fsdp", "fsdp+tp"):
        n = spec.data_size
        free = [i for i in range(len(shape)) if dims[i] is None and shape[i] % n == 0
                and shape[i] >= n]
        if free and n > 1:
            # the largest divisible dimension; ties go to the later one (a kernel's output)
            d = max(free, key=lambda i: (shape[i], i))
            axes = spec.data_axes
            dims[d] = axes[0] if len(axes) == 1 else axes
        # a parameter with no divisible dimension (a small vector) stays replicated
    return P(*dims)


def param_specs(params, spec: ShardingSpec):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: param_spec(_path_str(path), np.shape(x), spec), params)


def batch_specs(batch, spec: ShardingSpec):
    """Every batch leaf split on its first (batch) dimension over the data axes."""
    axes = spec.data_axes
    n = spec.data_size

    def one(path, x):
        shape = np.shape(x)
        if not shape or n == 1:
            return P()
        if shape[0] % n:
            where = f"batch[{path[0].idx}]" if path and hasattr(path[0], "idx") else "batch"
            raise ConfigError(
                f"{where} {list(shape)}: batch dimension {shape[0]} is not divisible by the "
                f"data axes {' x '.join(axes)} ({n} devices); use a batch size that is a "
                f"multiple of {n} (--batch-size)")
        return P(axes[0] if len(axes) == 1 else axes)
    return jax.tree_util.tree_map_with_path(one, tuple(batch))


def opt_state_specs(optimizer, opt_state, p_specs):
    """The optimizer state follows its parameters (optax.tree_map_params); counters and
    other non-parameter leaves are replicated."""
    import optax
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, p_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """NamedShardings of one step's arguments on a concrete mesh."""

    mesh: Mesh
    params: Any
    batch: Any
    opt_state: Any = None

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def step_shardings(spec: ShardingSpec, params, batch, optimizer=None) -> StepShardings:
    mesh = spec.mesh()
    named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree,
                                      is_leaf=lambda x: isinstance(x, P))
    p_specs = param_specs(params, spec)
    opt = None
    if optimizer is not None:
        opt_state = jax.eval_shape(optimizer.init, params)
        opt = named(opt_state_specs(optimizer, opt_state, p_specs))
    return StepShardings(mesh, named(p_specs), named(batch_specs(batch, spec)), opt)


def jit_kwargs(step, params, batch) -> dict:
    """`in_shardings` / `out_shardings` for jitting the training step of `step` (a
    step.Step) under its sharding: params, optimizer state and batch as the scheme says,
    the loss replicated, aux left to XLA; {} for an unsharded step. The step's function is
    verify.make_step's: (params, batch) -> grads or (params, opt_state, batch) -> (params,
    opt_state, loss), with aux last under `has_aux`."""
    if step.sharding is None:
        return {}
    optimizer = step.optimizer
    sh = step_shardings(step.sharding, params, batch, optimizer)
    aux = (None,) if step.has_aux else ()
    if optimizer is None:
        return dict(in_shardings=(sh.params, sh.batch),
                    out_shardings=(sh.params, None) if step.has_aux else sh.params)
    return dict(in_shardings=(sh.params, sh.opt_state, sh.batch),
                out_shardings=(sh.params, sh.opt_state, sh.replicated, *aux))


def plan_layout(spec: ShardingSpec | None, plan) -> ShardingSpec | None:
    """The layout a step following `plan` runs in: the plan's own (with the kernels it
    keeps replicated) where `spec` is none or the same mesh and scheme, else `spec`."""
    made_for = plan.sharding if plan is not None else None
    if made_for is not None and (spec is None or dataclasses.replace(spec, replicated=())
                                 == dataclasses.replace(made_for, replicated=())):
        return made_for
    return spec


def per_device_fixed(spec: ShardingSpec, params, batch, optimizer=None
                     ) -> tuple[tuple[int, int, int, int], StepShardings]:
    """One device's bytes of what the sharded step holds throughout, (parameters,
    gradients of the floating parameters, optimizer state, batch), each tensor its shard
    (gradients are sharded like their parameters); and the step's shardings
    (memory.fixed_memory builds its FixedMemory from them)."""
    sh = step_shardings(spec, params, batch, optimizer)
    p_leaves = jax.tree.leaves(params)
    s_leaves = jax.tree.leaves(sh.params, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    floating = [(l, s) for l, s in zip(p_leaves, s_leaves)
                if jax.dtypes.issubdtype(l.dtype, np.inexact)]
    grads = per_device_bytes([l for l, _ in floating], [s for _, s in floating])
    opt_bytes = 0
    if optimizer is not None:
        opt_state = jax.eval_shape(optimizer.init, params)
        opt_bytes = per_device_bytes(opt_state, sh.opt_state)
    return (per_device_bytes(params, sh.params), grads, opt_bytes,
            per_device_bytes(tuple(batch), sh.batch)), sh


def update_jit_kwargs(shardings: StepShardings | None) -> dict:
    """`in_shardings` / `out_shardings` of the optimizer update alone, (grads, opt_state,
    params) -> (params, opt_state), under a step's shardings: one device's workspace of the
    sharded update; {} unsharded."""
    if shardings is None:
        return {}
    return dict(in_shardings=(shardings.params, shardings.opt_state, shardings.params),
                out_shardings=(shardings.params, shardings.opt_state))


def batch_share(spec: ShardingSpec | None) -> float:
    """One device's share of the batch, and so of the activations the memory model
    profiles on the whole batch: 1 / the data axes' size (1.0 unsharded). What tensor
    parallelism splits further is left to the calibration compiles, which are the sharded
    step's."""
    return 1.0 if spec is None else 1.0 / spec.data_size


def per_device_bytes(tree, shardings) -> int:
    """Bytes of one device's shards of `tree` (leaves: arrays or ShapeDtypeStructs)."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(
            shardings, is_leaf=lambda v: isinstance(v, NamedSharding))):
        shard = s.shard_shape(tuple(np.shape(x)))
        total += nbytes(jax.ShapeDtypeStruct(shard, x.dtype))
    return int(total)


# ---------------------------------------------------------------------------------------
# Communication in a compiled step
# ---------------------------------------------------------------------------------------

_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                "collective-permute")
_HLO_OP = re.compile(r"\s(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                     r"(-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Communication:
    """Collectives one device executes in a compiled step: count and result bytes per kind.

    Counted per execution: a collective inside a while loop (a scan) counts once per
    iteration (XLA's known trip count), nested loops multiply."""

    counts: dict
    bytes: dict
    # of those, collectives XLA tags as part of a rematerialized computation (op_name
    # ".../rematted_computation/..."): communication run by a recomputation
    recomputed_count: int = 0
    recomputed_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return int(sum(self.bytes.values()))

    def to_dict(self) -> dict:
        d = {k: {"count": self.counts[k], "bytes": self.bytes[k]} for k in self.counts}
        d["in recomputation"] = {"count": self.recomputed_count, "bytes": self.recomputed_bytes}
        return d


_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_WHILE_BODY = re.compile(r"\swhile\(.*\bbody=%([^,\s]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED = re.compile(r"\b(?:to_apply|calls|branch_computations|true_computation|"
                     r"false_computation)=\{?%([^,\s}]+)")


def _collective(rhs: str):
    """(kind, per-device result bytes) of an HLO instruction's right-hand side, or None."""
    m = _HLO_OP.search(rhs)
    if not m:
        return None
    # the result type; a combined collective has a tuple type, whose /*index=N*/
    # comments are skipped by the shape pattern
    shapes = _SHAPE.findall(rhs[:m.start()])
    if m.group(2):  # async "-start": (operands..., results...): count the results
        shapes = shapes[len(shapes) // 2:]
    size = 0
    for dt, dims in shapes:
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        size += n * _ITEMSIZE[dt]
    return m.group(1), size


def communication(hlo_text: str) -> Communication:
    """Collectives of a compiled module's HLO text, counted per execution from its ENTRY
    computation: while bodies times their known trip count (1 if XLA gives none), called
    computations (call, conditional branches) once per call. Text without computations
    (a fragment) is counted line by line."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        comps, entry = {"": hlo_text.splitlines()}, ""

    counts = {k: 0 for k in _COLLECTIVES}
    sizes = {k: 0 for k in _COLLECTIVES}
    recomputed = [0, 0]

    def visit(name: str, times: int, depth: int) -> None:
        if depth > 64:
            return
        for line in comps.get(name, ()):
            if " = " not in line:
                continue
            rhs = line.split(" = ", 1)[1]  # "<result type> <opcode>(<operands>), ..."
            found = _collective(rhs)
            if found:
                kind, size = found
                counts[kind] += times
                sizes[kind] += times * size
                if "rematted_computation" in line:
                    recomputed[0] += times
                    recomputed[1] += times * size
                continue
            body = _WHILE_BODY.search(rhs)
            if body:
                trips = _TRIP_COUNT.search(rhs)
                visit(body.group(1), times * (int(trips.group(1)) if trips else 1), depth + 1)
            elif " call(" in rhs or " conditional(" in rhs:
                for callee in _CALLED.findall(rhs):
                    visit(callee, times, depth + 1)

    visit(entry, 1, 0)
    return Communication(counts, sizes, recomputed[0], recomputed[1])


# ---------------------------------------------------------------------------------------
# Values produced by collectives (never recomputed)
# ---------------------------------------------------------------------------------------

def collective_outputs(program, params, spec: ShardingSpec) -> frozenset[int]:
    """Program values that XLA's SPMD partitioner produces with a collective over the
    tensor-parallel axis: outputs of `dot_general` contracting a parameter dimension split
    over `model` (row-parallel: a partial sum, all-reduced) and of `gather` from a
    parameter split over `model` on the gathered dimension (the embedding lookup,
    all-reduced). The planner keeps these in every checkpoint (apply tags them, profiling
    counts them): recomputing them would repeat the all-reduce.

    Empty without tensor parallelism: under dp/fsdp the only collectives are the weight
    all-gathers (of parameters, not of program values) and the gradient reductions
    (after the backward); see docs/guide.md for what remat does to the all-gathers."""
    if spec is None or spec.model_axis is None:
        return frozenset()
    return _propagate(program, program_param_specs(program, params, spec))[0]


def program_param_specs(program, params, spec: ShardingSpec) -> dict[int, P]:
    """Parameter value id (the program's first `n_param_leaves` inputs) -> its spec."""
    specs = jax.tree.leaves(param_specs(params, spec), is_leaf=lambda x: isinstance(x, P))
    return dict(zip(program.invars[:program.n_param_leaves], specs))


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "argmax", "argmin"})


# Parameters that hold sub-programs (scan, while, cond, calls, checkpoints): what their
# outputs are split on is not an elementwise function of their inputs.
_HIGHER_ORDER = frozenset({"jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr",
                           "branches"})


def _model_dims(s: P) -> frozenset[int]:
    out = set()
    for d, ax in enumerate(s):
        axes = ax if isinstance(ax, tuple) else (ax,)
        if MODEL_AXIS in axes:
            out.add(d)
    return frozenset(out)


def _reshape_dims(dims, old: tuple, new: tuple) -> set[int]:
    """Split dims of a reshape's operand mapped to its result: a dim maps to the result
    dim that starts at the same flat offset and whose size it divides or equals (a split
    [.., h * d] -> [.., h, d] stays split on h); dims that do not line up are dropped."""
    out = set()
    for d in dims:
        prefix = int(np.prod(old[:d]))
        for e in range(len(new)):
            if int(np.prod(new[:e])) == prefix and new[e] > 1 and (
                    old[d] % new[e] == 0 or new[e] % old[d] == 0):
                out.add(e)
                break
    return out


def _propagate(program, origin: dict[int, P], source: frozenset[int] = frozenset()
               ) -> tuple[frozenset[int], bool]:
    """Values XLA's SPMD partitioner produces with a collective over the model axis.

    Starting from `origin` (value id -> spec, the parameters) it follows which dims of
    each value are split over `model` (column-parallel outputs split on their features,
    their elementwise successors, transposes, broadcasts and reshapes). A value is a
    collective's output when its equation combines or cuts a split dimension: a `dot_general`
    contracting one (row-parallel partial sums, all-reduced), a reduction over one (the
    log-softmax max and sum over vocabulary-split logits), a `gather` indexing one (an
    embedding lookup, a `take_along_axis` on split logits), a slice or split along one
    (q, k and v cut out of a fused projection: XLA reshuffles them with collective
    permutes).

    Also returns whether a split that comes from a value in `source` escapes the
    tensor-parallel pairing: it meets a contraction whose other side is not split on the
    same dimension (XLA then gathers or reduces activations), or enters a sub-program (a
    scan's carry) as an activation."""
    params = frozenset(program.invars[:getattr(program, "n_param_leaves", 0)])
    derived = set(source)
    escapes = False
    avals = getattr(program, "avals", {})
    split: dict[int, frozenset[int]] = {v: _model_dims(s) for v, s in origin.items()}
    split = {v: d for v, d in split.items() if d}

    def dims(v) -> frozenset[int]:
        return split.get(v, frozenset()) if isinstance(v, int) else frozenset()

    def shape(v) -> tuple:
        a = avals.get(v) if isinstance(v, int) else None
        return tuple(getattr(a, "shape", ())) if a is not None else None

    pinned = set()
    for e in program.eqns:
        name, ins = e.name, e.invars
        if not any(dims(v) for v in ins):
            continue
        mine = [v for v in ins if isinstance(v, int) and v in derived]
        if mine:
            derived.update(e.outvars)
            if _HIGHER_ORDER & e.params.keys() and any(dims(v) and v not in params
                                                       for v in mine):
                escapes = True
        out: set[int] = set()
        if name == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            ld, rd = dims(ins[0]), dims(ins[1])
            if ld & set(lc) or rd & set(rc):
                pinned.update(e.outvars)
                one_sided = [(a in ld) != (b in rd) for a, b in zip(lc, rc)]
                if any(one_sided) and mine:
                    escapes = True
                continue
            lhs_free = [d for d in range(len(shape(ins[0]) or ())) if d not in lc and d not in lb]
            rhs_free = [d for d in range(len(shape(ins[1]) or ())) if d not in rc and d not in rb]
            order = list(lb) + lhs_free
            out = {i for i, d in enumerate(order) if d in ld}
            out |= {len(lb) + len(lhs_free) + i for i, d in enumerate(rhs_free) if d in rd}
            out |= {i for i, d in enumerate(rb) if d in rd}
        elif name == "gather":
            collapsed = set(e.params["dimension_numbers"].collapsed_slice_dims)
            if dims(ins[0]) & collapsed:
                pinned.update(e.outvars)
            continue
        elif name in _REDUCTIONS:
            axes = set(e.params.get("axes", ()))
            if "axis" in e.params:
                axes.add(e.params["axis"])
            d = dims(ins[0])
            if d & axes:
                pinned.update(e.outvars)
                continue
            keep = [i for i in range(len(shape(ins[0]) or ())) if i not in axes]
            out = {j for j, i in enumerate(keep) if i in d}
        elif name in ("split", "slice", "dynamic_slice"):
            # a slice along a split dimension does not line up with the devices' shards
            # (q, k, v cut out of a fused projection): XLA reshuffles it with collective
            # permutes / all-to-alls, and the pieces stay split
            d, src = dims(ins[0]), shape(ins[0])
            res = [shape(v) for v in e.outvars]
            if src is None or any(r is None or len(r) != len(src) for r in res):
                continue
            cut = {i for r in res for i in range(len(src)) if r[i] != src[i]}
            if d & cut:
                pinned.update(e.outvars)
            for v, r in zip(e.outvars, res):
                split[v] = frozenset(i for i in d if r[i] > 1)
            continue
        elif name == "transpose":
            perm = e.params["permutation"]
            out = {j for j, i in enumerate(perm) if i in dims(ins[0])}
        elif name == "broadcast_in_dim":
            bd = e.params["broadcast_dimensions"]
            out = {bd[i] for i in dims(ins[0])}
        elif name == "reshape":
            old, new = shape(ins[0]), shape(e.outvars[0])
            if old is not None and new is not None:
                out = _reshape_dims(dims(ins[0]), old, new)
        elif len(e.outvars) == 1 and shape(e.outvars[0]) is not None \
                and not _HIGHER_ORDER & e.params.keys():
            # elementwise and shape-preserving ops: a split dim survives where the
            # operand has the result's rank and full size on it
            res = shape(e.outvars[0])
            for v in ins:
                sv = shape(v)
                if sv is not None and len(sv) == len(res):
                    out |= {d for d in dims(v) if sv[d] == res[d] and res[d] > 1}
        if out:
            for v in e.outvars:
                split[v] = frozenset(out)
    return frozenset(pinned), escapes


def with_unpaired(step, params, batch) -> ShardingSpec | None:
    """The sharding of `step` (a step.Step) with `replicated` set to the unpaired kernels
    of its loss's program (traced on abstract shapes): the tp layout the planner and the
    built-in policies it is compared with share. Unchanged without tensor parallelism, or
    where `replicated` is set already."""
    spec = step.sharding
    if spec is None or spec.model_axis is None or spec.replicated:
        return spec
    program = trace(step.loss_fn, params, *as_batch(batch), has_aux=step.has_aux)
    return with_unpaired_kernels(spec, program, params)


def with_unpaired_kernels(spec: ShardingSpec | None, program, params) -> ShardingSpec | None:
    """`spec` with `replicated` set to the unpaired kernels of the traced `program`
    (unpaired_kernels); unchanged without tensor parallelism, or where it is set already."""
    if spec is None or spec.model_axis is None or spec.replicated:
        return spec
    return dataclasses.replace(spec, replicated=unpaired_kernels(program, params, spec))


def check_devices(spec: ShardingSpec | None) -> None:
    """ConfigError unless JAX sees the devices `spec`'s mesh needs (nothing unsharded)."""
    if spec is not None:
        spec.mesh()


def unpaired_kernels(program, params, spec: ShardingSpec) -> tuple[str, ...]:
    """Paths of the kernels that tp, by their names, would make column-parallel but that
    no row-parallel kernel pairs with: their split output meets a contraction over the
    split dimension with an unsplit operand, or enters the layer scan as its carry. A
    patch embedding feeding the residual stream, BERT's masked-LM `head_transform`.
    Megatron keeps such layers replicated; split, XLA would gather and all-reduce
    activations around them, collectives no equation of the jaxpr shows and a
    recomputation would repeat. Analysed on the top-level program (kernels used only
    inside a scan body are the layers' own, paired inside it)."""
    if spec.model_axis is None:
        return ()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = program_param_specs(program, params, spec)
    ids = program.invars[:program.n_param_leaves]
    row, column = {}, []
    for vid, (path, leaf) in zip(ids, flat):
        name, shape = _path_str(path), np.shape(leaf)
        d = _tp_dim(name, shape)
        if d is None or name.rsplit("/", 1)[-1] == "embedding":
            continue
        if d == len(shape) - 2:
            row[vid] = specs[vid]
        else:
            column.append((vid, name))
    out = []
    for vid, name in column:
        _, escapes = _propagate(program, {**row, vid: specs[vid]}, frozenset({vid}))
        if escapes:
            out.append(name)
    return tuple(out)


def gathered_spec(s: P, spec: ShardingSpec) -> P:
    """A parameter's spec with the data (fsdp) axes removed: the weight as the compute
    uses it once all-gathered (still split over `model` under tp; under plain fsdp an
    axis named `model` is a data axis like the others and is gathered too)."""
    out = []
    for ax in s:
        axes = ax if isinstance(ax, tuple) else (ax,)
        kept = [a for a in axes if a is not None and a not in spec.data_axes]
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*out)


def scan_body_shardings(eqn, body_program, param_specs_by_id: dict[int, P],
                        spec: ShardingSpec):
    """Inside the body of a scan over stacked parameters: (body input id -> NamedSharding
    of the all-gathered weight slice, under fsdp; the body's values produced by a
    tensor-parallel collective). A stacked parameter's slice has the stack's spec without
    its leading (layer) dimension; a parameter passed as a scan constant keeps its spec.

    The scan rebuilt by a plan (apply.run_scheme) gathers each iteration's weights at the
    start of every sub-stage and does not keep them: the backward gathers them again once
    per iteration (as ZeRO-3 does, and as XLA does for the scan without remat), and that
    one gather serves both the recomputation and the gradient. Keeping them would stack
    every layer's gathered weights: a full copy of the parameters per device."""
    nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
    origin: dict[int, P] = {}
    for j, (outer, inner) in enumerate(zip(eqn.invars, body_program.invars)):
        s = param_specs_by_id.get(outer) if isinstance(outer, int) else None
        if s is None or nc <= j < nc + ncar:
            continue
        origin[inner] = s if j < nc else P(*list(s)[1:])
    regather = {}
    if spec.scheme in ("fsdp", "fsdp+tp"):
        mesh = spec.mesh()
        for vid, s in origin.items():
            g = gathered_spec(s, spec)
            if g != s:
                regather[vid] = NamedSharding(mesh, g)
    pinned = _propagate(body_program, origin)[0] if spec.model_axis else frozenset()
    return regather, pinned


def carry_constraint(spec: ShardingSpec):
    """Under tp (a `model` axis), a function constraining a scan's carries to be split on
    their first (batch) dimension over the data axes and replicated over `model`, else
    None. Left to itself XLA may split the carry, a transformer's residual stream, over
    `model` on its feature dimension (after a column-parallel patch embedding, say): its
    norms then all-reduce inside the loop body and the activations are all-gathered and
    re-laid out, collectives with no equation in the jaxpr that a recomputed sub-stage
    repeats. Megatron's layout keeps the residual stream replicated over the
    tensor-parallel group. Carries whose first dimension the data axes do not divide, and
    scalars, are left alone."""
    if spec.model_axis is None:
        return None
    mesh, n = spec.mesh(), spec.data_size
    axes = spec.data_axes
    lead = axes[0] if len(axes) == 1 else axes

    def pin(carry):
        out = []
        for v in carry:
            shape = np.shape(v)
            if shape and shape[0] % n == 0:
                v = jax.lax.with_sharding_constraint(
                    v, NamedSharding(mesh, P(lead, *([None] * (len(shape) - 1)))))
            out.append(v)
        return out
    return pin


def gathered_params(program, params, spec: ShardingSpec) -> dict[int, tuple[P, int]]:
    """Under fsdp: parameter value id -> (its all-gathered spec, one device's bytes of the
    gathered weight) for every parameter split over the data axes. A checkpointed segment
    all-gathers these once, tagged and kept by its policy, so its recomputation in the
    backward does not all-gather them again (apply.run_segments)."""
    if spec is None or spec.scheme not in ("fsdp", "fsdp+tp"):
        return {}
    specs = jax.tree.leaves(param_specs(params, spec), is_leaf=lambda x: isinstance(x, P))
    out = {}
    for vid, s in zip(program.invars[:program.n_param_leaves], specs):
        g = gathered_spec(s, spec)
        if g == s:
            continue
        aval = program.avals[vid]
        shard = tuple(n // (spec.model_size if ax == MODEL_AXIS else 1)
                      for n, ax in zip(aval.shape, list(g) + [None] * (len(aval.shape) - len(g))))
        out[vid] = (g, nbytes(jax.ShapeDtypeStruct(shard, aval.dtype)))
    return out


def gathered_bytes(program, params, spec: ShardingSpec | None) -> dict[int, int]:
    """Under fsdp: parameter value id -> one device's bytes of its all-gathered weight
    (gathered_params), what a checkpointed segment keeps (memory.with_gathered_weights);
    {} otherwise."""
    return {v: b for v, (_, b) in gathered_params(program, params, spec).items()}


def gather_shardings(program, params, spec: ShardingSpec | None) -> dict:
    """Under fsdp: parameter value id -> NamedSharding of the all-gathered weight, what a
    checkpointed segment gathers once at its start and keeps by name (apply.run_segments);
    {} otherwise."""
    if spec is None:
        return {}
    gathered = gathered_params(program, params, spec)
    if not gathered:
        return {}
    mesh = spec.mesh()
    return {vid: NamedSharding(mesh, g) for vid, (g, _) in gathered.items()}


def rebuilds_scan(spec: ShardingSpec | None) -> bool:
    """Whether a layer-stack scan is rebuilt with per-iteration gathers and pins under
    `spec` (fsdp or tp: scan_layout); under dp, or unsharded, the scan runs as XLA lays
    it out."""
    return spec is not None and spec.scheme != "dp"


def scan_layout(program, params, spec: ShardingSpec | None):
    """Under fsdp or tp: (the ShardingSpec, parameter value id -> its PartitionSpec), what a
    layer-stack scan needs to gather its weight slices and keep its collective outputs
    (scan_iteration, apply.run_scheme); None otherwise."""
    if not rebuilds_scan(spec):
        return None
    return spec, program_param_specs(program, params, spec)


def scan_iteration(eqn, body_program, layout):
    """(regather, pinned, pin_carry) for the iterations of the layer-stack scan `eqn`
    under `layout` (scan_layout's): the body inputs whose weight slices each sub-stage
    all-gathers, the body values produced by tensor-parallel collectives
    (scan_body_shardings), and the function constraining the carry (carry_constraint, or
    None). (None, frozenset(), None) without a layout."""
    if layout is None:
        return None, frozenset(), None
    spec, specs = layout
    regather, pinned = scan_body_shardings(eqn, body_program, specs, spec)
    return regather, pinned, carry_constraint(spec)


def shard_arrays(params, batch, opt_state=None, *, optimizer=None, mesh=None, sharding=None):
    """Place real `params`, `batch` (and `opt_state`) on the mesh as the scheme shards them
    (`jax.device_put` with their NamedShardings); returns them in the same order."""
    spec = resolve(mesh, sharding)
    batch = as_batch(batch)
    sh = step_shardings(spec, abstract(params), abstract(batch),
                        optimizer if opt_state is not None else None)
    out = (jax.device_put(params, sh.params), jax.device_put(batch, sh.batch))
    if opt_state is not None:
        out += (jax.device_put(opt_state, sh.opt_state),)
    return out
