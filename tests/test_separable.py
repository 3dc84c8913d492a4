"""The batch-slicing analysis (`hifigrad._src.separable`): which values of a program are
computed row by row along the batch axis, read from its jaxpr; values made at the batch's
shape that meet the batch are batched, and mix rows where they are reduced across it; the
backward's sums over the batch; and the check that a program traced at a slice of the batch is
the one analysed. The sliced backward that uses it is tested end to end here (every class of
wrong gradient found so far, and a fuzzer of random blocks) and in `test_checkpoint.py`."""

import os

import fuzz_blocks as fb
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from lanes import RELEASE_SEED, turn
from platforms import cpu_only, highest_precision

import hifigrad as hg
from hifigrad._src.separable import (
    SUM,
    Mix,
    NotSeparable,
    analyse,
    batch_axes,
    check_backward,
    same_program,
)

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
    "merged output": (lambda x, w: jnp.tanh(x @ w).reshape(-1, 6), [0]),
    "batch rows split in two": (lambda x, w: x.reshape(2 * B, 2, 6), [0]),
    "transpose moves the batch axis": (lambda x, w: jnp.swapaxes(x, 0, 1), [1]),
    "reduce over tokens": (lambda x, w: jnp.sum(x, axis=1), [0]),
    "cumsum over tokens": (lambda x, w: jnp.cumsum(x, axis=1), [0]),
    "split over features": (lambda x, w: jnp.split(x, 2, axis=-1)[1], [0]),
    "a mask of the batch's shape used row by row": (
        lambda x, w: x * jnp.ones(x.shape[:2])[..., None], [0]),
    "a mask's sum along tokens": (
        lambda x, w: x / jnp.ones(x.shape[:2]).sum(1)[:, None, None], [0]),
    "a batch-size literal": (lambda x, w: x * (x.shape[0] / 2), [0]),
    "sort along tokens": (lambda x, w: jnp.sort(x, axis=1), [0]),
    "take along tokens": (lambda x, w: jnp.take_along_axis(
        x, jnp.zeros(x.shape, jnp.int32), axis=1), [0]),
    "gather along tokens": (lambda x, w: x[:, jnp.array([1, 0, 3, 2])], [0]),
    "scatter into a token": (lambda x, w: x.at[:, 0].add(1.0), [0]),
    "pad tokens": (lambda x, w: jnp.pad(x, ((0, 0), (1, 0), (0, 0))), [0]),
    "integer cast": (lambda x, w: x.astype(jnp.int32), [0]),
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
    "sort along the batch": lambda x, w: jnp.sort(x, axis=0),
    "scatter into a row": lambda x, w: x.at[0].add(1.0),
    "reverse the batch": lambda x, w: x[::-1],
    # issue 38, class 1: one value made at the batch's shape, meeting the batch, reduced
    "a mask of the batch's shape divided by its sum": lambda x, w: _mask_over_sum(x),
    "ones_like divided by its sum over the batch": lambda x, w: _ones_like_over_sum0(x),
    "a padding mask of the batch's rows divided by its sum": lambda x, w: _pad_mask(x),
}


def _mask_over_sum(x):
    mask = jnp.ones(x.shape[:2])
    return x * mask[..., None] / mask.sum()


def _ones_like_over_sum0(x):
    o = jnp.ones_like(x)
    return x * o / o.sum(0, keepdims=True)


def _token_mask(x):
    m = (jnp.arange(x.shape[1]) < 100).astype(x.dtype)
    return x * m[None, :, None] / m.sum()


