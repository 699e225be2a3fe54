"""Explain a plan in the user's terms: what each segment keeps (tensor by tensor, by Flax
module), what it recomputes and what that costs; the modelled memory timeline; and the
same plan as `checkpoint_name` tags + `nn.remat` policies to apply by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from .describe import stage_label
from .memory import (run_chain, differentiated, make_segment_fn, residuals, stage_io, timeline,
                     varying_values)
from .plan import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, NOTHING, STORE, KeepRule, Plan,
                   ScanOption, Segment, Store)
from .planner import Analysis
from .scan import describe as describe_scan
from .units import DEFAULT_UNITS


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One tensor a segment keeps from its forward for its backward."""

    what: str          # "input", "named value" or "residual"
    module: str        # Flax module path of the equation that produced it
    primitive: str     # primitive that produced it
    shape: tuple[int, ...]
    dtype: str
    nbytes: int        # a residual's as XLA keeps it (memory.kept_bytes)
    value: int | None = None  # the program value id, when it is one (a stage's input or output)


@dataclasses.dataclass(frozen=True)
class SegmentExplanation:
    start: int
    stop: int
    modules: tuple[str, ...]          # stage names (Flax module paths) it covers
    option: str
    kept: tuple[KeptTensor, ...]
    saved_bytes: int                  # sum of `kept`
    modelled_keep_bytes: int          # what the (calibrated) memory model counts
    recompute_flops: float            # recomputed in the backward, nested segments included
    children: tuple["SegmentExplanation", ...] = ()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["children"] = [c.to_dict() for c in self.children]
        return d


@dataclasses.dataclass(frozen=True)
class Explanation:
    segments: tuple[SegmentExplanation, ...]
    saved_bytes: int                  # every kept tensor of every segment, nested included
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None
    noremat_measured_peak_bytes: int | None
    recompute_flops: float
    step_flops: float

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "segments"}
        d["segments"] = [s.to_dict() for s in self.segments]
        return d


def _defining(program) -> dict[int, object]:
    return {v: e for e in program.eqns for v in e.outvars}


def _tensor(program, defining, vid: int, what: str) -> KeptTensor:
    aval = program.avals[vid]
    eqn = defining.get(vid)
    return KeptTensor(what, eqn.module_path if eqn else "", eqn.name if eqn else "argument",
                      tuple(int(d) for d in aval.shape), str(aval.dtype), program.nbytes(vid),
                      vid)


def _inputs(program, plan: Plan, seg: Segment, defining) -> list[KeptTensor]:
    lo, hi = plan.stages[seg.start].start, plan.stages[seg.stop - 1].stop
    ins, _ = stage_io(program, lo, hi)
    free = program.free
    return [_tensor(program, defining, v, "input") for v in ins if v not in free]


def _store_residuals(program, plan: Plan, seg: Segment, defining) -> list[KeptTensor]:
    """The residuals JAX's autodiff keeps for a stage run without checkpoint (the memory
    model's own list, memory.residuals). One that is an input or an output of the stage
    carries its program value id (KeptTensor.value), so explain lists the array once
    when a neighbouring segment keeps it too."""
    lo, hi = plan.stages[seg.start].start, plan.stages[seg.stop - 1].stop
    ins, outs = stage_io(program, lo, hi)
    outs = [v for v in outs if jax.dtypes.issubdtype(program.avals[v].dtype, np.inexact)]
    f = make_segment_fn(program, lo, hi, ins, outs)
    avals = [jax.ShapeDtypeStruct(program.avals[v].shape, program.avals[v].dtype) for v in ins]
    wrt = differentiated(ins, varying_values(program))
    free, module = program.free, plan.stages[seg.start].name
    kept = []
    for r in residuals(f, avals, wrt):
        if r.input is not None:
            if ins[r.input] not in free:  # params, batch and constants are live anyway
                kept.append(_tensor(program, defining, ins[r.input], "input"))
            continue
        kept.append(KeptTensor("residual", module, r.primitive or "unknown",
                               tuple(int(d) for d in r.aval.shape), str(r.aval.dtype),
                               r.nbytes, outs[r.output] if r.output is not None else None))
    return kept


def _once(kept: list[KeptTensor], listed: set[int]) -> list[KeptTensor]:
    """`kept` less the program values an earlier segment already lists (one array, kept
    once: a stored stage's output kept as its residual is the next segment's input)."""
    out = []
    for t in kept:
        if t.value is not None:
            if t.value in listed:
                continue
            listed.add(t.value)
        out.append(t)
    return out


