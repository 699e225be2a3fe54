"""Run configuration: YAML loading, validation with one-line errors, workload/optimizer factories."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import optax
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from remat_planner.errors import ConfigError
from remat_planner.models import Workload, get_model, known_model_types
from remat_planner.models.trainable import select_trainable


class OptimizerConfig(BaseModel):
    """Optimizer whose state is part of the step's memory footprint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["adamw", "adam", "sgd"] = Field(
        "adamw", description="adamw: decoupled decay; adam/sgd: weight_decay is an L2 term on the gradient."
    )
    learning_rate: float = Field(3e-4, gt=0, description="Step size.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay coefficient (0 disables it).")


class RunConfig(BaseModel):
    """One training setup: which model, its settings, batch shape and optimizer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="Registered model type, e.g. 'gpt2'.")
    model: dict[str, Any] = Field(
        default_factory=dict, description="Model settings, validated against the model type's schema."
    )
    batch_size: int = Field(gt=0, strict=True, description="Sequences per training step.")
    seq_len: int = Field(gt=0, strict=True, description="Tokens per sequence fed to the model.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer settings.")
    seed: int = Field(0, strict=True, description="PRNG seed for params and synthetic batches.")
    mesh: str | dict[str, int] | None = Field(
        None, description="Device mesh for a sharded step, e.g. 'data=4,model=2' or "
                          "{data: 4, model: 2}; the budget is then per device.")
    sharding: Literal["dp", "fsdp", "tp", "fsdp+tp"] | None = Field(
        None, description="Sharding scheme over the mesh: dp, fsdp, tp or fsdp+tp.")
    trainable: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1,
        description="Globs over '/'-joined parameter paths (e.g. 'h_11/*'); only matching "
                    "parameters get gradients and optimizer state. Default: all.",
    )
    cost_model: Literal["flops", "time"] = Field(
        "flops", description="What the planner minimises: recompute FLOPs, or recompute time "
                             "by the roofline model (remat_planner.costmodel).",
    )

    # Where the config came from, so later errors (e.g. in build_workload) can name the file.
    _source: str = PrivateAttr(default="config")

    @field_validator("mesh")
    @classmethod
    def _mesh(cls, value):
        if value is None:
            return value
        from remat_planner.sharding import parse_mesh
        text = value if isinstance(value, str) else ",".join(f"{k}={v}" for k, v in value.items())
        try:
            axes = parse_mesh(text)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return ",".join(f"{a}={n}" for a, n in axes)

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in known_model_types():
            raise PydanticCustomError(
                "unknown_model_type",
                "unknown model type '{value}'; known types: {known}",
                {"value": value, "known": ", ".join(known_model_types())},
            )
        return value


def _known_fields(cls: type[BaseModel], parent: tuple[str | int, ...]) -> list[str]:
    """Field names of the (nested) pydantic model reached by following `parent` from `cls`."""
    for part in parent:
        field = cls.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return list(cls.model_fields)


def _describe(err: ValidationError, source: str, cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> str:
    """Turn a pydantic ValidationError into one line naming file, field and fix."""
    errors = err.errors()
    # An unknown field comes first: a typo (`bach_size`) is the cause of the "missing
    # required field" that comes with it.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(first["loc"])
    dotted = ".".join(str(p) for p in prefix + loc) or "<top level>"
    kind = first["type"]
    hint = ""
    if kind == "extra_forbidden":
        fields = _known_fields(cls, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), fields, n=1) if loc else []
        line = f"{source}: unknown field '{dotted}' (known: {', '.join(fields)})"
        if close:
            hint = f"; did you mean '{close[0]}'?"
    elif kind == "missing":
        line = f"{source}: missing required field '{dotted}'"
        description = _field_description(cls, loc)
        if description:
            line += f" ({description})"
    else:
        # pydantic prefixes messages from our own validators with "Value error, ".
        line = f"{source}: field '{dotted}': {first['msg'].removeprefix('Value error, ')}"
        value = first.get("input")
        if isinstance(value, (bool, int, float, str)) or value is None:
            line += f" (got {value!r})"
    more = err.error_count() - 1
    if more:
        line += f" (and {more} more error{'s' if more > 1 else ''})"
    return " ".join((line + hint).split())


def _field_description(cls: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """Description of the field at `loc`, or "" if it cannot be resolved."""
    if not loc:
        return ""
    fields = _known_fields(cls, loc[:-1])
    if str(loc[-1]) not in fields:
        return ""
    for part in loc[:-1]:
        cls = cls.model_fields[str(part)].annotation  # type: ignore[assignment]
    return cls.model_fields[str(loc[-1])].description or ""


def _validated_settings(cfg: RunConfig) -> BaseModel:
    """Validate `cfg.model` against the registered settings class of `cfg.type`."""
    settings_cls = get_model(cfg.type).config_cls
    try:
        return settings_cls.model_validate(cfg.model)
    except ValidationError as err:
        raise ConfigError(_describe(err, cfg._source, settings_cls, prefix=("model",))) from None


def load_config(
    path: str | os.PathLike[str], *, batch_size: int | None = None, seq_len: int | None = None,
    mesh: str | None = None, sharding: str | None = None,
) -> RunConfig:
    """Load and validate a YAML run config.

    Args:
        path: YAML file.
        batch_size: If given, overrides the file's batch_size (validated like it).
        seq_len: If given, overrides the file's seq_len (validated like it).
        mesh, sharding: If given, override the file's `mesh:` / `sharding:`.

    Returns:
        The validated RunConfig, with `model` normalized to the full settings (defaults filled in).

    Raises:
        ConfigError: One line naming the file, the field and what is wrong.
    """
    source = os.fspath(path)
    file = Path(source)
    if file.is_dir():
        raise ConfigError(f"'{source}' is a directory, not a config file; pass a YAML file "
                          "such as configs/gpt2-tiny.yaml")
    if not file.is_file():
        raise ConfigError(f"no such config file '{source}'")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source}: cannot read config file: not UTF-8 text ({err.reason} at "
                          f"byte {err.start}); save it as UTF-8 YAML") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read config file: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(" ".join(f"{source}: invalid YAML{where}: {problem}".split())) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise ConfigError(f"{source}: expected a mapping at top level, got {got}")
    if batch_size is not None:
        data["batch_size"] = batch_size
    if seq_len is not None:
        data["seq_len"] = seq_len
    if mesh is not None:
        data["mesh"] = mesh
    if sharding is not None:
        data["sharding"] = sharding
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source, RunConfig)) from None
    if (cfg.mesh is None) != (cfg.sharding is None):
        missing = "sharding (--sharding dp|fsdp|tp|fsdp+tp)" if cfg.sharding is None \
            else "mesh (--mesh data=N[,model=M])"
        raise ConfigError(f"{source}: a sharded step needs both a mesh and a sharding scheme; "
                          f"missing the {missing}")
    cfg._source = source
    settings = _validated_settings(cfg)
    normalized = cfg.model_copy(update={"model": settings.model_dump()})
    normalized._source = source
    return normalized


def build_workload(cfg: RunConfig) -> Workload:
    """Build the Workload described by `cfg` (shapes only; no params are allocated).

    With `trainable`, the workload's params are the matching parameters only and the
    frozen ones are its first batch argument (models/trainable.py).

    Raises:
        ConfigError: If the model settings are invalid or inconsistent with batch_size/seq_len.
    """
    settings = _validated_settings(cfg)
    try:
        workload = get_model(cfg.type).builder(settings, cfg.batch_size, cfg.seq_len)
        if cfg.trainable is not None:
            workload = select_trainable(workload, cfg.trainable, cfg.seed)
        return workload
    except ConfigError as err:
        raise ConfigError(f"{cfg._source}: {err}") from None


def sharding_spec(cfg: RunConfig):
    """The config's mesh and scheme as a sharding.ShardingSpec, or None (one device)."""
    if cfg.mesh is None:
        return None
    from remat_planner.sharding import ShardingSpec
    return ShardingSpec.make(cfg.mesh, cfg.sharding)


def make_optimizer(opt: OptimizerConfig) -> optax.GradientTransformation:
    """Build the optax optimizer for `opt`.

    Returns:
        adamw with decoupled weight decay; adam/sgd with weight decay added to the gradient (L2).
    """
    if opt.name == "adamw":
        return optax.adamw(opt.learning_rate, weight_decay=opt.weight_decay)
    base = optax.adam(opt.learning_rate) if opt.name == "adam" else optax.sgd(opt.learning_rate)
    if opt.weight_decay == 0:
        return base
    return optax.chain(optax.add_decayed_weights(opt.weight_decay), base)