def _pad_mask(x):
    m = (jnp.arange(x.shape[0]) < 5).astype(x.dtype)
    return x * m[:, None, None] / m.sum()


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
    meeting a batched value, when inputs may not be sliced: slicing would pair rows with the
    wrong weights."""
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


# ------------------------------------------------------------- values the batch meets

def _typing(fn, *args, in_types, **kw):
    closed = jax.make_jaxpr(fn)(*args)
    return analyse(closed.jaxpr, in_types, B, consts=closed.consts, **kw), closed.jaxpr


def test_a_value_of_the_batch_shape_is_batched_everywhere_it_is_used():
    """``mask = ones(h.shape[:2])`` meets the batch in ``h * mask``: the mask is batched (it is
    resized at a slice), so its sum over the whole mask reduces over the batch axis and
    mixes rows (issue 38, class 1: each slice divided by its own count)."""
    typing, jaxpr = _typing(_mask_over_sum, x3, in_types=[0])
    (out,) = typing.out_types
    assert isinstance(out, Mix) and "reduces over the batch axis" in out.why
    masks = [e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim"
             and e.outvars[0].aval.shape == (B, 4)]
    assert [typing.type(v) for v in masks] == [0]


def test_a_mask_made_apart_is_computed_whole():
    """Two masks made by two calls are two values: the one that meets the batch is batched,
    the one only reduced is unbatched and computed whole in every slice (its sum is the full
    batch's): that block slices, and rightly."""
    def f(x):
        return x * jnp.ones(x.shape[:2])[..., None] / jnp.ones(x.shape[:2]).sum()

    typing, jaxpr = _typing(f, x3, in_types=[0])
    assert typing.out_types == [0]
    masks = [typing.type(e.outvars[0]) for e in jaxpr.eqns
             if e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape == (B, 4)]
    assert sorted(masks, key=str) == [0, None]


def test_inputs_used_row_by_row_are_sliced_with_the_batch():
    """Integer positions ``[B, T]`` that index a table for each row, and a per-row weight
    multiplied into the rows, are demanded batched (they are sliced with the activations);
    a square weight as long as the batch that is contracted stays unbatched."""
    pos = jnp.zeros((B, 4), jnp.int32)
    table = jnp.ones((16, 6))
    square = jnp.ones((6, B))

    def f(x, pos, table, per_row, square):
        return (x + table[pos]) * per_row[:, None, :] @ jnp.ones((6, B)) @ square.T

    typing, _ = _typing(f, x3, pos, table, jnp.ones((B, 6)), square,
                        in_types=[0, None, None, None, None])
    assert typing.in_types == [0, 0, None, 0, None]
    assert typing.out_types == [0]
    # no input may be sliced: the positions cannot follow the batch
    typing, _ = _typing(f, x3, pos, table, jnp.ones((B, 6)), square,
                        in_types=[0, None, None, None, None], free=[True] * 5)
    assert typing.in_types == [0, 0, None, 0, None]
    typing, _ = _typing(f, x3, pos, table, jnp.ones((B, 6)), square,
                        in_types=[0, None, None, None, None], free=[False] * 5)
    assert isinstance(typing.out_types[0], Mix)


def test_the_rows_position_mixes_where_it_meets_the_batch():
    """An iota along the batch axis is each row's position: the same row has another position
    at a slice, so it mixes rows wherever it meets them; along another axis it does not."""
    typing, _ = _typing(lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 0), x3,
                        in_types=[0])
    assert isinstance(typing.out_types[0], Mix) and "position" in typing.out_types[0].why
    typing, _ = _typing(lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 1), x3,
                        in_types=[0])
    assert typing.out_types == [0]


# ------------------------------------------------------------- backward programs

def _backward(fn, *args, in_types, ct_types):
    """`fn`'s backward program (jax.vjp's) checked by `check_backward`."""
    def bwd(*xs):
        n = len(args)
        out, vjp = jax.vjp(fn, *xs[:n])
        return vjp(xs[n])

    out = jax.eval_shape(fn, *args)
    closed = jax.make_jaxpr(bwd)(*args, out)
    return check_backward(closed.jaxpr, [*in_types, *ct_types], B, len(args),
                          consts=closed.consts)


def test_a_parameters_cotangent_is_a_sum_over_the_rows():
    typing = _backward(lambda x, w: jnp.tanh(x @ w), x3, w, in_types=[0, None], ct_types=[0])
    assert typing.out_types[1] is SUM


def test_a_cast_of_a_sum_to_an_integer_is_not_a_sum():
    """Issue 38, class 3: a `custom_vjp` backward that casts a parameter's cotangent to int32
    and back truncates each slice's partial sum: not a sum over the rows. A cast between
    float dtypes is (to rounding)."""
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    def bwd(res, g, dtype):
        x, w = res
        gw = jnp.einsum("bti,btj->ij", x, g)
        return g @ w.T, gw.astype(dtype).astype(g.dtype)

    f.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: bwd(r, g, jnp.int32))
    with pytest.raises(NotSeparable, match="casts a sum over the batch from float32 to int32"):
        _backward(f, x3, w, in_types=[0, None], ct_types=[0])
    f.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: bwd(r, g, jnp.bfloat16))
    assert _backward(f, x3, w, in_types=[0, None], ct_types=[0]).out_types[1] is SUM


def test_a_tables_cotangent_from_per_row_indices_is_a_sum():
    """``table[pos]`` with per-row positions: the table's cotangent is a scatter-add of the
    rows' cotangents into zeros, a sum over the rows."""
    pos = jnp.zeros((B, 4), jnp.int32)
    table = jnp.ones((16, 6))
    typing = _backward(lambda x, t, p: x * t[p], x3, table, pos, in_types=[0, None, 0],
                       ct_types=[0])
    assert typing.out_types[:2] == [0, SUM]


def test_a_sum_meeting_a_batched_value_is_not_separable():
    with pytest.raises(NotSeparable):
        _backward(lambda x, w: x * jnp.sum(x @ w), x3, w, in_types=[0, None], ct_types=[0])


# ------------------------------------------------------------- same program

