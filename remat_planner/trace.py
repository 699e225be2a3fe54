"""Stage 1: trace a loss function to a flat program of equations on abstract shapes.

Nested `jit` / `closed_call` equations are inlined so that segments can cut through
them; calls with their own differentiation rules (custom_jvp / custom_vjp) and control
flow stay single equations. Each equation keeps its Flax module path. Each inlined call
is remembered (Call), so that a replay of a range holding it whole emits the user's call
again rather than its equations one by one: XLA then compiles the planned step as it
compiles the user's (eval_range).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jcore
from .errors import UnsupportedModelError


def as_batch(batch) -> tuple:
    """Batch arguments as a tuple: loss_fn(params, *batch)."""
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def abstract(tree):
    """Shapes and dtypes of a tree of arrays (nothing allocated)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


# Call primitives whose body is plain JAX and can be inlined without changing semantics.
_INLINE_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


@dataclasses.dataclass(frozen=True)
class Literal:
    """A constant operand written into an equation."""

    val: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Eqn:
    """One equation of the flat program; values are integer ids."""

    primitive: Any
    params: dict
    invars: tuple  # of int | Literal
    outvars: tuple[int, ...]
    module_path: str
    ctx: Any  # JaxprEqnContext: compute type, threefry settings ...

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """A nested call (`jit`, `closed_call`) the trace inlined as equations [lo, hi) of the
    flat program: the call equation as the user's program binds it, its operands and the
    ids its results were given."""

    lo: int
    hi: int
    primitive: Any
    params: dict
    invars: tuple  # of int | Literal
    outvars: tuple  # an id per result of the call (None: a result nothing reads)
    ctx: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The traced loss function as a flat list of equations over integer value ids.

    Attributes:
      eqns: equations in trace (topological) order.
      invars: ids of the flattened arguments: params leaves first, then batch leaves.
      n_param_leaves: how many of `invars` are parameter leaves.
      consts: id -> concrete constant captured by the trace.
      outvars: ids (or Literals) of the outputs: the scalar loss, then the aux leaves.
      avals: id -> abstract value (shape, dtype).
      in_tree: pytree structure of (params, *batch).
      aux_tree: pytree structure of the aux output when loss_fn returns (loss, aux)
        (has_aux), else None.
      calls: the nested calls inlined into `eqns`, outermost first (eval_range).
    """

    eqns: tuple[Eqn, ...]
    invars: tuple[int, ...]
    n_param_leaves: int
    consts: dict
    outvars: tuple
    avals: dict
    in_tree: Any
    aux_tree: Any = None
    calls: tuple = ()

    @property
    def has_aux(self) -> bool:
        return self.aux_tree is not None

    @functools.cached_property
    def calls_at(self) -> dict[int, tuple[Call, ...]]:
        """Equation index -> the calls starting there, outermost first."""
        out: dict[int, list] = {}
        for c in self.calls:
            out.setdefault(c.lo, []).append(c)
        return {k: tuple(sorted(v, key=lambda c: c.lo - c.hi)) for k, v in out.items()}

    @functools.cached_property
    def aux_outputs(self) -> frozenset[int]:
        """Aux outputs computed by the step (not arguments passed through): returned by
        the step, so live from their definition to its end, like fixed memory."""
        return frozenset(v for v in self.outvars[1:] if isinstance(v, int)) - self.free

    @functools.cached_property
    def free(self) -> frozenset[int]:
        """Arguments and constants: live for the whole step whatever the plan."""
        return frozenset(self.invars) | frozenset(self.consts)

    def bind(self, leaves) -> dict:
        """A fresh environment (id -> value) holding the arguments and constants."""
        env = dict(zip(self.invars, leaves))
        env.update(self.consts)
        return env

    def region_env(self, ins, args) -> dict:
        """The environment of a replayed region: its inputs `ins` bound to `args`, and the
        program's constants, which a region closes over rather than takes as inputs
        (memory.stage_io)."""
        env = dict(self.consts)
        env.update(zip(ins, args))
        return env

    def output(self, env: dict):
        """The loss once `env` has been evaluated; `(loss, aux)` for a has_aux program."""
        vals = [v.val if isinstance(v, Literal) else env[v] for v in self.outvars]
        if self.aux_tree is None:
            return vals[0]
        return vals[0], jax.tree.unflatten(self.aux_tree, vals[1:])

    def nbytes(self, vid: int) -> int:
        return nbytes(self.avals[vid])

    def fingerprint(self) -> str:
        """Hash of the computation's structure: shapes, dtypes, primitives, wiring."""
        h = hashlib.sha256()
        h.update(str(self.in_tree).encode())
        for v in self.invars:
            h.update(f"{self.avals[v].str_short()};".encode())
        for e in self.eqns:
            ins = ",".join(str(i) if isinstance(i, int) else "L" for i in e.invars)
            outs = ",".join(f"{o}:{self.avals[o].str_short()}" for o in e.outvars)
            h.update(f"{e.name}({ins})->{outs};".encode())
        if self.aux_tree is not None:
            outs = ",".join(str(v) if isinstance(v, int) else "L" for v in self.outvars)
            h.update(f"aux:{self.aux_tree}->{outs};".encode())
        return h.hexdigest()[:16]


