"""A block's program evaluated at a slice of its batch (`hifigrad._src.resize`): the full
evaluation's rows, the same program as the block traced at that size where the block is
batch-polymorphic, and an error (never a wrong value) where the typing or a shape does not
allow it. The sliced backward built on it is tested in `test_checkpoint.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint import _attn_block, _attn_params  # a pre-LN transformer block

from hifigrad._src import resize, separable

B = 8


def _typed(fn, *args, in_types):
    closed = jax.make_jaxpr(fn)(*args)
    return separable.analyse(closed.jaxpr, in_types, B, consts=closed.consts)


def _rows(x, k, i=0):
    """Slice i of `k`: the batch rows i, i + k, ... (as `checkpoint._split` takes them)."""
    return x[i::k]


def test_a_traced_block_evaluates_at_a_slice_of_its_batch():
    """The block (a jaxpr traced at the full batch) evaluated at a quarter of the batch is
    the full evaluation's rows (to float32 rounding: XLA may block a matmul of 2 rows
    differently from one of 8; 64 eps of the largest entry); and it is the same program as
    the block traced at that size (the block is batch-polymorphic)."""
    block = _attn_block(2)
    p = jax.tree_util.tree_map(lambda a: a[0], _attn_params(1, 32, jnp.float32))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, 16, 32)), jnp.float32)
    leaves = jax.tree_util.tree_leaves(p)
    fn = lambda x, *l: block(x, jax.tree_util.tree_unflatten(  # noqa: E731
        jax.tree_util.tree_structure(p), l))[0]
    typing = _typed(fn, x, *leaves, in_types=[0] + [None] * len(leaves))
    assert typing.out_types == [0]
    full = np.asarray(resize.eval_at(typing, [x, *leaves], 1)[0])
    for i in range(4):
        part = resize.eval_at(typing, [_rows(x, 4, i), *leaves], 4)[0]
        np.testing.assert_allclose(np.asarray(part), _rows(full, 4, i), rtol=0,
                                   atol=64 * np.finfo(np.float32).eps * np.abs(full).max())
    sliced = jax.make_jaxpr(lambda *a: resize.eval_at(typing, a, 4))(_rows(x, 4), *leaves)
    direct = jax.make_jaxpr(fn)(_rows(x, 4), *leaves)
    assert separable.same_program(typing.jaxpr, sliced.jaxpr, 4, typing, typing.consts,
                                  sliced.consts)
    assert separable.same_program(direct.jaxpr, sliced.jaxpr, 1, None, direct.consts,
                                  sliced.consts)


def test_a_block_that_bakes_the_batch_in_is_resized():
    """Shapes written as Python ints for the full batch (``reshape(8, 4, 2, 3)``, a
    ``zeros((8, 4, 6))``) are resized with the block: its program is re-bound, not its
    Python re-run."""
    def fn(x):
        h = (x + jnp.zeros((8, 4, 6))).reshape(8, 4, 2, 3)
        return jnp.tanh(h).sum(-1).reshape(8, 8)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, 4, 6)), jnp.float32)
    typing = _typed(fn, x, in_types=[0])
    assert typing.out_types == [0]
    full = np.asarray(fn(x))
    for i in range(2):
        np.testing.assert_array_equal(resize.eval_at(typing, [_rows(x, 2, i)], 2)[0],
                                      _rows(full, 2, i))


def test_a_merged_output_is_resized_along_its_rows():
    """An output whose leading axis merges the batch with tokens (``[B*T, D]``) is batched
    with 4 positions per row: the slice's value is its rows' blocks, in order."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, 4, 6)), jnp.float32)
    fn = lambda x: jnp.tanh(x).reshape(-1, 6)  # noqa: E731
    typing = _typed(fn, x, in_types=[0])
    assert typing.out_types == [0]
    full = np.asarray(fn(x)).reshape(B, 4, 6)
    part = resize.eval_at(typing, [_rows(x, 4, 1)], 4)[0]
    np.testing.assert_array_equal(part, _rows(full, 4, 1).reshape(-1, 6))


def test_a_wrong_input_shape_is_an_error():
    x = jnp.ones((B, 4))
    typing = _typed(lambda x: x * 2, x, in_types=[0])
    with pytest.raises(resize.Unresizable, match="an input of shape"):
        resize.eval_at(typing, [jnp.ones((3, 4))], 4)


@jax.custom_vjp
def _global_clip(x):
    return x


_global_clip.defvjp(lambda x: (x, None), lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2)),))


@jax.custom_jvp
def _global_jvp(x):
    return x * 2


@_global_jvp.defjvp
def _global_jvp_rule(p, t):
    (x,), (tx,) = p, t
    return _global_jvp(x), tx * jnp.mean(x ** 2)


@pytest.mark.parametrize("fn, match", [
    (lambda x: _global_clip(x) * 2,
     "custom_vjp's backward rule: sqrt.*nonlinear function of a sum"),
    (lambda x: _global_jvp(x) * 2, "custom_jvp rule: reduce_sum.*reduces over the batch axis"),
])
def test_a_custom_rule_that_mixes_rows_is_not_resized(fn, match):
    """A custom rule is analysed on its own program (its primal being row-wise says nothing
    of it): one that normalises by a statistic over the whole batch raises `Unresizable`."""
    x = jnp.ones((B, 4))
    typing = _typed(fn, x, in_types=[0])
    assert typing.out_types == [0]  # the primal program is row-wise

    def grad_at_slice(x):
        return jax.grad(lambda x: jnp.sum(resize.eval_at(typing, [x], 4)[0]))(x)

    with pytest.raises(resize.Unresizable, match=match):
        jax.eval_shape(grad_at_slice, jnp.ones((2, 4)))