def _explain_segment(an: Analysis, plan: Plan, seg: Segment, defining,
                     listed: set[int]) -> SegmentExplanation:
    program, chain = an.program, an.chain_for(plan.segments, chain=an.chain)
    modules = tuple(plan.stages[i].name for i in range(seg.start, seg.stop))
    if seg.children:
        kept = _once(_inputs(program, plan, seg, defining), listed)
        children = tuple(_explain_segment(an, plan, c, defining, listed) for c in seg.children)
        _, cost = run_chain(chain, seg.children, 0, inside_region=True)
        modelled = chain.region_input_bytes(seg.start, seg.stop)
    else:
        children = ()
        option = chain.leaf_profile(seg.start, seg.stop).option(seg.option)
        cost = option.recompute_flops
        modelled = option.keep_bytes
        match seg.kind:
            case Store():
                kept = _store_residuals(program, plan, seg, defining)
            case ScanOption():  # per-iteration values, stacked by the scan
                kept = _inputs(program, plan, seg, defining) + [
                    KeptTensor(f"stacked by the scan ({seg.option})", modules[0], "scan", (),
                               "", int(modelled))]
            case _:  # a checkpoint keeping its inputs and the values it names
                kept = _inputs(program, plan, seg, defining) + [
                    _tensor(program, defining, v, "named value") for v in seg.saved]
        kept = _once(kept, listed)
    return SegmentExplanation(seg.start, seg.stop, modules, seg.option, tuple(kept),
                              sum(t.nbytes for t in kept), int(modelled), float(cost), children)


def explain(an: Analysis, plan: Plan) -> Explanation:
    """Per-segment account of `plan` on the analysed step. Each array is listed once, under
    the first segment (in forward order, a region before its children) that keeps it: a
    stored stage's output that JAX keeps as its residual is also the next segment's
    input, one array, listed as the residual."""
    defining, listed = _defining(an.program), set()
    segs = tuple(_explain_segment(an, plan, s, defining, listed) for s in plan.segments)

    def total(ss: Sequence[SegmentExplanation]) -> int:
        return sum(s.saved_bytes + total(s.children) for s in ss)

    return Explanation(segs, total(segs), plan.budget_bytes, plan.predicted_peak_bytes,
                       plan.measured_peak_bytes,
                       an.noremat.peak_bytes if an.noremat else None,
                       plan.recompute_flops, plan.step_flops)


# ---------------------------------------------------------------------------------------
# As Flax names
# ---------------------------------------------------------------------------------------

_POLICY = {NOTHING: "jax.checkpoint_policies.nothing_saveable",
           DOTS_NO_BATCH: "jax.checkpoint_policies.dots_with_no_batch_dims_saveable",
           DOTS_NARROW: "remat_planner.dots_narrow_saveable",
           DOTS: "jax.checkpoint_policies.dots_saveable"}


def flax_names(an: Analysis, plan: Plan) -> list[dict]:
    """The plan as instructions for hand-written Flax code.

    One entry per top-level segment: the modules it covers; whether to wrap them in
    `nn.remat` (one `nn.remat` around all of them: they form one checkpoint region); the
    built-in policy equivalent to its keep option; and, for checkpoints that keep named
    values, the values to tag with `checkpoint_name` (suggested name, module, primitive,
    shape) with `save_only_these_names(*names)` as the exact policy. Nested regions list
    their children the same way.
    """
    defining = _defining(an.program)

    def entry(seg: Segment) -> dict:
        modules = [plan.stages[i].name for i in range(seg.start, seg.stop)]
        match seg.kind:
            case Store():
                return {"modules": modules, "remat": False}
            case ScanOption():
                return {"modules": modules, "remat": True, "scan_scheme": seg.option,
                        "how": describe_scan(seg.option)}
            case KeepRule(rule=rule):
                policy = _POLICY[rule]
            case kind:
                raise NotImplementedError(f"flax_names: no hand-written form of {kind!r}")
        tags = []
        for k, v in enumerate(seg.saved):
            t = _tensor(an.program, defining, v, "named value")
            tags.append({"name": f"{t.module or 'value'}/{t.primitive}_{k}", "module": t.module,
                         "primitive": t.primitive, "shape": list(t.shape), "dtype": t.dtype})
        d = {"modules": modules, "remat": True, "policy": policy,
             "checkpoint_names": tags,
             "exact_policy": ("jax.checkpoint_policies.save_only_these_names("
                              + ", ".join(repr(t["name"]) for t in tags) + ")")}
        if seg.children:
            d["nested"] = [entry(c) for c in seg.children]
        return d

    return [entry(s) for s in plan.segments]


