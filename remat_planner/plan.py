"""The Plan: a frozen, serialisable segment tree that compiles to jax.checkpoint regions."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, ClassVar
from .errors import ConfigError, PlanMismatchError
# The plan space (keep-option names, the scan-scheme grammar, the typed option kinds) lives
# in options.py; re-exported here, where the rest of the package has always found it.
from .options import (DOTS, DOTS_NARROW, DOTS_NO_BATCH, KEEP_RULES, NOTHING,  # noqa: F401
                      SCAN_PREFIX, STORE, KeepRule, Option, ScanOption, ScanPart, ScanScheme,
                      NamesAnOption, Store, is_scan_option, layer_policies, mixed_name,
                      option_kinds, parse_option, validate_option)
from .sharding_spec import ShardingSpec

# Version 2 writes the step's typed fields (signature, has_aux, sharding, pinned) at top
# level; version 1 kept them in "metadata", and is still read (Plan.from_json).
PLAN_FORMAT_VERSION = 2
_READ_VERSIONS = (1, 2)
# The keys version 1 kept in "metadata" that are Plan fields since version 2.
_V1_STEP_KEYS = ("signature", "has_aux", "sharding", "pinned")


@dataclasses.dataclass(frozen=True)
class Segment(NamesAnOption):
    """Stages [start, stop) of the chain, run with one keep option.

    A `store` segment is one stage outside any checkpoint. Any other segment is one
    `jax.checkpoint` region whose policy keeps the values named in `saved` (program value
    ids, tagged with `checkpoint_name`); a region over several stages keeps only its
    inputs and contains `children`, which are segments again (nested checkpoints).

    `option` is the keep option's name, as plan files write it (an `Option` given here is
    stored by its name); `kind` is the typed option (options.py), parsed once, on first
    use: code dispatches on its class, never on the string.
    """

    start: int
    stop: int
    option: str
    saved: tuple[int, ...] = ()
    children: tuple["Segment", ...] = ()

    OPTION_FIELD: ClassVar[str] = "option"

    @property
    def is_checkpoint(self) -> bool:
        return self.kind.checkpoints

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"start": self.start, "stop": self.stop, "option": self.option}
        if self.saved:
            d["saved"] = list(self.saved)
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Segment":
        return cls(int(d["start"]), int(d["stop"]), str(d["option"]),
                   tuple(int(v) for v in d.get("saved", ())),
                   tuple(cls.from_dict(c) for c in d.get("children", ())))

    def depth(self) -> int:
        return (1 if self.is_checkpoint else 0) + max((c.depth() for c in self.children), default=0)


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """What a plan needs to know of a stage: its equation range and name."""

    start: int
    stop: int
    name: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """A rematerialization plan for one traced training step.

    Attributes:
      segments: the top-level segments, covering all stages in order.
      stages: equation ranges of the stages the segments refer to.
      fingerprint: hash of the traced computation the plan was made for.
      budget_bytes: the budget the plan was solved for (whole step).
      predicted_peak_bytes: the memory model's peak of the planned step.
      measured_peak_bytes: XLA's peak of the planned step, or None if not verified.
      recompute_flops: extra FLOPs the plan spends recomputing, by the cost model.
      fixed_bytes: params + grads + optimizer state + batch.
      step_flops: FLOPs of the unplanned step (forward + backward), by the cost model.

    What the replay and the checks rely on of the step the plan was made for:
      signature: `key: value` lines naming its inputs (apply.input_signature), for the
        message of a plan applied to another computation (apply.check_matches).
      has_aux: loss_fn returns `(loss, aux)`; `apply` replays it so by default.
      sharding: the sharding.ShardingSpec the plan was made for (with the kernels tp keeps
        replicated), or None for one device: pass it to `shard_arrays` to place arrays as
        the step takes them.
      pinned: value ids every checkpoint keeps in a sharded step (the outputs of
        collectives, which recomputing would repeat); sorted.

    `metadata` is informational only, left out of equality: labels for display and
    extras measured or predicted on the way (units, compiles, verify_rounds,
    communication, cost_model, ...). Nothing the replay needs is read from it.
    """

    segments: tuple[Segment, ...]
    stages: tuple[StageInfo, ...]
    fingerprint: str
    budget_bytes: int
    predicted_peak_bytes: int
    recompute_flops: float
    fixed_bytes: int
    step_flops: float
    measured_peak_bytes: int | None = None
    measured_flops: float | None = None
    signature: tuple[str, ...] = ()
    has_aux: bool = False
    sharding: ShardingSpec | None = None
    pinned: tuple[int, ...] = ()
    metadata: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        # lists and sets as tuples, so a plan stays hashable and compares by content
        object.__setattr__(self, "signature", tuple(str(line) for line in self.signature))
        object.__setattr__(self, "pinned", tuple(sorted(int(v) for v in self.pinned)))
        object.__setattr__(self, "has_aux", bool(self.has_aux))
        if self.sharding is not None and not isinstance(self.sharding, ShardingSpec):
            raise TypeError(f"Plan.sharding is a ShardingSpec or None, not "
                            f"{type(self.sharding).__name__}")

    # -- use ----------------------------------------------------------------------------

    def apply(self, loss_fn: Callable, has_aux: bool | None = None) -> Callable:
        """`loss_fn` with the same signature whose gradient follows this plan (`has_aux`:
        loss_fn returns `(loss, aux)`; by default as when the plan was made)."""
        from .apply import apply_plan
        return apply_plan(self, loss_fn, has_aux)

    def as_flax_names(self, analysis) -> list[dict]:
        """This plan as `checkpoint_name` tags and `nn.remat` policies to write by hand.

        `analysis` is the `remat_planner.analyze(...)` result of the same step (it names
        the values the plan keeps). See `remat_planner.explain.flax_names`.
        """
        from .explain import flax_names
        return flax_names(analysis, self)

    def summary(self, analysis=None, units=None) -> str:
        """This plan as a table a person can read: per segment the modules it covers
        (nesting as indentation) and what it keeps in words; with the `analysis`
        (`rp.analyze(...)` of the same step) also the bytes each keeps and the FLOPs it
        recomputes. Then each figure (budget, peaks, recompute) with its meaning. `units`:
        a `remat_planner.units.Units` (default decimal: MB, GB). `str(plan)` is
        `plan.summary()`; `repr(plan)` is the dataclass's."""
        from .describe import summary
        return summary(self, analysis, units)

    def __str__(self) -> str:
        return self.summary()

    def to_flax(self, analysis, loss_fn=None, params=None, batch=None):
        """This plan as `nn.remat` wraps of whole Flax modules with policy predicates
        (`analysis`: the `remat_planner.analyze(...)` it was made with; the step's
        arguments name the modules' classes); see `remat_planner.export`."""
        from .export import export_for
        return export_for(self, analysis, loss_fn, params, batch)

    @property
    def recompute_overhead(self) -> float:
        """Recompute FLOPs as a fraction of the unplanned step's FLOPs."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def recompute_time_overhead(self) -> float | None:
        """Predicted recompute time as a fraction of the unplanned step's predicted time
        (the roofline model of costmodel.CostModel), or None for a plan made without it."""
        return self.metadata.get("recompute_time_overhead_predicted")

    def fits(self) -> bool | None:
        if self.measured_peak_bytes is None:
            return None
        return self.measured_peak_bytes <= self.budget_bytes

    # -- serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": "remat-planner/plan",
            "version": PLAN_FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "measured_flops": self.measured_flops,
            "fixed_bytes": self.fixed_bytes,
            "step_flops": self.step_flops,
            "stages": [[s.start, s.stop, s.name] for s in self.stages],
            "segments": [s.to_dict() for s in self.segments],
            "signature": list(self.signature),
            "has_aux": self.has_aux,
            "sharding": None if self.sharding is None else self.sharding.to_dict(),
            "pinned": list(self.pinned),
            "metadata": self.metadata,
        }

    def to_json(self) -> str:
        """The plan as JSON with a checksum of its content, so an edited file is refused."""
        d = self.to_dict()
        return json.dumps({**d, "checksum": plan_checksum(d)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Load a plan written by `to_json` (this version or version 1); a damaged file,
        or one of another format version, raises PlanMismatchError."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanMismatchError(f"plan file is not valid JSON ({e.msg} at line {e.lineno}); "
                                    "re-run remat-plan --out to write it again") from None
        try:
            if d.get("format") != "remat-planner/plan" or d.get("version") not in _READ_VERSIONS:
                raise ValueError(f"format {d.get('format')!r} version {d.get('version')!r}")
            checksum = d.pop("checksum", None)
            if checksum != plan_checksum(d):
                raise PlanMismatchError(
                    "plan file was changed after it was written (checksum "
                    f"{'missing' if checksum is None else 'mismatch'}); plans are not edited by "
                    "hand: re-run remat-plan --out to write it again")
            metadata = dict(d.get("metadata", {}))
            if d["version"] == 1:  # the step's fields were metadata entries
                step = {k: metadata.pop(k) for k in _V1_STEP_KEYS if k in metadata}
            else:
                step = {k: d[k] for k in _V1_STEP_KEYS}
            stages = tuple(StageInfo(int(a), int(b), str(n)) for a, b, n in d["stages"])
            segments = tuple(Segment.from_dict(s) for s in d["segments"])
            plan = cls(
                segments, stages, str(d["fingerprint"]), int(d["budget_bytes"]),
                int(d["predicted_peak_bytes"]), float(d["recompute_flops"]),
                int(d["fixed_bytes"]), float(d["step_flops"]),
                measured_peak_bytes=(None if d.get("measured_peak_bytes") is None
                                     else int(d["measured_peak_bytes"])),
                measured_flops=(None if d.get("measured_flops") is None
                                else float(d["measured_flops"])),
                signature=tuple(step.get("signature", ())),
                has_aux=_bool(step.get("has_aux", False)),
                sharding=(ShardingSpec.from_dict(step["sharding"]) if step.get("sharding")
                          else None),
                pinned=tuple(step.get("pinned", ())),
                metadata=metadata)
            validate_stages(plan.stages)
            validate_segments(plan.segments, len(plan.stages))
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise PlanMismatchError(f"plan file is damaged or not a remat-planner plan ({what}); "
                                    "re-run remat-plan --out to write it again") from None
        return plan


def _bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"has_aux is {value!r}, not true or false")
    return value


def plan_checksum(d: dict) -> str:
    """The checksum `Plan.to_json` writes and `Plan.from_json` checks: a hash of the
    plan's dict (`to_dict`, without its checksum) in a canonical JSON form. A program
    that edits a plan file on purpose writes the checksum of the edited dict."""
    canonical = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def validate_stages(stages) -> None:
    """Check that stages tile equations [0, n) in order, none empty; ValueError if not."""
    if not stages:
        raise ValueError("a plan has at least one stage")
    pos = 0
    for s in stages:
        if s.start != pos or s.stop <= s.start:
            raise ValueError(f"stage [{s.start}, {s.stop}) does not continue at equation {pos}")
        pos = s.stop


def validate_segments(segments, n_stages: int, start: int = 0) -> None:
    """Check that segments tile stages [start, n_stages) in order; ValueError if not."""
    pos = start
    for s in segments:
        if s.start != pos or s.stop <= s.start:
            raise ValueError(f"segment [{s.start}, {s.stop}) does not continue at stage {pos}")
        # the option's kind says which segments it can run (store and scan schemes: one
        # stage, a leaf); an unknown or malformed name raises parse_option's ValueError
        s.kind.check_segment(s.start, s.stop, s.children)
        if s.children:
            validate_segments(s.children, s.stop, s.start)
        pos = s.stop
    if pos != n_stages:
        raise ValueError(f"segments end at stage {pos}, expected {n_stages}")
