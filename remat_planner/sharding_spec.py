"""The sharding of a step as data: a mesh shape and a scheme (`ShardingSpec`).

This is the plan data's view of a sharding: what a plan file records and a `Step`
carries. It imports nothing of the package but the errors, so the plan data (plan.py)
and the step (step.py) sit at the base of the pipeline. What a sharding decides (the
per-device bytes, the step's shardings, the pins and gathers) is sharding.py's, which
re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh

from .errors import ConfigError

SCHEMES = ("dp", "fsdp", "tp", "fsdp+tp")
MODEL_AXIS = "model"
_AXIS_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`"data=4,model=2"` -> `(("data", 4), ("model", 2))`; ConfigError on anything else."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"bad mesh {text!r}: expected axis=size pairs such as 'data=4,model=2'")
    axes: list[tuple[str, int]] = []
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not _AXIS_RE.match(name) or not size:
            raise ConfigError(f"bad mesh {text!r}: {part.strip()!r} is not axis=size "
                              "(e.g. 'data=4,model=2')")
        try:
            n = int(size)
        except ValueError:
            raise ConfigError(f"bad mesh {text!r}: size {size!r} of axis {name!r} is not an "
                              "integer") from None
        if n < 1:
            raise ConfigError(f"bad mesh {text!r}: size of axis {name!r} must be positive, "
                              f"got {n}")
        if name in (a for a, _ in axes):
            raise ConfigError(f"bad mesh {text!r}: axis {name!r} appears twice")
        axes.append((name, n))
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """A mesh shape and a scheme; resolved against the devices by `mesh()`."""

    axes: tuple[tuple[str, int], ...]
    scheme: str
    # parameter paths tp leaves replicated although their names make them kernels: the
    # column-parallel kernels no row-parallel one pairs with (unpaired_kernels)
    replicated: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown sharding scheme {self.scheme!r}; known: "
                              f"{', '.join(SCHEMES)}")
        names = [a for a, _ in self.axes]
        if "tp" in self.scheme and MODEL_AXIS not in names:
            raise ConfigError(f"sharding {self.scheme!r} splits tensors over a mesh axis named "
                              f"'{MODEL_AXIS}'; the mesh has {', '.join(names)} "
                              f"(e.g. --mesh data=4,model=2)")
        if self.scheme == "fsdp+tp" and len(names) < 2:
            raise ConfigError("sharding 'fsdp+tp' needs a data axis besides 'model' "
                              "(e.g. --mesh data=4,model=2)")

    @classmethod
    def from_dict(cls, d: dict) -> "ShardingSpec":
        """The inverse of to_dict (a plan file's "sharding")."""
        return dataclasses.replace(cls.make(d["mesh"], d["scheme"]),
                                   replicated=tuple(d.get("replicated", ())))

    @classmethod
    def make(cls, mesh, scheme: str) -> "ShardingSpec":
        """From a mesh string ("data=4,model=2"), a mapping {axis: size} or a jax Mesh."""
        if isinstance(mesh, Mesh):
            axes = tuple((str(a), int(s)) for a, s in mesh.shape.items())
        elif isinstance(mesh, dict):
            axes = parse_mesh(",".join(f"{k}={v}" for k, v in mesh.items()))
        else:
            axes = parse_mesh(mesh)
        return cls(axes, str(scheme))

    @property
    def n_devices(self) -> int:
        return math.prod(s for _, s in self.axes)

    @property
    def model_axis(self) -> str | None:
        return MODEL_AXIS if "tp" in self.scheme else None

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Axes the batch is split over: all of them but the tensor-parallel one."""
        return tuple(a for a, _ in self.axes if a != self.model_axis)

    @property
    def data_size(self) -> int:
        return math.prod(s for a, s in self.axes if a in self.data_axes)

    @property
    def model_size(self) -> int:
        return dict(self.axes).get(self.model_axis, 1) if self.model_axis else 1

    @property
    def label(self) -> str:
        return f"{self.scheme} on {','.join(f'{a}={s}' for a, s in self.axes)}"

    def mesh(self) -> Mesh:
        devices = jax.devices()
        if self.n_devices != len(devices):
            raise ConfigError(
                f"mesh {','.join(f'{a}={s}' for a, s in self.axes)} needs {self.n_devices} "
                f"devices but JAX sees {len(devices)} ({devices[0].platform}); on CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={self.n_devices} "
                "before starting")
        return Mesh(np.asarray(devices).reshape([s for _, s in self.axes]),
                    tuple(a for a, _ in self.axes))

    def to_dict(self) -> dict:
        d = {"mesh": ",".join(f"{a}={s}" for a, s in self.axes), "scheme": self.scheme}
        if self.replicated:
            d["replicated"] = list(self.replicated)
        return d


def resolve(mesh, sharding) -> ShardingSpec | None:
    """The API's `mesh=` / `sharding=` arguments as a ShardingSpec (None: unsharded)."""
    if isinstance(sharding, ShardingSpec):
        return sharding
    if mesh is None and sharding is None:
        return None
    if mesh is None or sharding is None:
        raise ConfigError("give both a mesh and a sharding scheme (e.g. mesh='data=8', "
                          "sharding='fsdp'), or neither")
    return ShardingSpec.make(mesh, sharding)
