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


def test_a_batch_sized_operand_broadcast_by_its_size_1_axes_is_seen():
    """JAX's elementwise ops broadcast size-1 axes (``mul f32[B,1,1] f32[1,4,6]``, as NNX's
    LayerNorm and attention mask emit): an unbatched per-row value reaching the batch that
    way varies along it, however the shapes differ."""
    v = jnp.arange(B, dtype=jnp.float32).reshape(B, 1, 1)

    def f(x, v):
        return x * lax.mul(v, lax.broadcasted_iota(jnp.float32, (1, 4, 6), 2))

    assert "mul" in str(jax.make_jaxpr(f)(x3, v))
    with pytest.raises(NotSeparable):
        _axes(f, x3, v, in_axes=[0, None])
    # the same shapes with a value constant along the batch (from an iota) are separable
    assert _axes(lambda x, v: x * lax.mul(jnp.ones_like(v), v[:1] * 0 + 1), x3, v,
                 in_axes=[0, None]) == [0]


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


# ------------------------------------------------- issue 32: never a silently wrong gradient
# Each class below once gave a wrong gradient when the backward ran in slices. Every block is
# float32 and run with codec "none", so the reference is plain `jax.grad` of the block
# (float32 against float32, the row sums of the parameter cotangents reassociated: rtol 1e-5).

RB, RT, RD = 16, 128, 24  # 2048 rows: 4 slices of 512 (at least 256 each)


@jax.custom_jvp
def _jvp_global(x):
    return x * 2


@_jvp_global.defjvp
def _jvp_global_rule(p, t):
    (x,), (tx,) = p, t
    return _jvp_global(x), tx * jnp.mean(x ** 2)


@jax.custom_vjp
def _clip_global(x):
    return x


_clip_global.defvjp(lambda x: (x, None),
                    lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2)),))


@jax.custom_jvp
def _jvp_rowwise(x):
    return x * 2


@_jvp_rowwise.defjvp
def _jvp_rowwise_rule(p, t):
    (x,), (tx,) = p, t
    return _jvp_rowwise(x), tx * jnp.mean(x ** 2, axis=-1, keepdims=True)


@jax.custom_vjp
def _clip_rowwise(x):
    return x


_clip_rowwise.defvjp(lambda x: (x, None),
                     lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2, -1, keepdims=True) + 1.0),))


def _blocks():
    rng = np.random.default_rng(7)
    proj = rng.normal(size=(RD, RD)).astype(np.float32)
    return {
        "custom_jvp with a statistic over the whole tensor":
            (lambda w, x: _jvp_global(jnp.tanh(x @ w)), False),
        "custom_vjp normalising by the global norm":
            (lambda w, x: _clip_global(jnp.tanh(x @ w)), False),
        "k-fold integer off the batch axis":
            (lambda w, x: jnp.tanh(x[:, :4 * x.shape[0]] @ w).sum(1, keepdims=True) + x, False),
        "NumPy constant from the batch size":
            (lambda w, x: jnp.tanh(x @ w) * np.full((1, 1, RD), 8.0 / x.shape[0], np.float32),
             False),
        # A fresh matrix at every trace (one drawn per trace, as np.random would):
        "constant drawn at trace time":
            (lambda w, x: jnp.tanh(x @ (w @ (proj * (1 + x.shape[0] / RB)))), False),
        "custom_jvp per row": (lambda w, x: _jvp_rowwise(jnp.tanh(x @ w)), True),
        "custom_vjp per row": (lambda w, x: _clip_rowwise(jnp.tanh(x @ w)), True),
    }


@pytest.mark.parametrize("wrapper", ["checkpoint", "scan", "compress_checkpoints"])
@pytest.mark.parametrize("name", list(_blocks()))
def test_sliced_backward_is_never_wrong(name, wrapper, maybe_jit):
    """Blocks whose backward mixes rows (through a custom rule, a batch-size-dependent
    constant or length, a trace-time constant) run their backward at once; the ones that do
    not still run in slices. Either way the gradients are plain `jax.grad`'s."""
    block, separable_ = _blocks()[name]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(RD, RD)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(RB, RT, RD)), jnp.float32)
    ws = jnp.stack([w, w * 0.5])

    if wrapper == "checkpoint":
        f = hg.checkpoint(block, codec="none", backward_slices=4)
        loss = lambda w, x: jnp.sum(f(w[0], x) ** 2)  # noqa: E731
    elif wrapper == "scan":
        loss = lambda w, x: jnp.sum(hg.scan(  # noqa: E731
            lambda c, wi: (block(wi, c), None), x, w, codec="none", backward_slices=4)[0] ** 2)
    else:
        def plain(w, x):
            body = jax.checkpoint(lambda c, wi: (block(wi, c), None))
            return jnp.sum(lax.scan(body, x, w)[0] ** 2)
        loss = hg.compress_checkpoints(plain, "none", backward_slices=4)

    def ref(w, x):
        return jnp.sum(lax.scan(lambda c, wi: (block(wi, c), None),
                                x, w[:1] if wrapper == "checkpoint" else w)[0] ** 2)

    if wrapper == "compress_checkpoints":
        # The block is the jaxpr traced once at the full batch, resized: the batch size's
        # values are baked in at that size, and its slices are right; a custom_jvp rule is
        # resized as the block is (and mixes rows or not as its program does); a custom_vjp
        # function is not resized, so its backward runs at once.
        separable_ = separable_ or "custom" not in name
        separable_ = separable_ and "custom_vjp" not in name
    report = hg.slice_report(jax.grad(loss), ws, x)
    assert report and all(r.startswith("sliced") == separable_ for r in report), report
    with highest_precision():
        g = maybe_jit(jax.grad(loss, argnums=(0, 1)))(ws, x)
        want = jax.grad(ref, argnums=(0, 1))(ws, x)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.max(np.abs(b)))


