"""The training step a plan is for, as one value: the loss, the optimizer, whether the
loss returns aux, and the sharding.

Every stage that compiles, replays or measures a step takes a `Step` instead of the same
four or five arguments (loss_fn, optimizer, has_aux, mesh, sharding). The public entry
points (`rp.plan`, `rp.analyze`, `rp.measure`, `rp.train_step`, the CLI) keep their
arguments and build one (`Step.make`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .sharding_spec import ShardingSpec, resolve


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step: `loss_fn(params, *batch)`, and its update.

    loss_fn: returns a scalar loss, or `(loss, aux)` with `has_aux`.
    optimizer: an optax GradientTransformation; None: the step is jax.grad(loss_fn).
    has_aux: loss_fn returns `(loss, aux)`; the step returns aux last.
    sharding: a `sharding.ShardingSpec` (the SPMD step on its mesh, every figure one
      device's), or None for a single-device step.
    """

    loss_fn: Callable
    optimizer: Any = None
    has_aux: bool = False
    sharding: ShardingSpec | None = None

    def __post_init__(self):
        object.__setattr__(self, "has_aux", bool(self.has_aux))
        if self.sharding is not None and not isinstance(self.sharding, ShardingSpec):
            raise TypeError(f"Step.sharding is a ShardingSpec or None, not "
                            f"{type(self.sharding).__name__}")

    @classmethod
    def make(cls, loss_fn: Callable, optimizer=None, has_aux: bool = False, mesh=None,
             sharding=None) -> "Step":
        """From the public API's arguments: `mesh=` / `sharding=` as sharding.resolve
        takes them (both or neither, or a ShardingSpec as `sharding`)."""
        return cls(loss_fn, optimizer, has_aux, resolve(mesh, sharding))

    def replace(self, **changes) -> "Step":
        return dataclasses.replace(self, **changes)

    def with_loss(self, loss_fn: Callable) -> "Step":
        """The same step of another loss (a planned one, a built-in policy's)."""
        return dataclasses.replace(self, loss_fn=loss_fn)

    def planned(self, plan) -> "Step":
        """The step with `plan` applied to its loss (`plan.apply(loss_fn, has_aux)`)."""
        return self.with_loss(plan.apply(self.loss_fn, self.has_aux))
