"""Fine-tuning: train only the parameters whose paths match glob patterns.

The frozen parameters move out of the params pytree into the first batch argument:
`loss(trainable, frozen, *batch)`. Everything downstream (trace, fixed memory, the
optimizer, the planned step) then sees only the trainable tree as params, so frozen
parameters get no gradients and no optimizer state, while their bytes still count, as
batch bytes that are live for the whole step.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Sequence
from typing import Any

import jax
from flax import traverse_util

from remat_planner.errors import ConfigError
from remat_planner.models import Workload


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_paths(params: Any) -> list[tuple[str, ...]]:
    """Path of every leaf of `params`, in leaf order, as a tuple of names."""
    return [tuple(_key_name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def trainable_mask(params: Any, patterns: Sequence[str]) -> list[bool]:
    """Per leaf of `params`: does its '/'-joined path match any glob in `patterns`?

    Raises:
        ConfigError: If a pattern matches no parameter (naming it and a few real paths).
    """
    names = ["/".join(p) for p in param_paths(params)]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            examples = ", ".join(names[:3] + (["...", names[-1]] if len(names) > 3 else []))
            raise ConfigError(
                f"field 'trainable': pattern {pattern!r} matches no parameter; "
                f"parameter paths look like: {examples}"
            )
    return [any(fnmatch.fnmatchcase(n, p) for p in patterns) for n in names]


def _split(params: Any, paths: list[tuple[str, ...]], mask: list[bool]) -> tuple[dict, dict]:
    """(trainable, frozen) nested dicts holding the leaves of `params` by path."""
    trainable, frozen = {}, {}
    for path, keep, leaf in zip(paths, mask, jax.tree.leaves(params)):
        (trainable if keep else frozen)[path] = leaf
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def select_trainable(workload: Workload, patterns: Sequence[str], seed: int) -> Workload:
    """The same step with only the parameters matching `patterns` trained.

    Args:
        workload: The full workload, `loss_fn(params, *batch)`.
        patterns: fnmatch globs over '/'-joined parameter paths, e.g. "h_3/*", "*/ln_f/*".
        seed: PRNG seed of the frozen ("pretrained") parameters carried in the batch, the
            same key `remat-plan train` initialises params with.

    Returns:
        A Workload with `loss_fn(trainable, frozen, *batch)`; `init_params` builds the
        trainable part and `synthetic_batch` prepends the frozen part. Unchanged if every
        parameter matches.

    Raises:
        ConfigError: If a pattern matches no parameter.
    """
    abstract = workload.abstract_params
    paths = param_paths(abstract)
    mask = trainable_mask(abstract, patterns)
    if all(mask):
        return workload
    treedef = jax.tree.structure(abstract)

    def loss_fn(trainable, frozen, *batch):
        flat = {**traverse_util.flatten_dict(trainable), **traverse_util.flatten_dict(frozen)}
        return workload.loss_fn(jax.tree.unflatten(treedef, [flat[p] for p in paths]), *batch)

    def init_params(key: jax.Array) -> dict:
        return _split(workload.init_params(key), paths, mask)[0]

    @functools.cache
    def frozen_params() -> dict:
        return _split(workload.init_params(jax.random.key(seed)), paths, mask)[1]

    def synthetic_batch(key: jax.Array) -> tuple:
        return (frozen_params(), *workload.synthetic_batch(key))

    def update_batch(batch: tuple, aux: Any) -> tuple:
        return (batch[0], *workload.update_batch(batch[1:], aux))

    trainable_abstract, frozen_abstract = _split(abstract, paths, mask)
    trainable_count = sum(leaf.size for leaf in jax.tree.leaves(trainable_abstract))
    return dataclasses.replace(
        workload,
        loss_fn=loss_fn,
        abstract_params=trainable_abstract,
        abstract_batch=(frozen_abstract, *workload.abstract_batch),
        init_params=init_params,
        synthetic_batch=synthetic_batch,
        update_batch=None if workload.update_batch is None else update_batch,
        info={**workload.info, "trainable_params": trainable_count},
    )
