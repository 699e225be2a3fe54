"""Stage 6: compile a step and read XLA's own peak and FLOPs; jit training steps.

Nothing is allocated: steps are lowered on abstract shapes and XLA's buffer assignment
is read from `memory_analysis()`. On CPU every compile carries the option that keeps
remat (docs/jax-facts.md, fact 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Callable, Sequence

import jax
from jax.extend import core as jcore

from .graph import jaxpr_flops
from .memory import compiler_options, measure_compiler_options
from .trace import abstract, as_batch
from .errors import ConfigError
from .sharding import communication, jit_kwargs, plan_layout, resolve
from .step import Step


@dataclasses.dataclass(frozen=True)
class Measurement:
    """XLA's figures for one compiled step.

    peak_bytes = argument + output - alias + temp (`peak_memory_in_bytes` leaves out
    temp on CPU, so it is not used).
    """

    peak_bytes: int
    flops: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    compile_seconds: float
    # Sharded steps: collectives in the compiled program, {kind: {"count", "bytes"}}
    # (sharding.communication); None for a single-device step.
    communication: dict | None = None


def make_step(loss_fn: Callable, optimizer=None, has_aux: bool = False) -> Callable:
    """The step a budget bounds: value_and_grad + optimizer update, or just the grad.

    With `has_aux` loss_fn returns `(loss, aux)`; the step returns aux last
    (`(grads, aux)`, or `(params, opt_state, loss, aux)`).
    """
    if optimizer is None:
        def grad_step(params, batch):
            return jax.grad(loss_fn, has_aux=has_aux)(params, *batch)
        return grad_step

    import optax

    def step(params, opt_state, batch):
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, *out) if has_aux else (params, opt_state, out)
    return step


def _lowered_step(step: Step, params, batch):
    """(traced, lowered) training step as measure compiles it."""
    batch = abstract(as_batch(batch))
    params = abstract(params)
    fn = make_step(step.loss_fn, step.optimizer, step.has_aux)
    kw = jit_kwargs(step, params, batch)
    if step.optimizer is None:
        traced = jax.jit(fn, **kw).trace(params, batch)
    else:
        opt_state = jax.eval_shape(step.optimizer.init, params)
        traced = jax.jit(fn, donate_argnums=(0, 1), **kw).trace(params, opt_state, batch)
    return traced, traced.lower()


def _digest(lowered) -> str:
    return hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()


def step_digest(loss_fn: Callable, params, batch, optimizer=None, has_aux: bool = False,
                sharding=None) -> str:
    """A digest of `loss_fn`'s training step as `measure` lowers it, without debug
    information: two losses with the same digest are the same XLA program."""
    return _digest(_lowered_step(Step(loss_fn, optimizer, has_aux, sharding), params, batch)[1])


def measure(loss_fn: Callable, params, batch, optimizer=None, has_aux: bool = False,
            sharding=None, programs: dict | None = None) -> Measurement:
    """Compile the training step of `loss_fn` on abstract shapes and read XLA's peak/FLOPs.

    With `optimizer`, the step is value_and_grad + update with params and optimizer state
    donated; without, it is jax.grad(loss_fn). With `has_aux` loss_fn returns
    `(loss, aux)` and the step returns aux too (it counts as output). With `sharding`
    (a sharding.ShardingSpec) the step is jitted with its in/out shardings on the mesh and
    every figure is one device's (XLA compiles one SPMD program per device), and the
    collectives of the compiled program are counted.

    `programs` (step_digest -> Measurement, filled here): a step that lowers to a
    program already in it is not compiled again (the frontier shares the compiles of the
    built-in policies with the plans that replay them exactly).
    """
    return measure_step(Step(loss_fn, optimizer, has_aux, sharding), params, batch, programs)


def measure_step(step: Step, params, batch, programs: dict | None = None) -> Measurement:
    """`measure` of a step.Step: XLA's peak and FLOPs of its compiled training step."""
    traced, lowered = _lowered_step(step, params, batch)
    digest = _digest(lowered) if programs is not None else None
    if digest is not None and digest in programs:
        return programs[digest]
    t0 = time.perf_counter()
    compiled = lowered.compile(measure_compiler_options())
    seconds = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, Sequence):  # older JAX returned a list of dicts
        cost = cost[0]
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)
    flops = float(cost.get("flops", 0.0))
    if _has_scan(traced.jaxpr, 2 if step.sharding is None else 1):
        # XLA's cost analysis counts a loop body once whatever its trip count; the
        # analytic count multiplies a scan body by its length. Sharded, XLA's count is one
        # device's and the jaxpr's the whole step's: a step with any scan is counted from
        # the jaxpr, so that plans of a scanned model (a scan of one iteration among
        # them) are all counted alike.
        flops = jaxpr_flops(traced.jaxpr)
    comm = None
    if step.sharding is not None:
        comm = communication(compiled.as_text()).to_dict()
    m = Measurement(int(peak), flops, int(ma.argument_size_in_bytes),
                    int(ma.output_size_in_bytes), int(ma.alias_size_in_bytes),
                    int(ma.temp_size_in_bytes), seconds, comm)
    if digest is not None:
        programs[digest] = m
    return m


def _has_scan(jaxpr, min_length: int = 2) -> bool:
    """Whether a (closed) jaxpr runs a scan of at least `min_length` iterations, at any
    depth."""
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if e.primitive.name == "scan" and e.params["length"] >= min_length:
            return True
        if any(_has_scan(sub, min_length) for sub in jcore.jaxprs_in_params(e.params)):
            return True
    return False


def train_step(loss_fn: Callable, optimizer, plan=None, has_aux: bool = False, *,
               params=None, batch=None, mesh=None, sharding=None) -> Callable:
    """Jitted (params, opt_state, batch) -> (params, opt_state, loss) following `plan`;
    with `has_aux` (loss_fn returns `(loss, aux)`), -> (params, opt_state, loss, aux).

    `batch` is the tuple of loss_fn's batch arguments. Params and optimizer state are
    donated. A sharded step (`mesh=` and `sharding=`, or a plan made with them) is jitted
    with the scheme's in/out shardings; it needs `params` and `batch` (arrays or
    ShapeDtypeStructs) to build them, and arguments are resharded to them by jit if they
    are not placed so already (place them with `rp.shard_arrays` to avoid the copy).
    """
    spec = plan_layout(resolve(mesh, sharding), plan)
    step = Step(loss_fn, optimizer, has_aux, spec)
    planned = step.planned(plan) if plan is not None else step
    fn = make_step(planned.loss_fn, optimizer, has_aux)
    kw = {}
    if spec is not None:
        if params is None or batch is None:
            raise ConfigError("a sharded train_step needs params= and batch= (shapes suffice) "
                              "to build its shardings")
        kw = jit_kwargs(step, abstract(params), abstract(as_batch(batch)))
    return jax.jit(lambda p, s, b: fn(p, s, as_batch(b)), donate_argnums=(0, 1),
                   compiler_options=compiler_options(), **kw)
