"""The abstract workload of a linen image classifier, for tests that write their own model
(tests/test_units.py, tests/test_shared_inputs.py): a batch of 4 images of 32 x 32 x 3,
10 classes, softmax cross-entropy. Nothing is allocated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def workload(model_cls, policy=None):
    """(loss_fn, abstract params, abstract batch) of `model_cls(policy=policy)`; the
    params are those of `model_cls()`, the same pytree for every policy."""
    model = model_cls(policy=policy)
    x = jax.ShapeDtypeStruct((4, 32, 32, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((4,), jnp.int32)
    params = jax.eval_shape(lambda k: model_cls().init(k, jnp.zeros(x.shape))["params"],
                            jax.random.PRNGKey(0))

    def loss_fn(p, images, labels):
        logits = model.apply({"params": p}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn, params, (x, y)