def _same(f, x, k, g=None):
    """`same_program` of `f` traced at `x` (batch axis 0, analysed) and `g` (default `f`) at
    its first 1/k rows, constants compared by value."""
    full = jax.make_jaxpr(f)(x)
    typing = analyse(full.jaxpr, [0], x.shape[0], consts=full.consts)
    sliced = jax.make_jaxpr(g or f)(x[: x.shape[0] // k])
    return same_program(full.jaxpr, sliced.jaxpr, k, typing, full.consts, sliced.consts)


def test_same_program_up_to_the_batch_size():
    f = lambda x: jnp.tanh(x @ w).reshape(x.shape[0] * 4, 6)  # noqa: E731
    assert _same(f, x3, 4)
    g = lambda x: jnp.tanh(x @ w) if x.shape[0] == B else jnp.sin(x @ w)  # noqa: E731
    assert not _same(f, x3, 4, g)


def test_same_program_wants_exactly_the_batched_axes_shorter():
    """A shape that shrinks where the analysis does not resize it (an unbatched value, an
    axis other than the batch's) is another program."""
    assert not _same(lambda x: x[:, :2], x3, 4, lambda x: x[:, :2 * x.shape[0] // B])
    assert not _same(lambda x: jnp.tanh(x) + jnp.ones(8).sum(), x3, 4,
                     lambda x: jnp.tanh(x) + jnp.ones(8 * x.shape[0] // B).sum())


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
    traced at two batch sizes is the same program; two rules with the same primal are not."""
    relu_a, relu_b = _two_relus()

    x = jnp.ones((8, 4))
    assert _same(lambda x: jax.nn.relu(x) * 2, x, 4)
    assert _same(lambda x: relu_a(x) * 2, x, 4)
    assert not _same(lambda x: relu_a(x) * 2, x, 4, lambda x: relu_b(x) * 2)


# ------------------------------------------------- never a silently wrong gradient, end to end
# Each class below once gave a wrong gradient when the backward ran in slices. Every block is
# float32 and run with codec "none", so the reference is plain `jax.grad` of the block
# (float32 against float32, the row sums of the parameter cotangents reassociated: rtol 1e-5,
# plus 1e-5 of the largest entry for entries that cancel).

RB, RT, RD = 16, 128, 24  # 2048 rows: 4 slices of 512 (at least 256 each)


def _mask_rule_jvp():
    @jax.custom_jvp
    def f(x):
        return x * 2

    @f.defjvp
    def _(p, t):
        (x,), (tx,) = p, t
        mask = jnp.ones(x.shape[:2])
        return f(x), tx * mask[..., None] / mask.sum() * (RB * RT)

    return f


def _mask_rule_vjp():
    @jax.custom_vjp
    def f(x):
        return x

    def bwd(_, g):
        o = jnp.ones_like(g)
        return (g * o / o.sum(0, keepdims=True) * RB,)

    f.defvjp(lambda x: (x, None), bwd)
    return f


def _int_cast_vjp():
    @jax.custom_vjp
    def f(x, w):
        return x @ w

    def bwd(res, g):
        x, w = res
        gw = jnp.einsum("bti,btj->ij", x, g)
        return g @ w.T, (gw * 16).astype(jnp.int32).astype(g.dtype) / 16

    f.defvjp(lambda x, w: (x @ w, (x, w)), bwd)
    return f


def _global_jvp():
    @jax.custom_jvp
    def f(x):
        return x * 2

    @f.defjvp
    def _(p, t):
        (x,), (tx,) = p, t
        return f(x), tx * jnp.mean(x ** 2)

    return f


def _global_vjp():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2)),))
    return f


def _rowwise_jvp():
    @jax.custom_jvp
    def f(x):
        return x * 2

    @f.defjvp
    def _(p, t):
        (x,), (tx,) = p, t
        return f(x), tx * jnp.mean(x ** 2, axis=-1, keepdims=True)

    return f


def _rowwise_vjp():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None),
             lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2, -1, keepdims=True) + 1.0),))
    return f


def _blocks():
    """name: (block(w, x) -> an array of x's shape or one merged from it, slices?)"""
    rng = np.random.default_rng(7)
    proj = rng.normal(size=(RD, RD)).astype(np.float32)
    jg, vg, jr, vr = _global_jvp(), _global_vjp(), _rowwise_jvp(), _rowwise_vjp()
    jm, vm, ic = _mask_rule_jvp(), _mask_rule_vjp(), _int_cast_vjp()
    return {
        # issue 32's classes
        "custom_jvp with a statistic over the whole tensor":
            (lambda w, x: jg(jnp.tanh(x @ w)), False),
        "custom_vjp normalising by the global norm": (lambda w, x: vg(jnp.tanh(x @ w)), False),
        "custom_jvp per row": (lambda w, x: jr(jnp.tanh(x @ w)), True),
        "custom_vjp per row": (lambda w, x: vr(jnp.tanh(x @ w)), True),
        # the block is read once at the full batch: these compute what they computed there
        "k-fold integer off the batch axis":
            (lambda w, x: jnp.tanh(x[:, :4 * x.shape[0]] @ w).sum(1, keepdims=True) + x, True),
        "NumPy constant from the batch size":
            (lambda w, x: jnp.tanh(x @ w) * np.full((1, 1, RD), 8.0 / x.shape[0], np.float32),
             True),
        "constant drawn at trace time":
            (lambda w, x: jnp.tanh(x @ (w @ (proj * (1 + x.shape[0] / RB)))), True),
        # issue 38, class 1
        "a mask of the batch's shape divided by its sum":
            (lambda w, x: _mask_over_sum(jnp.tanh(x @ w)) * (RB * RT), False),
        "ones_like divided by its sum over the batch":
            (lambda w, x: _ones_like_over_sum0(jnp.tanh(x @ w)) * RB, False),
        "a padding mask of the rows divided by its own sum":
            (lambda w, x: _pad_mask(jnp.tanh(x @ w)) * RB, False),
        "a token padding mask divided by its own sum (row by row)":
            (lambda w, x: _token_mask(jnp.tanh(x @ w)), True),
        "the mask class inside a custom_jvp rule": (lambda w, x: jm(jnp.tanh(x @ w)), False),
        "the mask class inside a custom_vjp bwd": (lambda w, x: vm(jnp.tanh(x @ w)), False),
        # issue 38, class 3
        "a custom_vjp casting a parameter's cotangent to int32": (lambda w, x: ic(x, w), False),
    }


def _merged_blocks():
    """Issue 38, class 2: outputs whose leading axis merges the batch with other axes (each
    slice must get its rows' blocks, not every k-th row): they slice, and rightly."""
    return {
        "tokens merged into rows": lambda w, x: jnp.tanh(x @ w).reshape(-1, RD),
        "flattened logits": lambda w, x: (x.reshape(-1, RD) @ w),
        "[B, D] -> [2B, D/2]": lambda w, x: jnp.tanh(x[:, 0] @ w).reshape(2 * RB, RD // 2),
        "a merged second output": lambda w, x: (x, jnp.tanh(x @ w).reshape(-1, RD)),
    }


def _wrappers(block, n_layers=2):
    """The block under the three entry points, as a loss(w [2, D, D], x) -> scalar."""
    def sq(out):
        return sum(jnp.sum(jnp.sin(o) ** 2) for o in jax.tree_util.tree_leaves(out))

    f = hg.checkpoint(block, codec="none", backward_slices=4)

    def plain(w, x):  # the activation is computed (an input of the loss stays alive)
        return sq(jax.checkpoint(block)(w[0], jnp.sin(x)))

    return {
        "checkpoint": lambda w, x: sq(f(w[0], jnp.sin(x))),
        "compress_checkpoints": hg.compress_checkpoints(plain, "none", backward_slices=4),
    }, lambda w, x: sq(block(w[0], jnp.sin(x)))


def _inputs():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(RD, RD)) / 4, jnp.float32)
    x = jnp.asarray(rng.normal(size=(RB, RT, RD)), jnp.float32)
    return jnp.stack([w, w * 0.5]), x


def _assert_close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.max(np.abs(b)))


def _eager_rotated(names, wrappers, skip=()):
    """(name, wrapper, jit) for every block under every wrapper, jitted and eagerly. The
    default suite runs each block jitted under two wrappers (all of them where there are two)
    and eagerly under the first of those, taking the wrappers in turn along the blocks from a
    place that depends on the lane (tests/lanes.py), so that every wrapper runs some blocks
    each way in every lane; the other runs are `slow`. The slicing decision and the sliced
    backward's program are made from the block's jaxpr, traced the same way whichever entry
    point wraps it and whether the gradient is then jitted or run eagerly (one engine); what
    eager adds is running that backward one operation at a time (and the eager form of the
    slice check, its error raised directly), which one wrapper per block exercises."""
    out = []
    for b, name in enumerate(names):
        kept = [w for w in wrappers if (name, w) not in skip]
        first = turn(b, len(kept))
        eager = kept[first]
        jitted = {eager, kept[(first + 1) % len(kept)]}
        for wrapper in wrappers:
            for jit in (False, True):
                default = wrapper in jitted if jit else wrapper == eager
                marks = [] if default else [pytest.mark.slow]
                out.append(pytest.param(name, wrapper, jit, marks=marks,
                                        id=f"{'jit' if jit else 'eager'}-{name}-{wrapper}"))
    return out


def _jit_or_not(jit):
    return jax.jit if jit else (lambda f: f)


@pytest.mark.parametrize(("name", "wrapper", "jit"), _eager_rotated(
    list(_blocks()), ["checkpoint", "scan", "compress_checkpoints"],
    skip={(n, "scan") for n in _blocks() if "int32" in n}))
def test_sliced_backward_is_never_wrong(name, wrapper, jit):
    """Blocks whose backward mixes rows (through a custom rule, a value of the batch's shape
    reduced across it, an integer cast of a sum) run their backward at once; the others run
    in slices. Either way the gradients are plain `jax.grad`'s. All three entry points read
    the block the same way (one engine)."""
    block, separable_ = _blocks()[name]
    ws, x = _inputs()
    if wrapper == "scan":
        def loss(w, x):
            return jnp.sum(hg.scan(lambda c, wi: (block(wi, c), None), x, w, codec="none",
                                   backward_slices=4)[0] ** 2)

        def ref(w, x):
            return jnp.sum(lax.scan(lambda c, wi: (block(wi, c), None), x, w)[0] ** 2)
        if "int32" in name:
            pytest.skip("the block's output is not a carry")
    else:
        losses, ref = _wrappers(block)
        loss = losses[wrapper]
    report = hg.slice_report(jax.grad(loss), ws, x)
    assert report and all(r.startswith("sliced") == separable_ for r in report), report
    with highest_precision():
        g = _jit_or_not(jit)(jax.grad(loss, argnums=(0, 1)))(ws, x)
        want = jax.grad(ref, argnums=(0, 1))(ws, x)
    _assert_close(g, want)


@pytest.mark.parametrize(("name", "wrapper", "jit"), _eager_rotated(
    list(_merged_blocks()), ["checkpoint", "compress_checkpoints"]))
def test_merged_outputs_slice_along_their_rows(name, wrapper, jit):
    block = _merged_blocks()[name]
    ws, x = _inputs()
    losses, ref = _wrappers(block)
    loss = losses[wrapper]
    assert hg.slice_report(jax.grad(loss), ws, x) == ["sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        g = _jit_or_not(jit)(jax.grad(loss, argnums=(0, 1)))(ws, x)
        want = jax.grad(ref, argnums=(0, 1))(ws, x)
    _assert_close(g, want)


def test_hg_scan_ys_merged_with_tokens_slice_along_their_rows(maybe_jit):
    """An hg.scan step whose per-step output (``ys``) merges the batch with tokens, under
    hg.grad with no option set (a bf16 model, the float32 backward sliced by default)."""
    ws, x = _inputs()
    ws, x = ws.astype(jnp.bfloat16), x.astype(jnp.bfloat16)

    def step(c, w):
        h = jnp.tanh(c @ w)
        return h, h.reshape(-1, RD)

    def loss(w, x, scan=hg.scan, **kw):
        c, ys = scan(step, x, w, **kw)
        return jnp.sum(jnp.sin(ys.astype(jnp.float32))) + jnp.sum(c.astype(jnp.float32) ** 2)

    sliced = hg.grad(lambda w, x: loss(w, x, codec="none"), argnums=(0, 1))
    assert hg.slice_report(sliced, ws, x) == ["sliced: 4 slices of 4 batch rows"]
    whole = hg.grad(lambda w, x: loss(w, x, codec="none", backward_slices=1), argnums=(0, 1))
    for a, b in zip(maybe_jit(sliced)(ws, x), maybe_jit(whole)(ws, x)):
        assert a.dtype == jnp.float32
        err = np.linalg.norm(np.asarray(a - b)) / np.linalg.norm(np.asarray(b))
        assert err <= 2.0 ** -20, err  # float32 sums over slices reassociated


def test_block_that_branches_on_the_batch_size_slices_as_traced(maybe_jit):
    """A Python branch on the batch size: the block is read once at the full batch, so the
    slices run the branch the forward ran (no row-centring), and the gradients are those of
    the block as traced."""
    rng = np.random.default_rng(0)
    wb = jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32)
    xb = jnp.asarray(rng.normal(size=(2048, 32)), jnp.float32)

    def block(x, w):
        if x.shape[0] < 2048:
            x = x - jnp.mean(x, axis=0, keepdims=True)
        return jnp.tanh(x @ w)

    f = hg.checkpoint(block, codec="none", backward_slices=4)
    loss = lambda w, x: jnp.mean(f(x, w) ** 2)  # noqa: E731
    assert hg.slice_report(jax.grad(loss), wb, xb) == ["sliced: 4 slices of 512 batch rows"]
    with highest_precision():
        g = maybe_jit(jax.grad(loss))(wb, xb)
        want = jax.grad(lambda w, x: jnp.mean(block(x, w) ** 2))(wb, xb)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6 * np.max(np.abs(want)))


@cpu_only("bitwise: the same bf16 ops in two compiled programs round alike on XLA:CPU with "
          "--xla_allow_excess_precision=false (conftest.py); XLA:TPU fuses them differently "
          "(7e-8 apart, measured)")
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
    assert hg.slice_report(jax.grad(loss_of(f)), w, x) == ["sliced: 4 slices of 4 batch rows"]
    with highest_precision():
        got = maybe_jit(jax.grad(loss_of(f), argnums=(0, 1)))(w, x)
        want = jax.grad(loss_of(block), argnums=(0, 1))(w, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.max(np.abs(b)))


# ------------------------------------------------------------------ the fuzzer
# Random blocks (`fuzz_blocks.py`): every one either is not sliced or has a sliced backward
# equal to `jax.vjp`'s (`fuzz_blocks.check`), and every block made of row-wise operations
# only is sliced. The default run checks the first DEFAULT_PROGRAMS of a fixed sequence of
# programs (about 40 s on 2 shared cores on jax 0.10.2), a sequence of its own for each JAX
# release and Python (the seed is theirs: each CI lane checks other programs, reproducibly;
# HIFIGRAD_FUZZ_SEED=S picks another sequence); the `slow` tier checks the next SLOW_PROGRAMS
# of the same sequence (so the lane that runs it checks 300 of them; issue 48 moved 50 of the
# default's 100 there), and
# ``HIFIGRAD_FUZZ_EXAMPLES=N`` runs N random ones in the `sweep` long version.

DEFAULT_PROGRAMS = 50
SLOW_PROGRAMS = 250
DEFAULT_SEED = int(os.environ.get("HIFIGRAD_FUZZ_SEED") or RELEASE_SEED)
LONG_PROGRAMS = int(os.environ.get("HIFIGRAD_FUZZ_EXAMPLES", "0") or 0)


def _program(rng):
    rows, mixing, layouts = fb.op_names()
    ops = [str(rng.choice(rows if rng.random() < 0.75 else mixing))
           for _ in range(int(rng.integers(1, 6)))]
    return ops, str(rng.choice(layouts)), int(rng.choice([2, 4, 8]))


def _fuzz(n, seed, monkeypatch, start=0):
    """Programs ``start`` to ``start + n - 1`` of the sequence `seed` draws."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)  # the fuzzed blocks are small
    rng = np.random.default_rng(seed)
    sliced = 0
    for i in range(start + n):
        ops, layout, k = _program(rng)
        if i < start:
            continue
        try:
            # float32 matmuls (a TPU's default is one bf16 pass, rounded otherwise at another
            # batch size: an RNN over 8 steps was off by 7e-4 there, a precision artifact)
            with highest_precision():
                why = fb.check(fb.make_block(ops, layout), fb.args(i), k, seed=i)
        except AssertionError as e:
            raise AssertionError(f"program {i} of seed {seed}: ops {ops}, layout {layout}, "
                                 f"k={k}: {e}") from e
        if why.startswith("sliced"):
            sliced += 1
        elif fb.is_rowwise(ops, layout):
            raise AssertionError(f"program {i} of seed {seed}: row-wise ops {ops}, layout "
                                 f"{layout}, k={k} not sliced: {why}")
    return sliced


def test_fuzzed_blocks_are_sliced_only_where_exact(monkeypatch):
    """DEFAULT_PROGRAMS random blocks (DEFAULT_SEED: fixed per JAX release and Python): none
    gets a wrong gradient, every row-wise one slices, and a good share of all slices (not a
    vacuous property)."""
    sliced = _fuzz(DEFAULT_PROGRAMS, DEFAULT_SEED, monkeypatch)
    assert sliced >= DEFAULT_PROGRAMS // 4, sliced


@pytest.mark.slow
def test_fuzzed_blocks_next_in_sequence(monkeypatch):
    """The next SLOW_PROGRAMS programs of DEFAULT_SEED's sequence (the slow tier)."""
    sliced = _fuzz(SLOW_PROGRAMS, DEFAULT_SEED, monkeypatch, start=DEFAULT_PROGRAMS)
    assert sliced >= SLOW_PROGRAMS // 4, sliced


@pytest.mark.sweep
@pytest.mark.skipif(not LONG_PROGRAMS, reason="set HIFIGRAD_FUZZ_EXAMPLES=N")
def test_fuzzed_blocks_long(monkeypatch):
    _fuzz(LONG_PROGRAMS, int.from_bytes(os.urandom(4), "little"), monkeypatch)


# The compiled property (`fuzz_blocks.check_compiled`) on blocks of the chooser family, at
# shapes where XLA:CPU vectorizes differently: with the pin off (`pinned_choosers` the
# identity) about 3 in 100 such programs got a wrong gradient on jax 0.12.0.1; with it, none
# (and in about 2 in 100 `jax.jit(jax.grad)` of the plain block was the wrong one). The default
# run checks the first COMPILED_PROGRAMS of DEFAULT_SEED's sequence, the slow tier the next ones.
COMPILED_PROGRAMS = 5
SLOW_COMPILED_PROGRAMS = 25
COMPILED_SHAPES = [(16, 32, 4), (8, 32, 4), (16, 16, 4), (4, 64, 4), (16, 32, 8), (32, 32, 4),
                   (16, 128, 4), (8, 64, 8)]


def _fuzz_compiled(n, seed, monkeypatch, start=0):
    """Programs ``start`` to ``start + n - 1`` of the sequence `seed` draws."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)  # the fuzzed blocks are small
    rng = np.random.default_rng(seed)
    sliced = 0
    for i in range(start + n):
        choice = fb.draw_chooser_block(rng)
        k = int(rng.choice([1, 2, 4]))
        shape = COMPILED_SHAPES[int(rng.integers(len(COMPILED_SHAPES)))]
        if i < start:
            continue
        try:
            why = fb.check_compiled(fb.chooser_block(choice), fb.args(i, shape), k, seed=i)
        except AssertionError as e:
            raise AssertionError(f"program {i} of seed {seed}: {choice}, shape {shape}, "
                                 f"k={k}: {e}") from e
        sliced += why.startswith("sliced")
    return sliced


def test_fuzzed_chooser_blocks_compiled(monkeypatch):
    """COMPILED_PROGRAMS blocks of the chooser family (DEFAULT_SEED's own per release), each
    gradient compiled by XLA: none wrong, and some of them sliced."""
    assert _fuzz_compiled(COMPILED_PROGRAMS, DEFAULT_SEED, monkeypatch) >= 1


@pytest.mark.slow
def test_fuzzed_chooser_blocks_compiled_next_in_sequence(monkeypatch):
    """The next SLOW_COMPILED_PROGRAMS chooser blocks of DEFAULT_SEED's sequence (the slow
    tier)."""
    assert _fuzz_compiled(SLOW_COMPILED_PROGRAMS, DEFAULT_SEED, monkeypatch,
                          start=COMPILED_PROGRAMS) >= 1


def _classified_right(monkeypatch, share):
    """The fuzzer's operations alone, and its output layouts, those ``share`` keeps: the
    row-wise ones slice (and are exact), the mixing ones do not."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)
    rows, mixing, layouts = fb.op_names()
    args = fb.args(0)
    for i, name in enumerate(rows + mixing):
        if share(i):
            why = fb.check(fb.make_block([name], "btd"), args, 4)
            assert why.startswith("sliced") == (name in rows), (name, why)
    for i, name in enumerate(layouts):
        if share(len(rows) + len(mixing) + i):
            why = fb.check(fb.make_block(["tanh_mm"], name), args, 4)
            assert why.startswith("sliced") == fb.LAYOUTS[name][1], (name, why)


def test_every_fuzzer_operation_is_classified_right(monkeypatch):
    """Each operation of the fuzzer alone, and each output layout, half of them in turn (the
    lane's half: tests/lanes.py; each CI lane checks its own, the `slow` tier all)."""
    _classified_right(monkeypatch, lambda i: turn(i, 2) == 0)


@pytest.mark.slow
def test_every_fuzzer_operation_is_classified_right_all(monkeypatch):
    """Every operation of the fuzzer alone, and every output layout (the `slow` tier)."""
    _classified_right(monkeypatch, lambda i: True)


# ------------------------------------------------------------------ row-separable probes
# What real blocks contain (issue 45's list): each of these is row by row, so it must slice,
# and its sliced backward must equal the whole one (`fuzz_blocks.check`). Each family is in
# the fuzzer's catalogue too (`fuzz_blocks.ROWWISE`).

def _probe_args(*extra):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 8)) / np.sqrt(8), jnp.float32)
    return (h, w, *extra)


def _rope_stack(x, w):
    x1, x2 = x[..., ::2], x[..., 1::2]
    th = jnp.arange(x.shape[1], dtype=x.dtype)[None, :, None] * 0.1
    rot = jnp.stack([x1 * jnp.cos(th) - x2 * jnp.sin(th), x1 * jnp.sin(th) + x2 * jnp.cos(th)],
                    -1)
    return (rot.reshape(x.shape) @ w,)


def _rnn_over_tokens(x, w):
    def cell(c, xt):
        c = jnp.tanh(c @ w + xt)
        return c, c
    return (jnp.swapaxes(lax.scan(cell, jnp.zeros_like(x[:, 0]), jnp.swapaxes(x, 0, 1))[1],
                         0, 1),)


def _dropout_keys(x, w, keys):
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, x.shape[1:]))(keys)
    return (jnp.where(keep, x / 0.8, 0.0) @ w,)


