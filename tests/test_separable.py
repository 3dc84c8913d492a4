"""The separability analysis (`hifigrad._src.separable`): which programs compute each row along
the batch axis from that row alone, read from their jaxprs, and the check that a program traced
at a slice of the batch is the one analysed. The backward that uses it is tested in
`test_checkpoint.py` (sliced gradients against unsliced ones and against `jax.grad`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from platforms import highest_precision

import hifigrad as hg
from hifigrad._src.separable import Axes, NotSeparable, batch_axes, same_program

B = 8


def _axes(fn, *args, in_axes):
    return batch_axes(jax.make_jaxpr(fn)(*args).jaxpr, in_axes, B)


x3 = jnp.ones((B, 4, 6))
w = jnp.ones((6, 6))

SEPARABLE = {
    "elementwise and broadcast parameter": (lambda x, w: jnp.tanh(x * w[0][None, None]) + 1.0, [0]),
    "matmul with a parameter": (lambda x, w: x @ w, [0]),
    "per-row attention scores": (lambda x, w: jnp.einsum("bqd,bkd->bqk", x, x), [0]),
    "softmax over the last axis": (lambda x, w: jax.nn.softmax(x, -1), [0]),
    "causal mask from iota": (lambda x, w: jnp.where(jnp.tril(jnp.ones((4, 4), bool)),
                                                     x @ x.transpose(0, 2, 1), 0.0), [0]),
    "merge batch with tokens and back": (lambda x, w: (x.reshape(B * 4, 6) @ w)
                                         .reshape(B, 4, 6), [0]),
    "transpose moves the batch axis": (lambda x, w: jnp.swapaxes(x, 0, 1), [1]),
    "reduce over tokens": (lambda x, w: jnp.sum(x, axis=1), [0]),
    "cumsum over tokens": (lambda x, w: jnp.cumsum(x, axis=1), [0]),
    "split over features": (lambda x, w: jnp.split(x, 2, axis=-1)[1], [0]),
}

MIXING = {
    "mean over the batch": lambda x, w: x - jnp.mean(x, axis=0, keepdims=True),
    "matmul contracting the batch": lambda x, w: jnp.einsum("bij,bik->jk", x, x),
    "row position": lambda x, w: x * lax.broadcasted_iota(jnp.float32, x.shape, 0),
    "cumsum over the batch": lambda x, w: jnp.cumsum(x, axis=0),
    "slice of the batch": lambda x, w: x[1:],
    "reshape splits the batch": lambda x, w: x.reshape(2, B // 2, 4, 6),
    "gather along the batch": lambda x, w: x[jnp.array([1, 0])],
    "outer product of two rows": lambda x, w: jnp.einsum("bij,cik->bcjk", x, x),
}


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_separable_programs(name):
    fn, want = SEPARABLE[name]
    assert _axes(fn, x3, w, in_axes=[0, None]) == want


@pytest.mark.parametrize("name", list(MIXING))
def test_programs_that_mix_rows_are_not_separable(name):
    with pytest.raises(NotSeparable):
        _axes(MIXING[name], x3, w, in_axes=[0, None])


def test_a_parameter_that_varies_along_the_batch_is_not_separable():
    """An unbatched input with a batch-sized axis (say, per-example weights not in the carry)
    meeting a batched value: slicing would pair rows with the wrong weights."""
    with pytest.raises(NotSeparable):
        _axes(lambda x, v: x * v, x3, x3, in_axes=[0, None])


def _same(f, x, k, g=None):
    """`same_program` of `f` traced at `x` (batch axis 0, analysed) and `g` (default `f`) at
    its first 1/k rows, constants compared by value."""
    full = jax.make_jaxpr(f)(x)
    axes = Axes()
    batch_axes(full.jaxpr, [0], x.shape[0], record=axes)
    sliced = jax.make_jaxpr(g or f)(x[: x.shape[0] // k])
    return same_program(full.jaxpr, sliced.jaxpr, k, axes, full.consts, sliced.consts)


def test_same_program_up_to_the_batch_size():
    f = lambda x: jnp.tanh(x @ w).reshape(x.shape[0] * 4, 6)  # noqa: E731
    assert _same(f, x3, 4)
    g = lambda x: jnp.tanh(x @ w) if x.shape[0] == B else jnp.sin(x @ w)  # noqa: E731
    assert not _same(f, x3, 4, g)


def test_block_that_branches_on_the_batch_size_is_not_sliced(maybe_jit):
    """The full-batch program never mixes rows, but the program traced at a quarter of the
    batch does (a Python branch on the batch size): the programs differ, so the backward runs
    at once and the gradients are plain `jax.grad`'s (float32, rtol 1e-5). Sliced, the
    parameter gradient would be that of the row-centred block."""
    rng = np.random.default_rng(0)
    wb = jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32)
    xb = jnp.asarray(rng.normal(size=(2048, 32)), jnp.float32)

    def block(x, w):
        if x.shape[0] < 2048:
            x = x - jnp.mean(x, axis=0, keepdims=True)
        return jnp.tanh(x @ w)

    f = hg.checkpoint(block, codec="none", backward_slices=4)
    loss = lambda w, x: jnp.mean(f(x, w) ** 2)  # noqa: E731
    assert "scan[" not in str(jax.make_jaxpr(jax.grad(loss))(wb, xb))
    with highest_precision():
        g = maybe_jit(jax.grad(loss))(wb, xb)
        want = jax.grad(lambda w, x: jnp.mean(block(x, w) ** 2))(wb, xb)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6 * np.max(np.abs(want)))


def _two_relus():
    """Two custom_jvp functions with the same primal and different JVP rules."""
    @jax.custom_jvp
    def relu_a(x):
        return jnp.maximum(x, 0.0)

    @relu_a.defjvp
    def _a(primals, tangents):
        (x,), (t,) = primals, tangents
        return relu_a(x), jnp.where(x > 0, t, jnp.zeros_like(t))

    @jax.custom_jvp
    def relu_b(x):
        return jnp.maximum(x, 0.0)

    @relu_b.defjvp
    def _b(primals, tangents):
        (x,), (t,) = primals, tangents
        return relu_b(x), jnp.where(x >= 0, t, jnp.zeros_like(t))

    return relu_a, relu_b


def test_same_program_sees_one_custom_rule_traced_twice():
    """JAX holds a custom_jvp's JVP as an object made afresh in every trace: the same rule
    traced at two batch sizes is the same program (so a ReLU block's backward may run in
    slices); two rules with the same primal are not."""
    relu_a, relu_b = _two_relus()

    x = jnp.ones((8, 4))
    assert _same(lambda x: jax.nn.relu(x) * 2, x, 4)
    assert _same(lambda x: relu_a(x) * 2, x, 4)
    assert not _same(lambda x: relu_a(x) * 2, x, 4, lambda x: relu_b(x) * 2)
