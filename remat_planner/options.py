"""The plan space: what one segment of a plan can do with its stages (its keep option).

A keep option is one of a closed set of kinds, one frozen class each:

- `Store()`: no checkpoint; the backward keeps every residual the stage needs.
- `KeepRule(rule)`: one `jax.checkpoint` region keeping its inputs plus what the rule
  names (`nothing`, `dots_no_batch`, `dots_narrow`, `dots`; the exact values are the
  segment's `saved`).
- `ScanOption(scheme)`: a layer-stack scan stage rebuilt as the `ScanScheme` says.

Every option has `.name`, the string a plan file and every figure use (`"store"`,
`"dots"`, `"scan:12x[dots]/2"`), and `parse_option(name)` gives the option back.
Adding a kind (a keep-set, an offload) is: its class here (its `parse`, its `name`, and
its segment shape, `one_stage`), its cost in the memory model (the `KeepOption`s a stage
gets, memory.py or scan.py) and its replay in apply.py (`apply.REPLAY`); validation,
JSON and the dispatch on kinds follow. See docs/architecture.md.

This module imports nothing from the package: it is the base of the plan data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import ClassVar, Sequence

STORE = "store"            # no checkpoint: the backward keeps every residual it needs
NOTHING = "nothing"        # checkpoint keeping only the segment's inputs
DOTS_NO_BATCH = "dots_no_batch"  # ... plus outputs of dot_general without batch dims
DOTS = "dots"              # ... plus outputs of every dot_general and convolution
# ... plus outputs of dot_general without batch dims and of batched dot_generals whose
# output is no larger than an operand: attention's probabilities @ values, not its scores
DOTS_NARROW = "dots_narrow"
KEEP_RULES = (NOTHING, DOTS_NO_BATCH, DOTS_NARROW, DOTS)  # checkpoint options, frugal first


SCAN_PREFIX = "scan:"
_PART = re.compile(r"^(\d+)x([a-z_|()\[\];*0-9]+?)((?:/\d+)*)$")


# ---------------------------------------------------------------------------------------
# Scan schemes: the keep options of a layer-stack scan stage (their cost is scan.py's,
# their replay apply.py's)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ScanPart:
    """`count` consecutive iterations run with one per-iteration policy.

    groups: () for a flat scan (every iteration keeps its residuals under `policy`);
    (k,) for an outer scan over count/k checkpointed groups of k iterations each (only
    the group inputs are kept; a group is recomputed in the backward pass); (k1, k2)
    for groups of k1 sub-groups of k2 iterations, and so on.
    """

    count: int
    policy: str
    groups: tuple[int, ...] = ()

    @property
    def layers_per_iteration(self) -> int:
        return len(layer_policies(self.policy))

    @property
    def iterations(self) -> int:
        return self.count // self.layers_per_iteration

    @property
    def n_groups(self) -> int:
        return self.iterations // math.prod(self.groups)

    def spans(self) -> list[int]:
        """Iterations covered by one item of each checkpointed level, outermost first."""
        return [math.prod(self.groups[j:]) for j in range(len(self.groups))]

    def label(self) -> str:
        return f"{self.count}x{self.policy}" + "".join(f"/{k}" for k in self.groups)


@dataclasses.dataclass(frozen=True)
class ScanScheme:
    """A layer stack run as consecutive scans (parts), in forward order."""

    parts: tuple[ScanPart, ...]

    @property
    def option(self) -> str:
        """The keep-option name of this scheme; a plain scan is `store`."""
        if len(self.parts) == 1 and self.parts[0] == ScanPart(self.parts[0].count, STORE):
            return STORE
        return self.label()

    def label(self) -> str:
        """`scan:` and the parts joined by `+` (what ScanScheme.parse reads)."""
        return SCAN_PREFIX + "+".join(p.label() for p in self.parts)

    @classmethod
    def parse(cls, option: str) -> "ScanScheme":
        """The scheme named `option`; ValueError if it is not a scan scheme name."""
        if not is_scan_option(option):
            raise ValueError(f"not a scan scheme: {option!r}")
        parts = []
        for text in option[len(SCAN_PREFIX):].split("+"):
            m = _PART.match(text)
            if m is None:
                raise ValueError(f"bad scan scheme part {text!r} in {option!r}")
            groups = tuple(int(k) for k in m.group(3).split("/")[1:])
            part = ScanPart(int(m.group(1)), m.group(2), groups)
            g = part.layers_per_iteration  # raises ValueError if malformed
            if part.count < 1 or any(k < 2 for k in groups) or part.count % (g * math.prod(groups)):
                raise ValueError(f"scan scheme part {text!r}: groups must be >= 2 and, times the "
                                 "layers per iteration, divide the count")
            parts.append(part)
        return cls(tuple(parts))

    @property
    def length(self) -> int:
        return sum(p.count for p in self.parts)


def layer_policies(policy: str) -> list[str]:
    """The per-layer plans of one iteration: `a;2*b` runs three layers per iteration of
    the rebuilt scan (plans a, b, b), so layers can mix plans without splitting the stack
    (the stacked parameters are reshaped, which is free, not sliced, which copies; each
    layer's slice is taken inside its checkpoints, see part_cost)."""
    names = []
    for item in policy.split(";"):
        count, star, name = item.partition("*")
        if not star:
            count, name = "1", item
        if not count.isdigit() or int(count) < 1 or not name or "*" in name:
            raise ValueError(f"bad per-iteration plan {policy!r}")
        names += [name] * int(count)
    return names


def mixed_name(names: Sequence[str]) -> str:
    """Inverse of layer_policies: runs of equal plans written `k*plan`, joined by `;`."""
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][1] == name:
            runs[-1][0] += 1
        else:
            runs.append([1, name])
    return ";".join(name if k == 1 else f"{k}*{name}" for k, name in runs)


