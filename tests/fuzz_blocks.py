"""Random checkpointed blocks for fuzzing the sliced backward (`test_separable.py`).

A block takes an activation ``h [B, T, D]`` (the batch: float32), parameters ``w [D, D]``,
``v [D]`` and ``table [V, D]``, and integer positions ``pos [B, T]``, and applies a random
sequence of operations, then returns its result in a random layout (possibly with a second
output). Each operation is either *row-wise* (each batch row of its result depends on the same
row of its operands alone: slicing the backward must be allowed and exact) or *mixing* (it
reads across rows: slicing must be refused, or be exact anyway). The catalogue covers what
broke the sliced backward before: values made at the batch's shape from nothing and reduced
(``ones(h.shape[:2]) / sum``), outputs whose leading axis merges the batch with other axes,
casts to integers inside custom rules, gathers by per-row indices, reductions and scans along
every axis, custom_jvp / custom_vjp rules that mix rows when their primal does not.

`check(block, args, k)` is the property: the real decision (`checkpoint._slice_decision`)
either refuses to slice, or its plan's sliced backward (`checkpoint._sliced_backward`, its
loop over slices run eagerly) equals `jax.vjp` of the block at the full batch, norm-wise to
`RTOL` per input.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

B, T, D, V = 8, 8, 8, 16
# Norm-wise error allowed between the sliced and the full float32 backward, relative to the
# largest of the input's own gradient, the largest gradient of the block and the output
# cotangents (a gradient that is zero up to rounding, such as a weight's after a centring or
# everyone's through a sum of a softmax, cancels terms of the size of those: its float32
# noise is relative to them): the slices' parameter cotangents are
# summed in another order (a few float32 ulps of the largest terms, 1e-7 measured); every
# wrong slicing seen was off by 1e-2 or more.
RTOL = 1e-5


# ------------------------------------------------------------------ custom rules

@jax.custom_jvp
def jvp_row(x):
    return x * 2


@jvp_row.defjvp
def _jvp_row(p, t):
    (x,), (tx,) = p, t
    return jvp_row(x), tx * jnp.mean(x ** 2, axis=-1, keepdims=True)


@jax.custom_jvp
def jvp_global(x):
    return x * 2


@jvp_global.defjvp
def _jvp_global(p, t):
    (x,), (tx,) = p, t
    return jvp_global(x), tx * jnp.mean(x ** 2)


@jax.custom_jvp
def jvp_mask_sum(x):
    return x * 2


@jvp_mask_sum.defjvp
def _jvp_mask_sum(p, t):
    (x,), (tx,) = p, t
    m = jnp.ones(x.shape[:2])
    return jvp_mask_sum(x), tx * m[..., None] / m.sum() * 64.0


@jax.custom_vjp
def vjp_row(x):
    return x


vjp_row.defvjp(lambda x: (x, None),
               lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2, -1, keepdims=True) + 1.0),))


@jax.custom_vjp
def vjp_global(x):
    return x


vjp_global.defvjp(lambda x: (x, None), lambda _, g: (g / jnp.sqrt(jnp.sum(g ** 2) + 1.0),))


@jax.custom_vjp
def vjp_mask_sum(x):
    return x


def _vjp_mask_sum_bwd(_, g):
    o = jnp.ones_like(g)
    return (g * o / o.sum(0, keepdims=True) * B,)


vjp_mask_sum.defvjp(lambda x: (x, None), _vjp_mask_sum_bwd)


@jax.custom_vjp
def matmul_int_ct(x, w):
    return x @ w


def _matmul_int_fwd(x, w):
    return x @ w, (x, w)


def _matmul_int_bwd(res, g):
    x, w = res
    gw = jnp.einsum("...i,...j->ij", x, g)
    return g @ w.T, (gw * 4).astype(jnp.int32).astype(g.dtype) / 4


matmul_int_ct.defvjp(_matmul_int_fwd, _matmul_int_bwd)


@jax.custom_vjp
def matmul_row(x, w):
    return x @ w


matmul_row.defvjp(lambda x, w: (x @ w, (x, w)),
                  lambda res, g: (g @ res[1].T, jnp.einsum("...i,...j->ij", res[0], g)))


# ------------------------------------------------------------------ the operations
# Each takes (x [B, T, D], params) and returns an array of x's shape.

def _layernorm(x):
    return (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _attention(x, p):
    s = jnp.einsum("bqd,bkd->bqk", x, x @ p["w"]) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)), s, -1e9)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), x)


def _rope_stack(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    th = jnp.arange(x.shape[1], dtype=x.dtype)[None, :, None] * 0.3
    c, s = jnp.cos(th), jnp.sin(th)
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(x.shape)


def _rnn_t(x, p):
    def cell(c, xt):
        c = jnp.tanh(c @ p["w"] * 0.5 + xt)
        return c, c

    ys = lax.scan(cell, jnp.zeros_like(x[:, 0]), jnp.swapaxes(x, 0, 1))[1]
    return jnp.swapaxes(ys, 0, 1)


def _dropout_pos(x, p):
    """Dropout with a key per token folded in from its position (sliced with the rows)."""
    keys = jax.vmap(jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i)))(p["pos"])
    keep = jax.vmap(jax.vmap(lambda k: jax.random.bernoulli(k, 0.75, x.shape[-1:])))(keys)
    return jnp.where(keep, x / 0.75, 0.0)


def _moe_dense(x, p, experts: int = 4, k: int = 2):
    """Dropless top-k routing as MaxText's dense path: per token, the top-k expert weights
    scattered into a [B, T, E] array by (row position, token position, expert), then every
    expert's output weighted by them."""
    logits = x @ p["w"][:, :experts]
    top_w, top_i = lax.top_k(logits, k)
    b, t = x.shape[:2]
    weights = jnp.zeros((b, t, experts), x.dtype).at[
        (jnp.arange(b)[:, None, None], jnp.arange(t)[:, None], top_i)].set(
            jax.nn.softmax(top_w, -1))
    outs = jnp.stack([jnp.tanh(x * (e + 1) * 0.5) for e in range(experts)], -2)
    return jnp.einsum("bte,bted->btd", weights, outs)


