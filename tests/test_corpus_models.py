"""Sanity checks of the user-style model corpus (tests/corpus.py): every model traces, its
remat variants compute the same gradients over the same params pytree, and its small concrete
init gives a finite loss."""

import jax
import numpy as np
import pytest

import corpus

NAMES = sorted(corpus.MODELS)
NOTHING = jax.checkpoint_policies.nothing_saveable
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _shapes(tree):
    return jax.tree.structure(tree), [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]


def _mixed(n):
    return tuple(NOTHING if i % 2 == 0 else None for i in range(n))


@pytest.mark.parametrize("name", NAMES)
def test_model_is_well_formed(name):
    m = corpus.get(name)
    assert corpus.get(name) is m and m.name == name
    assert m.n_blocks > 0
    leaves = jax.tree.leaves(m.params)
    assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) and a.dtype == np.float32
                          for a in leaves)
    assert isinstance(m.batch, tuple)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(m.batch))
    assert m.make_remat_loss((None,) * m.n_blocks) is m.loss_fn
    with pytest.raises(ValueError):
        m.make_remat_loss((None,) * (m.n_blocks + 1))
    jax.eval_shape(m.optimizer.init, m.params)
    jaxpr = jax.make_jaxpr(m.loss_fn)(m.params, *m.batch)
    loss_aval = jaxpr.out_avals[0]
    assert loss_aval.shape == () and loss_aval.dtype == np.float32


@pytest.mark.parametrize("name", NAMES)
def test_remat_variants_keep_the_params_pytree(name):
    m = corpus.get(name)
    variants = [(NOTHING,) * m.n_blocks, (DOTS,) * m.n_blocks]
    if m.supports_mixes:
        variants.append(_mixed(m.n_blocks))
    else:
        with pytest.raises(ValueError):
            m.make_remat_loss(_mixed(m.n_blocks))
    for policies in variants:
        grads = jax.eval_shape(jax.grad(m.make_remat_loss(policies), has_aux=m.has_aux),
                               m.params, *m.batch)
        if m.has_aux:
            grads = grads[0]
        assert _shapes(grads) == _shapes(m.params), policies


@pytest.mark.parametrize("name", NAMES)
def test_remat_gradients_equal_plain_gradients(name):
    m = corpus.get(name)
    params, batch = m.init(jax.random.PRNGKey(1))
    assert _shapes(params) == _shapes(m.params)
    assert _shapes(batch) == _shapes(m.batch)
    remat_loss = m.make_remat_loss((NOTHING,) * m.n_blocks)

    def both(params, *batch):
        plain = jax.value_and_grad(m.loss_fn, has_aux=m.has_aux)(params, *batch)
        remat = jax.value_and_grad(remat_loss, has_aux=m.has_aux)(params, *batch)
        return plain, remat

    # one compile for both; XLA's backend optimizations off: ~35% less compile time on CPU
    compiled = jax.jit(both).lower(params, *batch).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    (value, grads), (remat_value, remat_grads) = compiled(params, *batch)
    loss = value[0] if m.has_aux else value
    assert np.isfinite(float(loss))
    # same loss (dropout models: same key, so the same masks), same aux, same gradients
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 value, remat_value)
    plain_leaves = jax.tree_util.tree_leaves_with_path(grads)
    scale = max(float(np.max(np.abs(g))) for _, g in plain_leaves)  # the largest gradient
    nonzero = sum(bool(np.any(g != 0)) for _, g in plain_leaves)
    assert nonzero >= 0.9 * len(plain_leaves), f"only {nonzero}/{len(plain_leaves)} nonzero grads"
    for (path, g), r in zip(plain_leaves, jax.tree.leaves(remat_grads)):
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        # atol from the largest gradient: some are zero up to rounding (attention key biases)
        np.testing.assert_allclose(r, g, rtol=m.gradient_rtol,
                                   atol=0.1 * m.gradient_rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))