def is_scan_option(option: str) -> bool:
    """Whether the name `option` is written as a scan scheme (`scan:...`); for typed code,
    `isinstance(parse_option(option), ScanOption)`."""
    return option.startswith(SCAN_PREFIX)


def validate_option(option: str) -> None:
    """Raise ValueError if `option` is not a keep option's name (parse_option)."""
    parse_option(option)


# ---------------------------------------------------------------------------------------
# The option kinds
# ---------------------------------------------------------------------------------------

_KINDS: list[type["Option"]] = []


class Option:
    """A segment's keep option: one frozen subclass per kind (option_kinds()).

    A subclass gives `name` (the string plans are written with), a classmethod
    `parse(name)` (the option, None if `name` is not of this kind, ValueError if it is
    but malformed), `checkpoints` (whether a segment with it is a `jax.checkpoint`
    region) and `one_stage` (whether such a segment is exactly one stage without
    children); `what` names the kind in messages.
    """

    checkpoints: ClassVar[bool] = True
    one_stage: ClassVar[bool] = False
    what: ClassVar[str] = "keep option"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _KINDS.append(cls)

    @property
    def name(self) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls, name: str) -> "Option | None":
        raise NotImplementedError

    def check_segment(self, start: int, stop: int, children: Sequence) -> None:
        """ValueError unless a segment over stages [start, stop) with `children` can run
        with this option."""
        if self.one_stage and (stop - start != 1 or children):
            raise ValueError(f"a {self.what} segment is exactly one stage without children")

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Store(Option):
    """No checkpoint: the stage runs as written and its backward keeps its residuals."""

    checkpoints: ClassVar[bool] = False
    one_stage: ClassVar[bool] = True
    what: ClassVar[str] = "store"

    @property
    def name(self) -> str:
        return STORE

    @classmethod
    def parse(cls, name: str) -> "Store | None":
        return cls() if name == STORE else None


@dataclasses.dataclass(frozen=True)
class KeepRule(Option):
    """One `jax.checkpoint` region keeping its inputs and what `rule` (one of KEEP_RULES)
    names; a region over several stages nests its children inside."""

    rule: str
    what: ClassVar[str] = "keep rule"

    def __post_init__(self):
        if self.rule not in KEEP_RULES:
            raise ValueError(f"unknown keep rule {self.rule!r} (the rules: {', '.join(KEEP_RULES)})")

    @property
    def name(self) -> str:
        return self.rule

    @classmethod
    def parse(cls, name: str) -> "KeepRule | None":
        return cls(name) if name in KEEP_RULES else None


@dataclasses.dataclass(frozen=True)
class ScanOption(Option):
    """A layer-stack scan stage rebuilt as `scheme` says (its parts, groups and
    per-iteration plans); a segment with it is the one stage holding the scan."""

    scheme: ScanScheme
    one_stage: ClassVar[bool] = True
    what: ClassVar[str] = "scan scheme"

    @property
    def name(self) -> str:
        return self.scheme.label()

    @classmethod
    def parse(cls, name: str) -> "ScanOption | None":
        return cls(ScanScheme.parse(name)) if is_scan_option(name) else None


def option_kinds() -> tuple[type[Option], ...]:
    """Every kind of keep option, in the order parse_option tries them."""
    return tuple(_KINDS)


def parse_option(name: str | Option) -> Option:
    """The keep option named `name` (an Option is returned as it is); ValueError with the
    kinds there are if no kind reads it, or the kind's own message if malformed."""
    if isinstance(name, Option):
        return name
    if not isinstance(name, str):
        raise ValueError(f"a keep option is named by a string, not {name!r}")
    for kind in _KINDS:
        option = kind.parse(name)
        if option is not None:
            return option
    raise ValueError(f"unknown keep option {name!r}: expected {STORE!r}, a keep rule "
                     f"({', '.join(KEEP_RULES)}) or a scan scheme ({SCAN_PREFIX!r}...)")


class NamesAnOption:
    """Mixin for a frozen dataclass whose field `OPTION_FIELD` names a keep option (a plan's
    `Segment.option`, the memory model's `KeepOption.name`): the field may be given an
    `Option`, whose name is stored, and `kind` is the option parsed once (ValueError if
    the name names none, parse_option)."""

    OPTION_FIELD: ClassVar[str]

    def __post_init__(self):
        value = getattr(self, self.OPTION_FIELD)
        if isinstance(value, Option):
            object.__setattr__(self, self.OPTION_FIELD, value.name)
            self.__dict__["kind"] = value  # the cached_property's slot

    @functools.cached_property
    def kind(self) -> Option:
        """The typed keep option (Store, KeepRule, ScanOption, ...)."""
        return parse_option(getattr(self, self.OPTION_FIELD))