def _fold_in_ids(x, w, ids):
    keep = jax.vmap(lambda i: jax.random.bernoulli(
        jax.random.fold_in(jax.random.key(1), i), 0.8, x.shape[1:]))(ids)
    return (jnp.where(keep, x, 0.0) @ w,)


def _conv(groups):
    def block(x, w, kernel):
        return (lax.conv_general_dilated(x, kernel, (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"),
                                         feature_group_count=groups) @ w,)
    return block


def _while_not_differentiated(x, w):
    n = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5),
                       (0, jnp.abs(x[..., 0])))[1]
    return (jnp.tanh(x @ w) * lax.stop_gradient(n)[..., None],)


def _masked_attention(x, w, mask):
    s = jnp.einsum("btd,bsd->bts", x, x @ w) + mask[:, 0]
    return (jax.nn.softmax(s, -1) @ x,)


PROBES = {
    "rope_via_stack": (_rope_stack, ()),
    "tile": (lambda x, w: (jnp.tile(x[..., :4], (1, 1, 2)) @ w,), ()),
    "unstack": (lambda x, w: (sum(jnp.unstack(x, axis=1))[:, None] * x @ w,), ()),
    "interp": (lambda x, w: (jnp.interp(x, jnp.linspace(-3, 3, 5),
                                        jnp.linspace(0, 1, 5) ** 2) @ w,), ()),
    "rnn_over_tokens": (_rnn_over_tokens, ()),
    "fori_loop": (lambda x, w: (lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x),), ()),
    "lax_map_over_rows": (lambda x, w: (lax.map(lambda r: jnp.tanh(r @ w), x),), ()),
    "while_not_differentiated": (_while_not_differentiated, ()),
    "dropout_typed_keys_per_row": (_dropout_keys, (jax.random.split(jax.random.key(3), 8),)),
    "dropout_raw_keys_per_row": (_dropout_keys, (jax.random.split(jax.random.PRNGKey(3), 8),)),
    "fold_in_row_ids": (_fold_in_ids, (jnp.arange(8, dtype=jnp.int32) * 7,)),
    "fft_features": (lambda x, w: (jnp.real(jnp.fft.ifft(jnp.fft.fft(x, axis=-1) * 0.5,
                                                         axis=-1)) @ w,), ()),
    "rfft_features": (lambda x, w: (jnp.fft.irfft(jnp.fft.rfft(x, axis=-1), n=8, axis=-1) @ w,),
                      ()),
    "approx_max_k": (lambda x, w: (x * lax.approx_max_k(x, 2)[0][..., :1] @ w,), ()),
    "mask_by_at_set_on_ones_like": (lambda x, w: ((x * jnp.ones_like(x).at[:, 0].set(0.0))
                                                  @ w,), ()),
    "vmapped_one_hot_scatter": (lambda x, w: ((x * jax.vmap(jax.vmap(
        lambda i: jnp.zeros(8).at[i].set(1.0)))(jnp.argmax(x, -1))) @ w,), ()),
    "depthwise_conv": (_conv(8), (jnp.ones((3, 1, 8)) * 0.3,)),
    "grouped_conv": (_conv(2), (jnp.ones((3, 4, 8)) * 0.1,)),
    "float_mask_bt1": (lambda x, w, m: (jnp.tanh(x @ w) * m,), (jnp.ones((8, 8, 1)),)),
    "additive_mask_b11t": (_masked_attention, (jnp.zeros((8, 1, 1, 8)),)),
    "adaln_conditioning_bd": (lambda x, w, c: ((x * (1 + c[:, None, :])) @ w,),
                              (jnp.full((8, 8), 0.5),)),
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_row_separable_probes_slice(name, monkeypatch):
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)
    block, extra = PROBES[name]
    why = fb.check(block, _probe_args(*extra), 4)
    assert why.startswith("sliced"), why