def _moe_global_capacity(x, p, experts: int = 4, capacity: int = 20):
    """Top-1 routing with a capacity over the whole batch's tokens (a cumsum over the
    flattened batch): which tokens are dropped depends on the other rows."""
    flat = x.reshape(-1, x.shape[-1])
    choice = jnp.argmax(flat @ p["w"][:, :experts], -1)
    onehot = jax.nn.one_hot(choice, experts, dtype=x.dtype)
    kept = (jnp.cumsum(onehot, 0) * onehot).sum(-1) <= capacity
    return (flat * kept[:, None].astype(x.dtype)).reshape(x.shape)


def _take_t(x, p):
    idx = jnp.broadcast_to((p["pos"] * 3 % x.shape[1])[..., None], x.shape)
    return jnp.take_along_axis(x, idx, axis=1)


def _masked(x, norm):
    m = jnp.ones(x.shape[:2])
    return x * m[..., None] / norm(m)


def _ones_like_sum0(x):
    o = jnp.ones_like(x)
    return x * o / o.sum(0, keepdims=True) * B


def _arange_b_mask_sum(x):
    m = (jnp.arange(x.shape[0]) < 100).astype(x.dtype)
    return x * m[:, None, None] / m.sum() * B


def _arange_t_mask(x):
    m = (jnp.arange(x.shape[1]) < 5).astype(x.dtype)
    return x * m[None, :, None] / m.sum()