# ---------------------------------------------------------------------------------------
# Memory timeline
# ---------------------------------------------------------------------------------------

def plot_memory(an: Analysis, plan: Plan, path: str, units=None) -> None:
    """Write the modelled live bytes over the step, with and without the plan, as PNG.
    `units`: a units.Units for the y axis (the budget's family; default decimal)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = memory_figure(an, plan, units)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_figure(an: Analysis, plan: Plan, units=None):
    """The matplotlib Figure of plot_memory. The legend and the note on the peak sit right
    of the plot, outside the axes, so they never cover a curve; the layout is constrained,
    so the tick labels stay inside the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = units or DEFAULT_UNITS

    def name(i: int) -> str:
        st = plan.stages[i]
        return stage_label(st.name, an.program, is_last=i == len(plan.stages) - 1,
                           span=(st.start, st.stop))

    base = an.fixed.total + an.calibration_bytes
    store_all = [Segment(i, i + 1, STORE) for i in range(an.chain.n)]
    lines = {"no remat": timeline(an.chain, store_all),
             "plan": timeline(an.chain_for(plan.segments, chain=an.chain), plan.segments)}
    measured = {"no remat": an.noremat.peak_bytes if an.noremat else None,
                "plan": plan.measured_peak_bytes}
    # The plan's predicted peak may carry the closed loop's XLA correction: draw the plan
    # line with it so the curve's peak is the predicted peak the plan reports.
    plan_offset = plan.predicted_peak_bytes - (base + max(p.live_bytes for p in lines["plan"]))
    offsets = {"no remat": 0, "plan": plan_offset}
    top = max(base + max(p.live_bytes for p in lines["no remat"]), plan.budget_bytes)
    gib, unit = units.scale(top)
    fig, ax = plt.subplots(figsize=(14, 6.5), layout="constrained")
    ax.axhspan(0, an.fixed.total / gib, color="0.85",
               label=f"fixed: params + grads + optimizer state + batch "
                     f"({an.fixed.total / gib:.2f} {unit})")
    note = ""
    for (label, points), color in zip(lines.items(), ("tab:red", "tab:blue")):
        x = np.linspace(0, 1, len(points))
        y = np.array([base + offsets[label] + p.live_bytes for p in points]) / gib
        ax.step(x, y, where="mid", color=color, label=f"{label} (memory model)")
        k = int(np.argmax(y))
        ax.plot([x[k]], [y[k]], "v", color=color, markersize=9,
                label=f"{label}: modelled peak {y[k]:.2f} {unit}")
        if measured[label] is not None:
            ax.plot([x[k]], [measured[label] / gib], "o", color=color, markerfacecolor="none",
                    markersize=11, label=f"{label}: XLA peak {measured[label] / gib:.2f} {unit}")
        if label == "plan":
            p = points[k]
            note = (f"plan's modelled peak {y[k]:.2f} {unit}:\n"
                    f"{p.phase} of {name(p.start)}\n"
                    f"kept from earlier stages {p.kept_bytes / gib:.2f} {unit},\n"
                    f"live in this stage {(p.live_bytes - p.kept_bytes) / gib:.2f} {unit}")
    ax.axhline(plan.budget_bytes / gib, color="black", linestyle="--",
               label=f"budget {plan.budget_bytes / gib:.2f} {unit}")
    points = lines["plan"]
    ticks = np.linspace(0, 1, len(points))
    every = max(1, len(points) // 12)
    ax.set_xticks(ticks[::every])
    short = {"forward": "fwd", "backward": "bwd", "recompute": "rec"}
    ax.set_xticklabels([f"{short[p.phase]} {name(p.start)}"[:32]
                        for p in points[::every]], rotation=35, ha="right",
                       rotation_mode="anchor", fontsize=7)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(0, top / gib * 1.08)
    ax.set_xlabel("position in the step's schedule (forward, then backward; plan's stages)")
    ax.set_ylabel(f"live bytes ({unit})")
    ax.set_title("Modelled memory over the training step")
    if note:  # the note on the plan's peak, as a legend entry without a line
        ax.plot([], [], " ", label=note)
    fig.legend(fontsize=8, loc="outside right upper")
    return fig