def nbytes(x) -> int:
    """Bytes of an array, aval or ShapeDtypeStruct. Extended dtypes (typed PRNG keys)
    are not numpy dtypes but carry their own itemsize."""
    dtype = x.dtype
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
    return int(np.prod(np.shape(x) if not hasattr(x, "shape") else x.shape, dtype=np.int64)) * int(itemsize)


def _abstractify(tree):
    """ShapeDtypeStructs of the arguments; UnsupportedModelError naming a leaf that is not
    an array (a Python number, string, list ...)."""

    def one(path, x):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            where = "params" if path[0].idx == 0 else f"batch[{path[0].idx - 1}]"
            where += jax.tree_util.keystr(path[1:])
            raise UnsupportedModelError(
                f"{where} is a {type(x).__name__}, not an array; pass arrays or "
                "jax.ShapeDtypeStruct leaves (e.g. jnp.asarray(value))")
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return jax.tree_util.tree_map_with_path(one, tree)


def _check_batch_not_empty(batch) -> None:
    """A batch whose every array is empty (batch size 0) is a step with nothing to plan."""
    leaves = jax.tree.leaves(batch)
    if leaves and all(int(np.prod(l.shape, dtype=np.int64)) == 0 for l in leaves):
        shapes = ", ".join(f"{l.dtype}{list(l.shape)}" for l in leaves)
        raise UnsupportedModelError(
            f"the batch is empty ({shapes}); a step on zero examples has nothing to plan: "
            "pass a batch with at least one example")


def trace(loss_fn: Callable, params, *batch, has_aux: bool = False) -> Program:
    """Trace `loss_fn(params, *batch)` on abstract shapes into a flat Program.

    Args:
      loss_fn: a JAX function returning a scalar, or `(scalar, aux)` with `has_aux`
        (aux: any pytree of arrays, e.g. updated BatchNorm statistics).
      params, batch: arrays or jax.ShapeDtypeStruct pytrees; nothing is allocated.
    """

    abstract_args = _abstractify((params, *batch))
    _check_batch_not_empty(abstract_args[1:])
    aux_tree = None
    if has_aux:
        closed, out_shape = jax.make_jaxpr(lambda p, *b: loss_fn(p, *b), return_shape=True)(
            *abstract_args)
        if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
            raise UnsupportedModelError(
                f"with has_aux, loss_fn must return (loss, aux), got {jax.tree.structure(out_shape)}")
        if len(jax.tree.leaves(out_shape[0])) != 1:
            raise UnsupportedModelError("with has_aux, the first output of loss_fn must be one scalar loss")
        aux_tree = jax.tree.structure(out_shape[1])
    else:
        closed = jax.make_jaxpr(lambda p, *b: loss_fn(p, *b))(*abstract_args)
    outs = closed.out_avals[:1] if has_aux else closed.out_avals
    if len(outs) != 1 or getattr(outs[0], "shape", None) != ():
        shapes = ", ".join(str(a) for a in outs)
        raise UnsupportedModelError(
            f"loss_fn must return one scalar, got ({shapes}); reduce the loss (e.g. jnp.mean) "
            "before planning")
    if not jax.dtypes.issubdtype(outs[0].dtype, np.floating):
        raise UnsupportedModelError(f"loss_fn must return a floating scalar, got {outs[0]}")
    n_param_leaves = len(jax.tree.leaves(abstract_args[0]))
    if not any(jax.dtypes.issubdtype(l.dtype, np.floating) for l in jax.tree.leaves(abstract_args[0])):
        raise UnsupportedModelError(
            "params have no floating-point leaves, so there is nothing to differentiate; "
            "pass the trainable parameters as the first argument of loss_fn")

    builder = Flattener()
    invars = tuple(builder.new(v.aval) for v in closed.jaxpr.invars)
    env = dict(zip(closed.jaxpr.invars, invars))
    for cv, val in zip(closed.jaxpr.constvars, closed.consts):
        env[cv] = builder.const(cv.aval, val)
    outvars = builder.inline(closed.jaxpr, env, prefix="")
    in_tree = jax.tree.structure(abstract_args)
    return Program(tuple(builder.eqns), invars, n_param_leaves, builder.consts, tuple(outvars),
                   builder.avals, in_tree, aux_tree, tuple(builder.calls))