ROWWISE = {
    "tanh_mm": lambda x, p: jnp.tanh(x @ p["w"]),
    "scale_v": lambda x, p: x * p["v"][None, None, :],
    "layernorm": lambda x, p: _layernorm(x),
    "softmax_t": lambda x, p: jax.nn.softmax(x, 1),
    "cumsum_t": lambda x, p: jnp.cumsum(x, 1) / T,
    "merge_rows": lambda x, p: (x.reshape(-1, D) @ p["w"]).reshape(x.shape),
    "merge_baked": lambda x, p: jnp.sin(x.reshape(B * T, D)).reshape(B, T, D),
    "zeros_baked": lambda x, p: x + jnp.zeros((B, T, D)),
    "swap_tb": lambda x, p: jnp.swapaxes(jnp.tanh(jnp.swapaxes(x, 0, 1)), 0, 1),
    "attention": _attention,
    "ones_mask_row": lambda x, p: x * jnp.ones(x.shape[:2])[..., None],
    "ones_mask_sum_t": lambda x, p: _masked(x, lambda m: m.sum(1)[:, None, None]),
    # two masks made apart: the one reduced is not the one that meets the batch, so it is
    # computed whole in every slice (its sum is the full batch's)
    "two_ones_masks_sum": lambda x, p: x * jnp.ones(x.shape[:2])[..., None]
    / jnp.ones(x.shape[:2]).sum() * (B * T),
    "pos_mask": lambda x, p: jnp.where((p["pos"] < T // 2)[..., None], x, 0.5 * x),
    "table_gather": lambda x, p: x + p["table"][p["pos"]],
    "take_along_t": _take_t,
    "perm_t": lambda x, p: x[:, np.array([3, 1, 0, 2, 7, 6, 5, 4])],
    "sort_t": lambda x, p: jnp.sort(x, axis=1),
    "int_cast": lambda x, p: x + (x * 4).astype(jnp.int32).astype(x.dtype) * 0.1,
    "scatter_t": lambda x, p: x.at[:, 0].add(1.0),
    "set_d": lambda x, p: x.at[:, :, 0].set(0.0),
    "pad_t": lambda x, p: jnp.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0))),
    "concat_d": lambda x, p: jnp.concatenate([x[..., :D // 2] * 2, x[..., D // 2:]], -1),
    "center_t": lambda x, p: x - x.mean(1, keepdims=True),
    "max_d": lambda x, p: x - x.max(-1, keepdims=True),
    "arange_mask_t": lambda x, p: _arange_t_mask(x),
    "row_select": lambda x, p: jnp.where(x.sum(-1, keepdims=True) > 0, x, -x),
    "cond": lambda x, p: lax.cond(p["v"].sum() > 0, jnp.tanh, jnp.sin, x),
    "jit_call": lambda x, p: jax.jit(lambda a, w: jnp.tanh(a @ w) * 2)(x, p["w"]),
    "nested_remat": lambda x, p: jax.checkpoint(lambda a: jnp.sin(a @ p["w"]))(x),
    "batch_literal": lambda x, p: x * (x.shape[0] / B),
    "jvp_row": lambda x, p: jvp_row(x) * 0.5,
    "vjp_row": lambda x, p: vjp_row(x),
    "vjp_matmul_row": lambda x, p: matmul_row(x, p["w"]),
    "dynamic_slice_t": lambda x, p: jnp.concatenate(
        [lax.dynamic_slice_in_dim(x, 2, T - 2, 1), x[:, :2]], 1),
    "flat_token_rows": lambda x, p: jnp.tanh(x.reshape(B * T, D)).reshape(x.shape),
    "reduce_all_but_b": lambda x, p: x / (1.0 + jnp.sum(x ** 2, axis=(1, 2), keepdims=True)),
    # issue 45's families: named primitives (RoPE by stack, tile, unstack), transforms along
    # the features, loops with the batch in the carry, per-row randomness, one-hot scatters
    "rope_stack": lambda x, p: _rope_stack(x),
    "tile_d": lambda x, p: jnp.tile(x[..., :D // 2], (1, 1, 2)),
    "unstack_t": lambda x, p: jnp.stack(jnp.unstack(x, axis=1)[::-1], axis=1),
    "fft_d": lambda x, p: jnp.fft.irfft(jnp.fft.rfft(x, axis=-1) * 0.5, n=x.shape[-1], axis=-1),
    "rnn_t": lambda x, p: _rnn_t(x, p),
    "fori_d": lambda x, p: lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ p["w"]), x),
    "map_rows": lambda x, p: lax.map(lambda r: jnp.sin(r @ p["w"]), x),
    "dropout_pos": lambda x, p: _dropout_pos(x, p),
    "one_hot_max": lambda x, p: x * jax.nn.one_hot(jnp.argmax(x, -1), x.shape[-1], dtype=x.dtype),
    "ones_like_set": lambda x, p: x * jnp.ones_like(x).at[:, 0].set(0.5),
    # a row's position as an index (`x[arange(B), idx]`, MaxText's dense MoE routing weights)
    "pick_by_row_index": lambda x, p: x * x[jnp.arange(x.shape[0])[:, None],
                                            jnp.arange(x.shape[1])[None, :],
                                            jnp.argmax(x, -1)][..., None],
    "moe_dense_topk": lambda x, p: _moe_dense(x, p),
    "depthwise_conv_t": lambda x, p: lax.conv_general_dilated(
        x, p["w"][:3, None, :], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=x.shape[-1]),
}

MIXING = {
    "batch_mean": lambda x, p: x - x.mean(0, keepdims=True),
    # issue 38's first class: one value of the batch's shape, made from nothing, meeting the
    # batch and reduced across it
    "ones_mask_sum": lambda x, p: _masked(x, lambda m: m.sum() / (B * T)),
    "ones_like_sum0": lambda x, p: _ones_like_sum0(x),
    "arange_b_mask_sum": lambda x, p: _arange_b_mask_sum(x),
    "iota_b": lambda x, p: x * jnp.arange(x.shape[0], dtype=x.dtype)[:, None, None],
    "roll_b": lambda x, p: x + 0.5 * jnp.roll(x, 1, axis=0),
    "cumsum_b": lambda x, p: jnp.cumsum(x, 0) / B,
    "sort_b": lambda x, p: jnp.sort(x, axis=0),
    "perm_b": lambda x, p: x[np.array([1, 0, 3, 2, 5, 4, 7, 6])],
    "contract_b": lambda x, p: x @ jnp.einsum("btd,bte->de", x, x) / (B * T),
    "jvp_global": lambda x, p: jvp_global(x) * 0.5,
    "vjp_global": lambda x, p: vjp_global(x),
    "jvp_mask_sum": lambda x, p: jvp_mask_sum(x) * 0.5,
    "vjp_mask_sum": lambda x, p: vjp_mask_sum(x),
    "vjp_int_ct": lambda x, p: matmul_int_ct(x, p["w"] * 8),
    "slice_b": lambda x, p: jnp.concatenate([x[1:], x[:1]], 0),
    "scatter_b": lambda x, p: x.at[0].add(1.0),
    "norm_all": lambda x, p: x / jnp.sqrt(1.0 + jnp.sum(x ** 2)),
    "table_scatter_b": lambda x, p: x + jnp.zeros((V, D)).at[p["pos"]].add(x)[:B, None, :],
    "gather_b_by_pos": lambda x, p: x + x[p["pos"][:, 0] % B],
    "max_b": lambda x, p: x - x.max(0, keepdims=True),
    "times_min_b": lambda x, p: x * jnp.min(x, axis=0, keepdims=True),
    "rnn_b": lambda x, p: lax.scan(lambda c, r: (jnp.tanh(c + r), jnp.tanh(c + r)),
                                   jnp.zeros_like(x[0]), x)[1],
    "dropout_one_key": lambda x, p: jnp.where(
        jax.random.bernoulli(jax.random.key(0), 0.75, x.shape), x / 0.75, 0.0),
    "fft_b": lambda x, p: jnp.fft.irfft(
        jnp.fft.rfft(x, axis=0)
        * jnp.arange(1, B // 2 + 2).astype(jnp.complex64)[:, None, None],
        n=x.shape[0], axis=0),
    "stack_b": lambda x, p: jnp.stack([x[::2], x[1::2]], 1).reshape(x.shape),
    "iota_b_mask": lambda x, p: x * (jnp.arange(x.shape[0]) < 3)[:, None, None].astype(x.dtype),
    "moe_global_capacity": lambda x, p: _moe_global_capacity(x, p),
}

# The chooser family (issue 45: a wrong gradient on jax 0.12 that only compiled programs show):
# blocks built slot by slot as real ones are, a projection, a polynomial, a saturating
# activation, a per-position scale, a table gathered by batch-shaped indices, then a reduction
# whose JVP compares its operand with its result (a min or max kept in the gradient, an
# argmin-style pick). Each slot is one of its alternatives, None skipping it; every one is
# row-wise except the chooser slot's `_b` ones (across the batch).
SLOTS = (
    {"matmul": lambda x, p: x @ p["w"], None: None},
    {"cube_tenth": lambda x, p: x ** 3 * 0.1, "tanh": lambda x, p: jnp.tanh(x),
     "gelu": lambda x, p: jax.nn.gelu(x), None: None},
    {"gauss": lambda x, p: jnp.exp(-x * x), "exp": lambda x, p: jnp.exp(x),
     "logistic": lambda x, p: jax.nn.sigmoid(4.0 * x), None: None},
    {"scale_t": lambda x, p: x * jnp.sin(jnp.arange(x.shape[1], dtype=x.dtype)).reshape(1, -1, 1),
     "scale_v": lambda x, p: x * p["v"][None, None, :], None: None},
    {"table_at_get": lambda x, p: x + p["table"].at[
        jnp.broadcast_to(jnp.arange(x.shape[1]) % V, x.shape[:2])].get(),
     "table_gather": lambda x, p: x + p["table"][p["pos"]], None: None},
    {"times_min_t": lambda x, p: jnp.swapaxes(
        jnp.swapaxes(x, 1, 2) * jnp.min(jnp.swapaxes(x, 1, 2), axis=1, keepdims=True), 1, 2),
     "times_max_d": lambda x, p: x * jnp.max(x, axis=-1, keepdims=True),
     "plus_max_t": lambda x, p: x + jnp.max(x, axis=1, keepdims=True),
     "minus_max_d": lambda x, p: x - jnp.max(x, axis=-1, keepdims=True),
     "argmin_pick_d": lambda x, p: x + jnp.take_along_axis(
         x, jnp.argmin(x, axis=-1, keepdims=True), axis=-1),
     "times_min_b": lambda x, p: x * jnp.min(x, axis=0, keepdims=True),
     "minus_max_b": lambda x, p: x - jnp.max(x, axis=0, keepdims=True)},
)


def chooser_block(choice: Sequence[str | None]):
    """The block of the chooser family with one alternative per slot (`SLOTS`)."""
    fns = [slot[c] for slot, c in zip(SLOTS, choice) if c is not None]

    def block(h, w, v, table_, pos):
        p = {"w": w, "v": v, "table": table_, "pos": pos}
        x = h
        for f in fns:
            x = f(x, p)
        return (x,)

    return block


def draw_chooser_block(rng) -> list[str | None]:
    """One alternative per slot, drawn uniformly (the chooser slot is never skipped)."""
    return [list(slot)[int(rng.integers(len(slot)))] for slot in SLOTS]

# Output layouts: (name, fn(x, p) -> outputs, row-wise).
LAYOUTS = {
    "btd": (lambda x, p: (x,), True),
    "flat_rows": (lambda x, p: (x.reshape(-1, D),), True),
    "flat_baked": (lambda x, p: (x.reshape(B * T, D),), True),
    "b_td": (lambda x, p: (x.reshape(B, -1),), True),
    "2b": (lambda x, p: (x.reshape(2 * B, T, D // 2),), True),
    "tbd": (lambda x, p: (jnp.swapaxes(x, 0, 1),), True),
    "first_token": (lambda x, p: (x[:, 0],), True),
    "sum_t": (lambda x, p: (x.sum(1),), True),
    "with_param_output": (lambda x, p: (x, p["w"] * 2), True),
    "two_layouts": (lambda x, p: (x, jnp.tanh(x).reshape(-1, D)), True),
    "with_int_output": (lambda x, p: (x, p["pos"] + 1), True),
    "with_batch_stat": (lambda x, p: (x, x.mean(0)), False),
    "with_total": (lambda x, p: (x, jnp.sum(x ** 2)), False),
}


def make_block(ops: list[str], layout: str):
    table = {**ROWWISE, **MIXING}
    fns = [table[o] for o in ops]
    out_fn = LAYOUTS[layout][0]

    def block(h, w, v, table_, pos):
        p = {"w": w, "v": v, "table": table_, "pos": pos}
        x = h
        for f in fns:
            x = f(x, p)
        return out_fn(x, p)

    return block


def is_rowwise(ops, layout) -> bool:
    return all(o in ROWWISE for o in ops) and LAYOUTS[layout][1]


def args(seed: int, shape: tuple[int, int, int] = (B, T, D)):
    """A block's arguments: ``h`` of `shape` ``(b, t, d)``, ``w [d, d]``, ``v [d]``,
    ``table [V, d]``, ``pos [b, t]`` (the operations of `CHOOSER_FAMILY` take any shape)."""
    b, t, d = shape
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32),
            jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32),
            jnp.asarray(rng.normal(size=(d,)), jnp.float32),
            jnp.asarray(rng.normal(size=(V, d)), jnp.float32),
            jnp.asarray(rng.integers(0, V, size=(b, t)), jnp.int32))


def _row(a, i):
    return a[i]


def _python_scan(f, init, xs):
    """`lax.scan`'s contract run eagerly, slice by slice (no compilation per program)."""
    n = len(jax.tree_util.tree_leaves(xs)[0])
    carry, ys = init, []
    for i in range(n):
        carry, y = f(carry, jax.tree_util.tree_map(functools.partial(_row, i=i), xs))
        ys.append(y)
    return carry, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


def check(block, arrays, k: int, seed: int = 0) -> str:
    """The property: ``"sliced: ..."`` when the decision sliced and the sliced backward equals
    `jax.vjp`'s of the block (norm-wise `RTOL` per input), or the decision's reason for not
    slicing. Raises AssertionError on a wrong gradient."""
    from hifigrad._src import checkpoint as ck
    from hifigrad._src.policy import Policy

    flat = list(arrays)
    encode = [True] + [False] * (len(flat) - 1)
    fun_flat = lambda *a: list(block(*a))  # noqa: E731
    converted, consts = jax.closure_convert(fun_flat, *flat)
    policy = Policy()
    plan, why = ck._slice_decision(converted, consts, flat, encode, policy, "inputs", k)
    if plan is None:
        return why
    outs, vjp = jax.vjp(fun_flat, *flat)
    rng = np.random.default_rng(seed + 1)
    cts = [jnp.asarray(rng.normal(size=np.shape(o)), o.dtype)
           if jnp.issubdtype(o.dtype, jnp.inexact)
           else np.zeros(np.shape(o), jax.dtypes.float0) for o in outs]
    want = vjp(cts)
    old = ck._SLICE_LOOP
    ck._SLICE_LOOP = _python_scan
    try:
        got = ck._sliced_backward(plan, policy, flat, consts, cts)
    finally:
        ck._SLICE_LOOP = old
    floats = [(i, np.asarray(g, np.float64), np.asarray(w, np.float64))
              for i, (g, w) in enumerate(zip(got, want))
              if jnp.issubdtype(jnp.result_type(w), jnp.inexact)]
    largest = max((np.linalg.norm(w) for _, _, w in floats), default=0.0)
    # A gradient that cancels to zero (a sum over T of a softmax over T: its terms are of the
    # cotangents' size) is rounding noise of those terms' size: the cotangents' norm is a
    # floor of the scale (every wrong slicing seen was off by 1e-2 of it or more).
    ct_norm = np.sqrt(sum(np.linalg.norm(np.asarray(c, np.float64)) ** 2 for c in cts
                          if jnp.issubdtype(jnp.result_type(c), jnp.inexact)))
    for i, g, w in floats:
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), largest, ct_norm, 1e-30)
        assert err <= RTOL, (f"input {i}: sliced backward off by {err:.3g} "
                             f"(plan {why}, k={plan.k})")
    return why


@functools.cache
def op_names():
    return sorted(ROWWISE), sorted(MIXING), sorted(LAYOUTS)


def check_compiled(block, arrays, k: int, seed: int = 0) -> str:
    """The compiled property: ``jax.jit(jax.grad)`` of a loss through
    ``hg.checkpoint(block, "none", backward_slices=k)``, compiled by XLA as a user's step is,
    equals the gradient of the same loss through the block itself (`RTOL` per input,
    norm-wise, as `check`). What XLA fuses (a recomputed forward, a producer duplicated into a
    chooser's reduction and into its JVP's comparison) is in play here, and not in `check`'s
    eager loop. The reference is ``jax.jit(jax.grad)`` of the block; where the two differ, the
    block's gradient computed eagerly, one operation at a time, decides: that fusion can break
    the jitted reference itself (jax 0.12 on CPU, `primitives.pin_p`), and then hifigrad must
    equal the eager one. Returns `hg.slice_report`'s line, with " (jax.grad wrong)" appended
    when the jitted reference was the one off."""
    import hifigrad as hg

    rng = np.random.default_rng(seed + 1)
    outs = jax.eval_shape(block, *arrays)
    cts = [jnp.asarray(rng.normal(size=o.shape), o.dtype)
           if jnp.issubdtype(o.dtype, jnp.inexact) else None for o in outs]

    def loss(f):
        def fn(*a):
            return sum(jnp.sum(o * c) for o, c in zip(f(*a), cts) if c is not None)
        return fn

    argnums = tuple(i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.inexact))
    ct_norm = float(np.sqrt(sum(np.linalg.norm(np.asarray(c, np.float64)) ** 2
                                for c in cts if c is not None)))

    def errors(got, want):
        want = [np.asarray(w, np.float64) for w in want]
        largest = max(float(np.linalg.norm(w)) for w in want)
        return {i: float(np.linalg.norm(np.asarray(g, np.float64) - w)
                         / max(np.linalg.norm(w), largest, ct_norm, 1e-30))
                for i, g, w in zip(argnums, got, want)}

    ck = hg.checkpoint(block, "none", backward_slices=k)
    got = jax.jit(jax.grad(loss(ck), argnums))(*arrays)
    errs = errors(got, jax.jit(jax.grad(loss(block), argnums))(*arrays))
    note = ""
    if max(errs.values()) > RTOL:
        errs = errors(got, jax.grad(loss(block), argnums)(*arrays))
        note = " (jax.grad wrong)"
    for i, err in errs.items():
        assert err <= RTOL, f"input {i}: compiled gradient off by {err:.3g} (k={k})"
    return hg.slice_report(loss(ck), *arrays)[0] + note