def test_save_residuals_forward_is_the_functions_own():
    """With ``save="residuals"`` the forward's value is `fun`'s (bitwise, bf16, eager), not
    the linearized program's primal, whose bf16 roundings may differ."""
    blk = lambda c, w: (jnp.tanh(c @ w) * jax.nn.softmax(c, -1), None)  # noqa: E731
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(8, 64, 16)), jnp.bfloat16)
    ws = jnp.asarray(rng.normal(size=(2, 16, 16)) / 4, jnp.bfloat16)
    loss = lambda w, x: jnp.sum(hg.scan(blk, x, w, codec="none", save="residuals")[0]  # noqa
                                .astype(jnp.float32) ** 2)
    v, _ = jax.value_and_grad(loss)(ws, x)
    assert float(v) == float(loss(ws, x))


# Row-wise and row-mixing operations for random blocks (x: [RB, RT, RD], w: [RD, RD]).
_ROWWISE = {
    "tanh matmul": lambda w, x: jnp.tanh(x @ w),
    "layernorm": lambda w, x: (x - x.mean(-1, keepdims=True)) * lax.rsqrt(
        x.var(-1, keepdims=True) + 1e-5),
    "softmax over tokens": lambda w, x: jax.nn.softmax(x, 1),
    "cumsum over tokens": lambda w, x: jnp.cumsum(x, 1) / RT,
    "merge batch and tokens": lambda w, x: (x.reshape(-1, RD) @ w).reshape(x.shape),
    "custom_vjp per row": lambda w, x: _clip_rowwise(x),
    "custom_jvp per row": lambda w, x: _jvp_rowwise(x) * 0.5,
}
_MIXING = {
    "batch mean": lambda w, x: x - x.mean(0, keepdims=True),
    "custom_vjp global norm": lambda w, x: _clip_global(x),
    "custom_jvp global statistic": lambda w, x: _jvp_global(x) * 0.5,
    "roll along the batch": lambda w, x: x + 0.5 * jnp.roll(x, 1, axis=0),
    "batch-size scale": lambda w, x: x * (x.shape[0] / RB),
}


def _random_block(names):
    ops = [{**_ROWWISE, **_MIXING}[n] for n in names]

    def block(w, x):
        for op in ops:
            x = op(w, x)
        return x
    return block


def test_random_blocks_sliced_equal_unsliced():
    """Property: on random blocks that mix row-wise and row-mixing operations, the sliced
    backward (asked for 4 slices) gives `jax.grad`'s gradients (float32, norm-wise relative
    error below 1e-4: float32 cancellations in a mean reach 1e-5), and it
    slices every block made of row-wise operations only."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    names = st.lists(st.sampled_from(sorted({**_ROWWISE, **_MIXING})), min_size=1, max_size=4)

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(names)
    def check(ops):
        block = _random_block(ops)
        rng = np.random.default_rng(len(ops))
        w = jnp.asarray(rng.normal(size=(RD, RD)) / 4, jnp.float32)
        x = jnp.asarray(rng.normal(size=(RB, RT, RD)), jnp.float32)
        f = hg.checkpoint(block, codec="none", backward_slices=4)
        loss = lambda w, x: jnp.sum(jnp.sin(f(w, x)))  # noqa: E731
        report = hg.slice_report(jax.grad(loss), w, x)
        if all(n in _ROWWISE for n in ops):
            assert report == ["sliced: 4 slices of 4 rows"], (ops, report)
        with highest_precision():
            g = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)
            want = jax.grad(lambda w, x: jnp.sum(jnp.sin(block(w, x))), argnums=(0, 1))(w, x)
        # Norm-wise: elementwise, LayerNorm's backward cancels to a few float32 ulps of its
        # largest terms, which jit and eager round differently (1e-5 measured); a wrong
        # slicing is off by 1e-2 or more (the classes above).
        for a, b in zip(g, want):
            err = np.linalg.norm(np.asarray(a) - b) / max(np.linalg.norm(b), 1e-30)
            assert err < 1e-4, (ops, report, err)

    check()


def test_outputs_independent_of_the_batch_take_their_cotangent_once(maybe_jit):
    """A block that also returns values computed from its parameters alone (NNX's remat
    passes the module's state through) slices; such an output's cotangent enters the
    backward once (in slice 0), so the parameters' gradients are `jax.grad`'s (float32
    against float32, sums reassociated: rtol 1e-5)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(RD, RD)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(RB, RT, RD)), jnp.float32)

    def block(w, x):
        return jnp.tanh(x @ w), w, jnp.sin(w) * 2

    def loss_of(f):
        def loss(w, x):
            y, w1, w2 = f(w, x)
            return jnp.sum(y ** 2) + jnp.sum(w1 ** 3) + jnp.sum(jnp.cos(w2))
        return loss

    f = hg.checkpoint(block, codec="none", backward_slices=4)
    assert hg.slice_report(jax.grad(loss_of(f)), w, x) == ["sliced: 4 slices of 4 rows"]
    with highest_precision():
        got = maybe_jit(jax.grad(loss_of(f), argnums=(0, 1)))(w, x)
        want = jax.grad(loss_of(block), argnums=(0, 1))(w, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.max(np.abs(b)))
