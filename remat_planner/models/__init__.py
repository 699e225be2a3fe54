"""Model registry: maps a config `type` to its settings schema and a Workload builder."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
from pydantic import BaseModel

from remat_planner.errors import ConfigError

SettingsT = TypeVar("SettingsT", bound=BaseModel)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Everything the planner needs to trace, and optionally run, one training step.

    Attributes:
        name: Short human-readable name, e.g. "gpt2-12l-768d".
        loss_fn: `loss_fn(params, *batch)` returning a scalar loss.
        abstract_params: Pytree of jax.ShapeDtypeStruct (from jax.eval_shape; nothing allocated).
        abstract_batch: Tuple of jax.ShapeDtypeStruct, one per positional batch argument.
        init_params: Builds real params from a PRNG key.
        synthetic_batch: Builds a real random batch from a PRNG key.
        param_count: Total number of parameter scalars.
        info: Printable facts (model type, dtype, batch size, seq len, layers, ...).
        has_aux: `loss_fn` returns `(loss, aux)`, e.g. BatchNorm's updated batch stats;
            gradients are taken of the loss only.
        update_batch: `(batch, aux) -> batch` for the next step (state carried in the
            batch, such as batch stats), or None when the batch does not depend on aux.
    """

    name: str
    loss_fn: Callable[..., jax.Array]
    abstract_params: Any
    abstract_batch: tuple[jax.ShapeDtypeStruct, ...]
    init_params: Callable[[jax.Array], Any]
    synthetic_batch: Callable[[jax.Array], tuple[jax.Array, ...]]
    param_count: int
    info: dict[str, Any]
    has_aux: bool = False
    update_batch: Callable[[tuple, Any], tuple] | None = None


Builder = Callable[[Any, int, int], Workload]


@dataclasses.dataclass(frozen=True)
class RegisteredModel(Generic[SettingsT]):
    """A registry entry: the settings schema for `model:` and the builder using it."""

    type_name: str
    config_cls: type[SettingsT]
    builder: Callable[[SettingsT, int, int], Workload]


_REGISTRY: dict[str, RegisteredModel[Any]] = {}


def register_model(
    type_name: str, *, config_cls: type[SettingsT]
) -> Callable[[Callable[[SettingsT, int, int], Workload]], Callable[[SettingsT, int, int], Workload]]:
    """Register `fn(settings, batch_size, seq_len) -> Workload` under `type_name`.

    Args:
        type_name: Value of the config's `type` field that selects this model.
        config_cls: Pydantic model validating the config's `model` mapping.

    Returns:
        A decorator that registers the builder and returns it unchanged.
    """

    def decorator(fn: Callable[[SettingsT, int, int], Workload]) -> Callable[[SettingsT, int, int], Workload]:
        if type_name in _REGISTRY:
            raise ValueError(f"model type '{type_name}' is already registered")
        _REGISTRY[type_name] = RegisteredModel(type_name, config_cls, fn)
        return fn

    return decorator


def known_model_types() -> list[str]:
    """Return the registered model type names, sorted."""
    return sorted(_REGISTRY)


def get_model(type_name: str) -> RegisteredModel[Any]:
    """Look up a registry entry.

    Raises:
        ConfigError: If `type_name` is not registered.
    """
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise ConfigError(
            f"unknown model type '{type_name}'; known types: {', '.join(known_model_types())}"
        ) from None


def get_builder(type_name: str) -> Builder:
    """Return the Workload builder registered under `type_name`.

    Raises:
        ConfigError: If `type_name` is not registered.
    """
    return get_model(type_name).builder


# Imported last: the module registers itself through register_model defined above.
from remat_planner.models import gpt2_workload  # noqa: E402,F401
from remat_planner.models import resnet  # noqa: E402,F401
from remat_planner.models import unet  # noqa: E402,F401
from remat_planner.models import nnx_gpt  # noqa: E402,F401
from remat_planner.models import bert, llama, vit  # noqa: E402,F401