@pytest.mark.parametrize("name, block, why", [
    # keys made inside from one key: the slice would split that key into its own rows'
    # keys, another mask than the whole batch's
    ("split_of_one_key", lambda x, w: _dropout_keys(x, w, jax.random.split(jax.random.key(0),
                                                                          x.shape[0])),
     "random_split"),
    ("fold_in_of_the_rows_position", lambda x, w: _fold_in_ids(
        x, w, jnp.arange(x.shape[0], dtype=jnp.int32)), "iota"),
    ("rnn_over_the_batch", lambda x, w: (lax.scan(lambda c, r: (jnp.tanh(c + r @ w),) * 2,
                                                  jnp.zeros_like(x[0]), x)[1],),
     "carries a value from row to row"),
])
def test_what_depends_on_other_rows_is_refused(name, block, why, monkeypatch):
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)
    got = fb.check(block, _probe_args(), 4)
    assert not got.startswith("sliced") and why in got, got


# ------------------------------------------------------------------ a row's position as an index

@pytest.mark.parametrize("name", ["pick_by_row_index", "moe_dense_topk"])
@pytest.mark.parametrize("k", [2, 4])
def test_a_rows_position_indexing_its_own_row_slices(name, k, monkeypatch):
    """``x[arange(B), idx]`` and MaxText's dense MoE routing weights (``w.at[arange(B)[:,
    None, None], arange(T)[:, None], top_k_idx].set(...)``, whose backward holds JAX's scatter
    JVP: update ids scattered and compared): the iota along the batch axis indexes each row
    of a value batched along it, so at a slice it is the slice's own rows. Sliced and exact."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)
    why = fb.check(fb.make_block([name, "tanh_mm"], "btd"), fb.args(0), k)
    assert why.startswith("sliced"), why


@pytest.mark.parametrize("name, why", [
    ("iota_b_mask", "the row's position (an iota along the batch axis) used otherwise"),
    ("iota_b", "the row's position"),
    ("moe_global_capacity", "accumulates along the batch axis"),
])
def test_a_rows_position_used_as_a_value_is_refused(name, why, monkeypatch):
    """The same iota as a value (a mask ``arange(B) < n``, a factor), or routing whose
    capacity counts the whole batch's tokens: other rows decide, and slicing is refused."""
    from hifigrad._src import checkpoint as ck

    monkeypatch.setattr(ck, "MIN_SLICE_ROWS", 1)
    got = fb.check(fb.make_block([name], "btd"), fb.args(0), 4)
    assert not got.startswith("sliced") and why in got, got


def test_position_types_only_pass_through_what_keeps_them():
    """The analysis itself: an iota along the batch axis is a `Position` (mixing for any rule
    that does not know it); it passes broadcasts, integer casts, identities and JAX's
    normalization of negative indices, becomes an index vector component by concatenation,
    and a gather by it is batched; arithmetic on it (``p + 1`` as an index) is mixing."""
    from hifigrad._src import separable as S

    def typed(f, *args):
        jaxpr = jax.make_jaxpr(f)(*args).jaxpr
        t = S.analyse(jaxpr, [0] * len(jaxpr.invars), 8)
        return t.out_types

    x = jnp.ones((8, 6))
    assert typed(lambda x: x[jnp.arange(8), jnp.argmax(x, -1)], x) == [0]
    out = typed(lambda x: x[(jnp.arange(8) + 1) % 8, 0], x)[0]
    assert isinstance(out, S.Mix) and not isinstance(out, S.Position), out
    out = typed(lambda x: x * jnp.arange(8.0)[:, None], x)[0]
    assert isinstance(out, S.Mix) and not isinstance(out, S.Position), out