class Flattener:
    """Builds a flat Program: equations with integer value ids, sub-jaxprs inlined
    (trace, and scan.py's body tracing)."""

    def __init__(self):
        self.eqns: list[Eqn] = []
        self.avals: dict[int, Any] = {}
        self.consts: dict[int, Any] = {}
        self.calls: list[Call] = []  # outermost first

    def new(self, aval) -> int:
        vid = len(self.avals)
        self.avals[vid] = aval
        return vid

    def const(self, aval, val) -> int:
        vid = self.new(aval)
        self.consts[vid] = val
        return vid

    def inline(self, jaxpr, env, prefix: str):
        def read(v):
            if isinstance(v, jcore.Literal):
                return Literal(v.val)
            return env[v]

        for eqn in jaxpr.eqns:
            path = _join(prefix, str(eqn.source_info.name_stack))
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name in _INLINE_PRIMITIVES:
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner_jaxpr = inner.jaxpr if hasattr(inner, "jaxpr") else inner
                inner_env = {}
                for cv, val in zip(inner_jaxpr.constvars, getattr(inner, "consts", ())):
                    inner_env[cv] = self.const(cv.aval, val)
                for iv, val in zip(inner_jaxpr.invars, invals):
                    if isinstance(val, Literal):
                        inner_env[iv] = self.const(iv.aval, val.val)
                    else:
                        inner_env[iv] = val
                lo, at = len(self.eqns), len(self.calls)
                results = self.inline(inner_jaxpr, inner_env, path)
                ids = []
                for ov, res in zip(eqn.outvars, results):
                    if isinstance(ov, jcore.DropVar):
                        ids.append(None)
                        continue
                    if isinstance(res, Literal):
                        res = self.const(ov.aval, res.val)
                    env[ov] = res
                    ids.append(res)
                self.calls.insert(at, Call(lo, len(self.eqns), eqn.primitive, dict(eqn.params),
                                           tuple(invals), tuple(ids), eqn.ctx))
                continue
            outs = []
            for ov in eqn.outvars:
                vid = self.new(ov.aval)
                if not isinstance(ov, jcore.DropVar):
                    env[ov] = vid
                outs.append(vid)
            self.eqns.append(Eqn(eqn.primitive, dict(eqn.params), tuple(invals), tuple(outs), path,
                                 eqn.ctx))
        return [read(v) for v in jaxpr.outvars]


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    if not name or name.startswith(prefix):
        return name or prefix
    return f"{prefix}/{name}"


def eval_eqn(eqn: Eqn | Call, env: dict) -> None:
    """Evaluate one equation, or a nested call as the user's program binds it, on `env`
    (id -> value) by binding its primitive, as jax.core.eval_jaxpr does; under a trace
    this re-emits it. A call's result nothing reads (outvar None) is dropped."""
    invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **bind_params)
    if not eqn.primitive.multiple_results:
        ans = [ans]
    for vid, val in zip(eqn.outvars, ans):
        if vid is not None:
            env[vid] = val


def steps(program: Program, lo: int, hi: int):
    """The equations [lo, hi) as eval_range replays them: a nested call held whole in the
    range as one Call (the outermost), the rest as Eqns."""
    k = lo
    while k < hi:
        call = next((c for c in program.calls_at.get(k, ()) if c.lo < c.hi <= hi), None)
        if call is not None:
            yield call
            k = call.hi
        else:
            yield program.eqns[k]
            k += 1


def eval_range(program: Program, lo: int, hi: int, env: dict, calls: bool = True) -> None:
    """Evaluate equations [lo, hi) in place on `env`; with `calls`, each nested call they
    hold whole is bound as the user's program binds it (steps), so that XLA compiles the
    range as it compiles the user's: replayed flat, the corpus Llama's `jnp.take` of its
    embedding compiled to one fusion and 3,072 B of temp more than the user's step under
    its own `nn.remat` per block. Checkpointed regions replay flat (memory.
    make_segment_fn), as the built-ins' comparison steps do (baselines.py)."""
    if not calls:
        for eqn in program.eqns[lo:hi]:
            eval_eqn(eqn, env)
        return
    for step in steps(program, lo, hi):
        eval_eqn(step, env)