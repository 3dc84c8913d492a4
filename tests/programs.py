"""A table of programs covering the constructs hifigrad must handle.

Each entry: ``name -> (fun, make_args)``; ``fun(*args)`` returns a scalar, ``make_args(dtype)``
builds its arguments (floating leaves in ``dtype``; integer leaves stay integer). Used by the
equivalence tests (f32: hg.grad == jax.grad) and the low-precision tests (bf16/fp16 primals).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

PROGRAMS: dict = {}


def program(name):
    def deco(fn):
        try:
            PROGRAMS[name] = fn()
        except ModuleNotFoundError as e:  # an optional framework (flax, optax) is not installed:
            PROGRAMS[name] = (_skipper(str(e)),) * 2  # its cases skip instead of the module failing
        return fn
    return deco


def _skipper(reason):
    def skip(*args, **kwargs):
        import pytest
        pytest.skip(reason)
    return skip


def _rng(seed=0):
    return np.random.default_rng(seed)


def _arr(shape, dtype, seed=0, scale=1.0):
    return jnp.asarray(_rng(seed).normal(size=shape) * scale, dtype)


def _args(*specs):
    """specs: (shape, seed, scale) tuples -> make_args(dtype)."""
    def make(dtype):
        return tuple(_arr(s, dtype, seed, scale) for s, seed, scale in specs)
    return make


def _sum(x):
    return jnp.sum(x.astype(jnp.float32)) if x.dtype != jnp.float32 else jnp.sum(x)


# --------------------------------------------------------------------------- elementwise, linalg

@program("elementwise_chain")
def _():
    def f(x):
        y = jnp.tanh(x) * jnp.exp(-x * x) + jnp.sin(x) / (1 + x * x)
        return _sum(jnp.sqrt(y * y + 1) + jnp.log1p(jnp.abs(y)))
    return f, _args(((8, 16), 0, 1.0))


@program("matmul_mlp")
def _():
    def f(w1, w2, x):
        return _sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
    return f, _args(((16, 32), 1, 0.2), ((32, 8), 2, 0.2), ((4, 16), 3, 1.0))


@program("einsum_attention")
def _():
    def f(q, k, v):
        s = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
        p = jax.nn.softmax(s, axis=-1)
        return _sum(jnp.einsum("bqk,bkd->bqd", p, v) ** 2)
    return f, _args(((2, 5, 16), 4, 1.0), ((2, 7, 16), 5, 1.0), ((2, 7, 16), 6, 1.0))


@program("conv2d")
def _():
    def f(w, x):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return _sum(jax.nn.relu(y) ** 2)
    return f, _args(((3, 3, 4, 8), 7, 0.3), ((2, 8, 8, 4), 8, 1.0))


@program("reductions")
def _():
    def f(x):
        return _sum(jnp.max(x, axis=1) + jnp.min(x, axis=0).sum() + jnp.prod(
            1 + 0.1 * x[:2, :3]) + jnp.mean(x * x, axis=-1).sum() + jnp.var(x))
    return f, _args(((6, 5), 9, 1.0))


@program("cumulative")
def _():
    def f(x):
        return _sum(jnp.cumsum(x, axis=0) * lax.cummax(x, axis=1) + jnp.cumprod(
            1 + 0.1 * x, axis=1) + lax.cumlogsumexp(x, axis=0))
    return f, _args(((5, 6), 10, 1.0))


@program("sort_topk")
def _():
    def f(x):
        vals, _ = lax.top_k(x, 3)
        return _sum(jnp.sort(x, axis=-1)[:, :3] * 2 + vals ** 2)
    return f, _args(((4, 9), 11, 1.0))


@program("gather_scatter")
def _():
    def f(x, y):
        idx = jnp.array([0, 2, 2, 5])
        g = x[idx] * 2
        s = jnp.zeros_like(x).at[idx].add(y)
        t = x.at[jnp.array([1, 3])].set(y[:2])
        return _sum(g ** 2) + _sum(s * x) + _sum(t ** 2) + _sum(x.at[idx].multiply(1.5))
    return f, _args(((6, 3), 12, 1.0), ((4, 3), 13, 1.0))


@program("dynamic_update_slice")
def _():
    def f(x, u):
        y = lax.dynamic_update_slice(x, u * 3, (1, 2))
        z = lax.dynamic_slice(y, (2, 1), (3, 3))
        return _sum(y ** 2) + _sum(jnp.sin(z))
    return f, _args(((6, 6), 14, 1.0), ((2, 3), 15, 1.0))


@program("select_where")
def _():
    def f(x, y):
        return _sum(jnp.where(x > 0, x * y, -y) + jnp.clip(x, -0.5, 0.5) * y)
    return f, _args(((7,), 16, 1.0), ((7,), 17, 1.0))


@program("slicing_concat_pad")
def _():
    def f(x):
        y = jnp.concatenate([x[:, ::2], jnp.pad(x[:, :1], ((0, 0), (1, 1)))], axis=1)
        return _sum(jnp.flip(y, 0).T.reshape(-1) ** 2 * jnp.arange(y.size, dtype=x.dtype))
    return f, _args(((4, 6), 18, 1.0))


@program("broadcast_transpose")
def _():
    def f(x, b):
        return _sum(jnp.transpose(x[None] + b[:, None, None], (2, 0, 1)) ** 2)
    return f, _args(((3, 4), 19, 1.0), ((5,), 20, 1.0))


@program("pow_div_rsqrt")
def _():
    def f(x):
        y = jnp.abs(x) + 0.5
        return _sum(y ** 3 + y ** 0.5 + lax.rsqrt(y) + x / y + lax.integer_pow(x, 4))
    return f, _args(((9,), 21, 1.0))


@program("layernorm")
def _():
    def f(x, g):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        y = (x - m) * lax.rsqrt(v + 1e-5) * g[None]
        return _sum(y ** 2 * jnp.arange(8, dtype=x.dtype)[None])
    return f, _args(((3, 8), 22, 1.0), ((8,), 23, 1.0))


@program("reduce_window_pool")
def _():
    def f(x):
        mx = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        av = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
        return _sum(mx ** 2) + _sum(jnp.sin(av))
    return f, _args(((2, 6, 6, 3), 24, 1.0))


# --------------------------------------------------------------------------- custom rules

@program("custom_jvp_nn")
def _():
    def f(x):
        return _sum(jax.nn.relu(x) * jax.nn.gelu(x) + jax.nn.softmax(x, axis=-1) * 3) + _sum(
            jax.nn.logsumexp(x, axis=-1)) + _sum(jax.nn.silu(x))
    return f, _args(((4, 6), 25, 1.0))


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.3, 0.3),))


@program("custom_vjp_user")
def _():
    def f(x, w):
        return _sum(jnp.tanh(_clip_grad(x * w)) ** 2)
    return f, _args(((6,), 26, 1.0), ((6,), 27, 1.0))


@jax.custom_vjp
def _scaled_sin(x, s):
    return jnp.sin(x) * s


def _scaled_sin_fwd(x, s):
    return _scaled_sin(x, s), (x, s)


def _scaled_sin_bwd(res, g):
    x, s = res
    return g * jnp.cos(x) * s, jnp.sum(g * jnp.sin(x)).reshape(s.shape)


_scaled_sin.defvjp(_scaled_sin_fwd, _scaled_sin_bwd)


@program("custom_vjp_residuals")
def _():
    def f(x, s):
        return _sum(_scaled_sin(x, s) ** 2)
    return f, _args(((5,), 28, 1.0), ((1,), 29, 1.0))


@jax.custom_vjp
def _iterative_bwd(x):
    return x * 2


def _iterative_bwd_bwd(_, g):
    # The backward runs a while loop (a fixed-point iteration converging to g * 2).
    def body(c):
        i, y = c
        return i + 1, 0.5 * y + g
    _, y = lax.while_loop(lambda c: c[0] < 40, body, (0, jnp.zeros_like(g)))
    return (y,)


_iterative_bwd.defvjp(lambda x: (_iterative_bwd(x), None), _iterative_bwd_bwd)


@program("while_in_backward")
def _():
    def f(x):
        return _sum(jnp.sin(_iterative_bwd(x)))
    return f, _args(((4,), 30, 1.0))


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


@program("custom_jvp_user")
def _():
    def f(x):
        return _sum(_softplus(x) ** 2)
    return f, _args(((6,), 31, 1.0))


# --------------------------------------------------------------------------- control flow

@program("jit_nested")
def _():
    @jax.jit
    def inner(x, w):
        return jnp.tanh(x @ w)

    @jax.jit
    def outer(x, w):
        return inner(inner(x, w), w)

    def f(x, w):
        return _sum(outer(x, w) ** 2)
    return f, _args(((3, 8), 32, 1.0), ((8, 8), 33, 0.3))


@program("scan_rnn")
def _():
    def f(w, b, xs):
        def body(c, x):
            c = jnp.tanh(c @ w + x + b)
            return c, c.sum()
        c, ys = lax.scan(body, jnp.zeros((8,), w.dtype), xs)
        return _sum(c) + _sum(ys)
    return f, _args(((8, 8), 34, 0.3), ((8,), 35, 0.1), ((6, 8), 36, 1.0))


@program("scan_reverse_unroll")
def _():
    def f(w, xs):
        def body(c, x):
            return c * jnp.cos(x * w) + x, c
        c, ys = lax.scan(body, jnp.ones((4,), w.dtype), xs, reverse=True, unroll=2)
        return _sum(c) + _sum(ys ** 2)
    return f, _args(((4,), 37, 1.0), ((5, 4), 38, 1.0))


@program("scan_length_only")
def _():
    def f(w, c0):
        c, _ = lax.scan(lambda c, _: (jnp.sin(c * w) + c, None), c0, None, length=5)
        return _sum(c)
    return f, _args(((3,), 39, 1.0), ((3,), 40, 1.0))


@program("scan_nested")
def _():
    def f(w, xs):
        def outer(c, x):
            def inner(d, y):
                return jnp.tanh(d * w + y), d
            d, ds = lax.scan(inner, c, x)
            return d, ds.sum()
        c, ys = lax.scan(outer, jnp.zeros((3,), w.dtype), xs)
        return _sum(c) + _sum(ys)
    return f, _args(((3,), 41, 1.0), ((4, 5, 3), 42, 1.0))


@program("fori_loop")
def _():
    def f(w, x):
        return _sum(lax.fori_loop(0, 4, lambda i, c: jnp.sin(c @ w) + c, x))
    return f, _args(((5, 5), 43, 0.3), ((2, 5), 44, 1.0))


@program("cond_switch")
def _():
    def f(x, w):
        a = lax.cond(x.sum() > 0, lambda x: x * w, lambda x: jnp.sin(x) + w, x)
        b = lax.switch(1, [lambda x: x, lambda x: x ** 2 * w, lambda x: -x], a)
        return _sum(b)
    return f, _args(((5,), 45, 1.0), ((5,), 46, 1.0))


@program("cond_in_scan")
def _():
    def f(w, xs):
        def body(c, x):
            c = lax.cond(x[0] > 0, lambda c: c * w, lambda c: jnp.tanh(c) + x, c)
            return c, None
        c, _ = lax.scan(body, jnp.ones((3,), w.dtype), xs)
        return _sum(c)
    return f, _args(((3,), 47, 1.0), ((6, 3), 48, 1.0))


@program("remat_default")
def _():
    def f(w, x):
        g = jax.checkpoint(lambda x: jnp.sin(jnp.tanh(x @ w) * 2))
        return _sum(g(g(x)) ** 2)
    return f, _args(((6, 6), 49, 0.4), ((3, 6), 50, 1.0))


@program("remat_save_names")
def _():
    from jax.ad_checkpoint import checkpoint_name

    def f(w, x):
        def blk(x):
            h = checkpoint_name(x @ w, "h")
            return jnp.tanh(h) * jnp.sin(h)
        g = jax.checkpoint(blk, policy=jax.checkpoint_policies.save_only_these_names("h"))
        return _sum(g(g(x)))
    return f, _args(((6, 6), 51, 0.4), ((3, 6), 52, 1.0))


@program("remat_offload")
def _():
    from jax.ad_checkpoint import checkpoint_name

    def f(w, x):
        def blk(x):
            h = checkpoint_name(x @ w, "h")
            return jnp.tanh(h)
        pol = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
            offload_src="device", offload_dst="pinned_host")
        return _sum(jax.checkpoint(blk, policy=pol)(x) ** 2)
    return f, _args(((6, 6), 53, 0.4), ((3, 6), 54, 1.0))


@program("remat_scan")
def _():
    def f(w, xs):
        body = jax.checkpoint(lambda c, x: (jnp.tanh(c @ w + x), None),
                              policy=jax.checkpoint_policies.nothing_saveable)
        c, _ = lax.scan(body, jnp.zeros((4,), w.dtype), xs)
        return _sum(c ** 2)
    return f, _args(((4, 4), 55, 0.5), ((7, 4), 56, 1.0))


# --------------------------------------------------------------------------- vmap, misc

@program("vmap_inside")
def _():
    def f(w, xs):
        per = jax.vmap(lambda x: jnp.tanh(x @ w).sum())(xs)
        return _sum(per ** 2)
    return f, _args(((5, 3), 57, 0.5), ((4, 5), 58, 1.0))


@program("vmap_of_scan")
def _():
    def f(w, xs):
        def run(x):
            return lax.scan(lambda c, y: (c * w + y, None), jnp.zeros_like(w), x)[0]
        return _sum(jax.vmap(run)(xs) ** 2)
    return f, _args(((3,), 59, 0.7), ((2, 4, 3), 60, 1.0))


@program("sharding_constraint")
def _():
    from jax.sharding import NamedSharding, PartitionSpec

    def f(x):
        mesh = _mesh()
        y = jax.lax.with_sharding_constraint(jnp.sin(x), NamedSharding(mesh, PartitionSpec("d")))
        return _sum(y ** 2)
    return f, _args(((4, 3), 61, 1.0))


@program("shard_map_collectives")
def _():
    from jax.sharding import PartitionSpec as P

    def f(x, w):
        mesh = _mesh()

        def local(x, w):
            y = jnp.tanh(x @ w)
            s = lax.psum(y.sum(0), "d")
            g = lax.all_gather(y, "d", tiled=True)
            return g * s[None]

        sm = _shard_map(local, mesh, (P("d"), P()), P("d"))
        return _sum(sm(x, w) ** 2)
    return f, _args(((4, 3), 62, 1.0), ((3, 3), 63, 0.5))


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map  # pragma: no cover
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


@program("pure_callback_forward")
def _():
    def host_scale(x):  # (some NumPy releases promote ml_dtypes' bf16 * 2.0 to float32)
        x = np.asarray(x)
        return (x * 2.0).astype(x.dtype)

    def f(x):
        s = jax.pure_callback(host_scale, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              lax.stop_gradient(x))
        return _sum(jnp.sin(x) * s)
    return f, _args(((5,), 64, 1.0))


@jax.custom_vjp
def _host_bwd(x):
    return x


def _host_bwd_bwd(_, g):
    out = jax.pure_callback(lambda g: (np.asarray(g) * 3.0).astype(np.asarray(g).dtype),
                            jax.ShapeDtypeStruct(g.shape, g.dtype), g)
    return (out,)


_host_bwd.defvjp(lambda x: (x, None), _host_bwd_bwd)


@program("pure_callback_in_backward")
def _():
    def f(x):
        return _sum(jnp.sin(_host_bwd(x)))
    return f, _args(((5,), 65, 1.0))


@program("linear_solve")
def _():
    def f(a, b):
        m = a @ a.T + 4 * jnp.eye(4, dtype=a.dtype)
        x = lax.custom_linear_solve(lambda v: m @ v, b,
                                    solve=lambda mv, v: jnp.linalg.solve(
                                        m.astype(jnp.float32), v.astype(jnp.float32)
                                    ).astype(v.dtype),
                                    symmetric=True)
        return _sum(x ** 2)
    return f, _args(((4, 4), 66, 0.5), ((4,), 67, 1.0))


@program("int_inputs_and_aux_structures")
def _():
    def f(params, idx):
        w, b = params["w"], params["b"]
        return _sum(jnp.take(w, idx, axis=0) * b[None])

    def make(dtype):
        return ({"w": _arr((5, 3), dtype, 68), "b": _arr((3,), dtype, 69)},
                jnp.array([0, 3, 3], jnp.int32))
    return f, make


@program("stop_gradient_and_consts")
def _():
    def f(x):
        c = jnp.asarray(np.linspace(-1, 1, 6), x.dtype)
        return _sum(x * c + lax.stop_gradient(x) * x)
    return f, _args(((6,), 70, 1.0))


@program("flax_linen_mlp")
def _():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, dtype=x.dtype, param_dtype=x.dtype)(x)
            x = nn.LayerNorm(dtype=x.dtype, param_dtype=x.dtype)(nn.gelu(x))
            return nn.Dense(4, dtype=x.dtype, param_dtype=x.dtype)(x)

    model = MLP()

    def f(params, x):
        with jax.numpy_dtype_promotion("standard"):  # Flax mixes dtypes implicitly
            return _sum(model.apply(params, x) ** 2)

    def make(dtype):
        x = _arr((3, 8), jnp.float32, 71)
        params = model.init(jax.random.key(0), x)  # f32 init, then cast: same values
        return jax.tree_util.tree_map(lambda p: p.astype(dtype), params), x.astype(dtype)
    return f, make


@program("flax_nnx_mlp")
def _():
    from flax import nnx

    def make(dtype):
        class MLP(nnx.Module):
            def __init__(self, rngs):  # f32 init, then cast: same values in every dtype
                self.l1 = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
                self.l2 = nnx.Linear(16, 4, dtype=dtype, rngs=rngs)

            def __call__(self, x):
                return self.l2(jax.nn.relu(self.l1(x)))

        m = MLP(nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        state = jax.tree_util.tree_map(lambda p: p.astype(dtype), state)
        _GRAPHDEFS[np.dtype(dtype)] = graphdef
        return state, _arr((3, 8), dtype, 72)

    def f(state, x):
        m = nnx.merge(_GRAPHDEFS[np.dtype(x.dtype)], state)
        return _sum(m(x) ** 2)
    return f, make


_GRAPHDEFS: dict = {}


@program("optax_update_inside")
def _():
    import optax

    def f(w, x):
        opt = optax.adamw(1e-2)

        def loss(w):
            return jnp.sum(jnp.tanh(x @ w) ** 2)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes dtypes implicitly
            state = opt.init(w)
            g = jax.grad(loss)(w)
            upd, _ = opt.update(g, state, w)
            w2 = optax.apply_updates(w, upd)
        return _sum(jnp.tanh(x @ w2))
    return f, _args(((4, 4), 73, 0.5), ((2, 4), 74, 1.0))


@program("segment_and_onehot")
def _():
    def f(x):
        seg = jnp.array([0, 0, 1, 2, 2, 2])
        s = jax.ops.segment_sum(x, seg, num_segments=3)
        oh = jax.nn.one_hot(jnp.array([1, 2]), 3, dtype=x.dtype)
        return _sum(s ** 2) + _sum(oh @ s)
    return f, _args(((6, 2), 75, 1.0))


@program("cross_entropy")
def _():
    def f(w, x):
        logits = x @ w
        labels = jnp.array([1, 0, 3])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))
    return f, _args(((6, 4), 76, 0.5), ((3, 6), 77, 1.0))


@program("mixed_precision_casts")
def _():
    def f(w32, x):
        y = x.astype(jnp.bfloat16) @ w32.astype(jnp.bfloat16)
        return jnp.sum(jnp.tanh(y).astype(jnp.float32) ** 2)
    return f, _args(((5, 3), 78, 0.5), ((2, 5), 79, 1.0))


@program("expm1_log_erf")
def _():
    def f(x):
        return _sum(jnp.expm1(0.3 * x) + jnp.log(1 + x * x) + jax.scipy.special.erf(x)
                    + jax.nn.sigmoid(x) * jnp.cos(x))
    return f, _args(((7,), 80, 1.0))


@program("argmax_integer_paths")
def _():
    def f(x):
        i = jnp.argmax(x, axis=-1)
        return _sum(jnp.take_along_axis(x, i[:, None], axis=-1) ** 2) + _sum(
            x * (i[:, None] > 1).astype(x.dtype))
    return f, _args(((4, 5), 81, 1.0))


# The construct table above is what tests/test_rules.py checks (f32: hg.grad == jax.grad; bf16 and
# fp16 against the f32 model). The public-API table below is what tests/test_census.py checks.
ALL = CONSTRUCTS = sorted(PROGRAMS)

# ---- the public-API table (census)

# Small programs over JAX's public API (jax.numpy, jax.nn, jax.lax with lax.linalg and
# lax.special, jax.scipy, jax.image, jax.ops, jax.random, jax.experimental.sparse, the sharding
# API, refs). Most are *ops*: ``fn(*xs) -> array`` of float arrays in one dtype, registered in
# `OPS` (the random-program fuzzer, tests/fuzz_programs.py, draws from it) and turned into the
# program ``sum(fn(*xs) * weights)``. Each program's gradient is checked by test_census.py in
# bf16 and fp16, eager and jitted, against jax.grad of the same program in f32 at the same
# (up-cast) inputs, to a relative tolerance of ``TOLERANCE_FACTOR.get(name, 8) * eps(dtype)``.

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
from collections.abc import Callable  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Op:
    fn: Callable        # float arrays (one dtype) -> a real float array
    shapes: tuple       # the input shapes


OPS: dict = {}
API_NAMES: list = []
# name -> factor of eps(dtype) in the tolerance, for programs worse conditioned than "a few
# rounded ops per path" (default 8); each entry says why.
TOLERANCE_FACTOR: dict = {}
# The one place for known failures: name -> (predicate(jax_version, dtype_name, jit), reason).
XFAIL: dict = {}
# name -> a function returning the context manager the program runs in (a mesh), entered
# outside jax.jit; such ops are not drawn by the fuzzer.
CONTEXT: dict = {}
# name -> why the program is only traced (hg.grad's jaxpr checked), not run, on this machine.
TRACE_ONLY: dict = {}
# name -> why its numerics run only in the slow suite (compile time; coverage is always traced).
HEAVY: dict = {}


def weights(shape):
    """Deterministic non-uniform weights with no zeros (a permuted gradient would show)."""
    n = int(np.prod(shape))
    k = np.arange(n)
    w = np.where(k % 2 == 0, 1.0, -1.0) * (0.5 + (k + 1) / (n + 1))
    return jnp.asarray(w.reshape(shape), jnp.float32)


def _weigh(y):
    return jnp.sum(y.astype(jnp.float32) * weights(y.shape))


def op(name, *shapes, scale=1.0, tol=None, context=None, trace_only=None, heavy=None):
    """Registers ``fn`` as an op and as the program ``sum(fn(*xs) * weights)``."""
    def deco(fn):
        if heavy is not None:
            HEAVY[name] = heavy
        if context is not None:
            CONTEXT[name] = context
        if trace_only is not None:
            TRACE_ONLY[name] = trace_only
        seed = 1000 + 7 * len(API_NAMES)
        OPS[name] = Op(fn, tuple(shapes))
        PROGRAMS[name] = (lambda *xs: _weigh(fn(*xs)),
                          _args(*[(s, seed + i, scale) for i, s in enumerate(shapes)]))
        API_NAMES.append(name)
        if tol is not None:
            TOLERANCE_FACTOR[name] = tol
        return fn
    return deco


def api_program(name, tol=None):
    """A program that is not an op (it takes keys, integer or structured arguments)."""
    def deco(fn):
        PROGRAMS[name] = fn()
        API_NAMES.append(name)
        if tol is not None:
            TOLERANCE_FACTOR[name] = tol
        return fn
    return deco


def xfail(name, reason, when=lambda version, dtype, jit: True):
    XFAIL[name] = (when, reason)


def xfail_reason(name, version, dtype, jit):
    """The reason `name` is expected to fail in this configuration, or None."""
    if name not in XFAIL:
        return None
    when, reason = XFAIL[name]
    return reason if when(version, dtype, jit) else None


_F32 = jnp.float32
_JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])


def _f32(x):
    return x.astype(_F32)


def _spd(a):
    """A well-conditioned symmetric positive definite matrix from `a` (eigenvalues >= 2)."""
    n = a.shape[-1]
    return a @ jnp.swapaxes(a, -1, -2) * (1.0 / n) + 2 * jnp.eye(n, dtype=a.dtype)


# --------------------------------------------------------------------------- jnp elementwise

@op("jnp_inverse_trig", (3, 4))
def _(x):
    t = 0.9 * jnp.tanh(x)
    return jnp.arcsin(t) + jnp.arccos(t) * 0.5 + jnp.arctan(x)


@op("jnp_hyperbolic", (3, 4))
def _(x):
    return (jnp.sinh(0.5 * x) + jnp.cosh(0.5 * x) + jnp.arcsinh(x)
            + jnp.arccosh(1.5 + x * x) + jnp.arctanh(0.8 * jnp.tanh(x)))


@op("jnp_tan", (3, 4))
def _(x):
    return jnp.tan(0.6 * jnp.tanh(x))


@op("jnp_exp_log_family", (3, 4))
def _(x):
    p = 2 + jnp.sin(x)
    return jnp.exp2(0.5 * x) + jnp.log2(p) + jnp.log10(p) + jnp.log(p) + jnp.exp(-x * x)


@op("jnp_cbrt_sqrt_rsqrt", (3, 4))
def _(x):
    p = 1 + x * x
    return jnp.cbrt(x + 3) + jnp.sqrt(p) + lax.rsqrt(p) + jnp.reciprocal(p)


@op("jnp_rounding_sign", (3, 4))
def _(x):
    # Zero-gradient ops (floor, ceil, round, sign, trunc) next to a differentiable path.
    return x * (jnp.floor(x) + jnp.ceil(x) + jnp.round(x) + jnp.sign(x) + jnp.trunc(x)) + x


@op("jnp_isfinite_where", (3, 4))
def _(x):
    return jnp.where(jnp.isfinite(x), jnp.sin(x), 0.0) + jnp.where(jnp.isnan(x), 0.0, x * x)


@op("jnp_square_abs_neg", (3, 4))
def _(x):
    return jnp.square(x) - jnp.abs(x) + jnp.negative(x) * jnp.positive(x)


@op("lax_logistic", (3, 4))
def _(x):
    return lax.logistic(x) + jax.nn.sigmoid(2 * x)


@op("jnp_pow_arrays", (3, 4), (3, 4))
def _(x, y):
    return (1.5 + jnp.sin(x)) ** jnp.cos(y) + jnp.power(2 + jnp.cos(y), 1.5)


@op("jnp_arctan2_hypot", (3, 4), (3, 4))
def _(x, y):
    return jnp.arctan2(x, 2 + jnp.cos(y)) + jnp.hypot(x, 1 + y * y)


@op("jnp_remainder_fmod", (3, 4))
def _(x):
    return jnp.remainder(3 * x, 0.7) + jnp.fmod(2 * x, 0.9) + lax.rem(x, 0.6 + 0 * x)


@op("jnp_maximum_minimum_clip", (3, 4), (3, 4))
def _(x, y):
    return jnp.maximum(x, y) * 2 - jnp.minimum(x, y) + jnp.clip(x, y - 0.5, y + 0.5)


@op("lax_clamp", (3, 4), (3, 4))
def _(x, y):
    lo, hi = jnp.asarray(-1.0, y.dtype), jnp.asarray(0.5, y.dtype)
    return lax.clamp(-0.5 + 0 * x, x + 0.1 * y, 0.6 + 0 * x) + lax.clamp(lo, y, hi)


@op("jnp_ldexp_frexp", (3, 4))
def _(x):
    m, e = jnp.frexp(1 + x * x)
    return jnp.ldexp(x, 2) + m * x + e.astype(x.dtype)


@op("jnp_nextafter_copysign", (3, 4))
def _(x):
    # jax 0.10 has no JVP for nextafter (differentiating through it raises in jax.grad too).
    y = x if _JAX_VERSION >= (0, 12) else lax.stop_gradient(x)
    return x * jnp.nextafter(y, jnp.zeros_like(x)) + jnp.copysign(x, -jnp.ones_like(x))


@op("jnp_sinc_logaddexp", (3, 4), (3, 4))
def _(x, y):
    return jnp.sinc(x) + jnp.logaddexp(x, y) + jnp.logaddexp2(x, 0.5 * y)


@op("lax_reduce_precision", (3, 4))
def _(x):
    return lax.reduce_precision(jnp.sin(x), exponent_bits=5, mantissa_bits=4) * x


@op("complex_parts", (3, 4), (3, 4))
def _(x, y):
    z = lax.complex(_f32(x), _f32(y)) * (0.5 - 0.25j)
    w = jnp.conj(z) * z + z * z
    return (jnp.real(w) + jnp.imag(w) + jnp.abs(z) + jnp.angle(z + 2)).astype(x.dtype)


@op("jnp_polyval", (4,), (5,), scale=0.5)
def _(c, x):
    return jnp.polyval(c, x) + jnp.polyval(c[:2], 0.5 * x)


@op("jnp_polyadd_polymul_polyder", (3,), (4,), scale=0.5)
def _(a, b):
    return jnp.polyval(jnp.polymul(a, b) + jnp.polyadd(a, b)[0], 0.3) + jnp.polyder(b)


# --------------------------------------------------------------------------- jnp structural

@op("jnp_stack_unstack", (3, 4), (3, 4))
def _(x, y):
    s = jnp.stack([x, 2 * y, x * y])
    a, b, c = jnp.unstack(s * 1.5, axis=0)
    return jnp.sin(a) + b * c


@op("array_unpacking", (2, 3, 4))
def _(x):
    a, b = x  # jax 0.12 emits `unstack` here
    return jnp.tanh(a) * b


@op("jnp_tile_repeat", (2, 3))
def _(x):
    return jnp.tile(x, (2, 2)) * 0.5 + jnp.repeat(x, 2, axis=1).reshape(4, 3).repeat(2, axis=1)


@op("jnp_split_array_split", (4, 6))
def _(x):
    a, b, c = jnp.split(x, 3, axis=1)
    d, e = jnp.array_split(x, 2, axis=0)
    return a * b - c + jnp.concatenate([d, e], axis=0)[:, :2]


@op("jnp_squeeze_expand_dims", (1, 4, 1))
def _(x):
    return jnp.expand_dims(jnp.squeeze(x) * 2, 0) + lax.squeeze(x, (2,)) ** 2


@op("jnp_flip_roll_rot90", (3, 4))
def _(x):
    return jnp.flip(x, 1) * 2 + jnp.roll(x, 2, axis=1) * jnp.rot90(jnp.rot90(x))


@op("jnp_diag_trace_tri", (4, 4))
def _(x):
    return jnp.diag(jnp.diag(x)) + jnp.tril(x) * 2 - jnp.triu(x, 1) + jnp.trace(x) * x + (
        jnp.diagonal(x, 1).sum() * x)


@op("jnp_outer_kron_cross", (3,), (3,))
def _(x, y):
    return jnp.outer(x, y) + jnp.kron(x[:2], y[:2]).reshape(2, 2)[0, 0] + jnp.cross(x, y)[None]


@op("jnp_tensordot_inner_vdot", (3, 4), (4, 3))
def _(x, y):
    return (jnp.tensordot(x, y, axes=1) + jnp.inner(x[0], y[:, 0]) + jnp.vdot(x, y.T)
            + jnp.dot(x, y) * 0.5)


@op("jnp_einsum_three_operands", (2, 3), (3, 4), (4, 2))
def _(a, b, c):
    return jnp.einsum("ij,jk,kl->il", a, b, c, optimize="optimal") + jnp.diag(
        jnp.einsum("ii->i", a @ b @ c))


@op("jnp_matmul_batched", (2, 3, 4), (2, 4, 2))
def _(a, b):
    return jnp.matmul(a, b) + jnp.matmul(a, b, preferred_element_type=_F32).astype(a.dtype)


@op("jnp_sort_argsort_take", (3, 5))
def _(x):
    i = jnp.argsort(x, axis=-1)
    return jnp.sort(x, axis=0) + jnp.take_along_axis(x, i, axis=-1) * 2 + jnp.take(x, i[0], axis=1)


@op("lax_sort_multiple_operands", (6,), (6,))
def _(x, y):
    k, v = lax.sort((x, y), num_keys=1)
    return k * 2 + jnp.sin(v)


@op("jnp_interp_searchsorted", (6,), (5,))
def _(x, fp):
    xp = jnp.asarray(np.linspace(-2, 2, 5), x.dtype)
    i = jnp.searchsorted(xp, x)
    j = jnp.searchsorted(jnp.sort(fp), x, side="right", method="compare_all")
    return jnp.interp(x, xp, fp) + jnp.take(fp, jnp.clip(i, 0, 4)) * x + (j % 2).astype(x.dtype) * x


@op("scan_loop_invariant_residuals", (3,), (4, 3))
def _(w, xs):
    def body(c, x):  # sin(w) and its cosine residual do not depend on the carry: hoisted
        return c * jnp.sin(w) + x, c
    c, ys = lax.scan(body, jnp.ones_like(w), xs)
    return c + ys.sum(0)


@op("jnp_median_quantile", (4, 5))
def _(x):
    return jnp.median(x, axis=1) + jnp.quantile(x, 0.3, axis=1) + jnp.percentile(x, 70, axis=1)


@op("jnp_nan_reductions", (3, 4))
def _(x):
    y = jnp.where(x > 1.5, jnp.nan, x)
    return jnp.nansum(y, 0) + jnp.nanmean(y, 0) + jnp.nanmax(y, 0) + jnp.nanmin(y, 0)


@op("jnp_std_ptp_average", (3, 4), (4,))
def _(x, w):
    return jnp.std(x, axis=1) + jnp.ptp(x, axis=1) + jnp.average(x, axis=1, weights=2 + jnp.sin(w))


@op("jnp_argmin_argmax_index", (3, 5))
def _(x):
    i, j = jnp.argmin(x, axis=1), jnp.argmax(x, axis=1)
    return jnp.take_along_axis(x, i[:, None], 1) - jnp.take_along_axis(x, j[:, None], 1) ** 2


@op("lax_cummin_reverse_cumsum", (3, 5))
def _(x):
    return lax.cummin(x, axis=1) + lax.cumsum(x, axis=1, reverse=True) * 0.5 + lax.cumprod(
        1 + 0.1 * x, axis=0)


@op("jnp_diff_gradient_trapezoid", (6,))
def _(x):
    return jnp.diff(x, n=2) + jnp.gradient(x)[1:5] + jnp.trapezoid(x) + jnp.ediff1d(x)[:4]


@op("jnp_any_all_count", (3, 4))
def _(x):
    m = jnp.any(x > 1.0, axis=1, keepdims=True) | jnp.all(x > -2.0, axis=1, keepdims=True)
    return jnp.where(m, x, 2 * x) + jnp.count_nonzero(x > 0).astype(x.dtype) * x


@op("lax_bitcast_convert_type", (3, 4))
def _(x):
    bits = {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize]
    y = lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits), x.dtype)
    return x * y


@op("lax_select_n", (3, 4), (3, 4), (3, 4))
def _(a, b, c):
    which = jnp.asarray(np.arange(12).reshape(3, 4) % 3, jnp.int32)
    return lax.select_n(which, a, b * 2, jnp.sin(c))


@op("lax_approx_max_k", (3, 16))
def _(x):
    v, _ = lax.approx_max_k(x, 4)
    return v ** 2


@op("lax_reduce_variadic", (3, 4), (3, 4))
def _(x, y):
    def f(a, b):
        return (a[0] + b[0], a[1] * b[1])
    init = (jnp.zeros((), x.dtype), jnp.ones((), x.dtype))
    s, p = lax.reduce((x, 1 + 0.1 * y), init, f, (1,))
    return s * p


@op("lax_reduce_window_min", (1, 6, 6, 2))
def _(x):
    # (a variadic or custom-computation reduce_window has no reverse mode in JAX)
    mn = lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return mn * 2 + lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")[
        :, :3, :3]


@op("lax_pad_interior_negative", (3, 4))
def _(x):
    return lax.pad(x, 0.5 + 0 * x[0, 0], ((1, -1, 1), (0, 2, 0))) ** 2


@op("lax_dynamic_slice_traced_index", (5, 4))
def _(x):
    i = jnp.argmax(x[:, 0]) % 3
    return lax.dynamic_slice(x, (i, 1), (2, 3)) * lax.dynamic_index_in_dim(x, i, keepdims=True)[
        :, :3]


@op("gather_fill_and_clip_modes", (5, 3))
def _(x):
    idx = jnp.array([0, 4, 7, -1])
    return x.at[idx].get(mode="fill", fill_value=0.5) + x.at[idx].get(mode="clip") ** 2


@op("scatter_mul_min_max_sub", (5, 3), (3, 3))
def _(x, u):
    idx = jnp.array([0, 2, 4])
    a = x.at[idx].multiply(1 + 0.1 * u, unique_indices=True)
    b = x.at[idx].min(u)
    c = x.at[idx].max(u)
    d = lax.scatter_sub(x, idx[:, None], u, lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)))
    return a + b * 2 + c + d


@op("jnp_broadcast_to_arrays", (4,), (3, 1))
def _(x, y):
    a, b = jnp.broadcast_arrays(x[None], y)
    return jnp.broadcast_to(x, (3, 4)) * a + b


@op("lax_optimization_barrier", (3, 4))
def _(x):
    y, z = lax.optimization_barrier((jnp.sin(x), x * 2))
    return y * z


@op("lax_stop_gradient_partial", (3, 4))
def _(x):
    return x * lax.stop_gradient(x) + jnp.sin(x)


@op("jnp_copy_asarray", (3, 4))
def _(x):
    return jnp.copy(x) * jnp.array(x, copy=True) + jnp.asarray(x)


@op("jnp_convolve_correlate", (8,), (3,))
def _(x, k):
    return jnp.convolve(x, k, mode="same") + jnp.correlate(x, k, mode="same")


@op("lax_conv_transpose_grouped_dilated", (1, 6, 6, 4), (3, 3, 2, 4))
def _(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 1),
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
    z = lax.conv_transpose(x, w[:, :, :, :2].transpose(0, 1, 3, 2).reshape(3, 3, 2, 2)
                           .repeat(2, axis=2), (2, 2), "SAME",
                           dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y.sum() * 0.1 + z * 0.1


@op("lax_ragged_dot", (6, 4), (2, 4, 3))
def _(x, w):
    return lax.ragged_dot(x, w, jnp.array([2, 4], jnp.int32))


@op("lax_dot_general_batch_preferred", (2, 3, 4), (2, 4, 5))
def _(a, b):
    dn = (((2,), (1,)), ((0,), (0,)))
    return lax.dot_general(a, b, dn, preferred_element_type=_F32) * 0.5 + lax.dot_general(
        a, b, dn).astype(_F32)


# --------------------------------------------------------------------------- linear algebra

@op("linalg_cholesky_cho_solve", (4, 4), (4,), scale=0.5)
def _(a, b):
    import jax.scipy.linalg as jsl

    m = _spd(_f32(a))
    c = jnp.linalg.cholesky(m)
    return c + jsl.cho_solve((c, True), _f32(b))[:, None]


@op("linalg_qr", (4, 3), scale=0.5)
def _(a):
    a = _f32(a) + jnp.eye(4, 3)
    q, r = jnp.linalg.qr(a)
    return jnp.concatenate([r * jnp.sign(jnp.diag(r))[:, None], q @ r], axis=0)


@op("linalg_svd_norms", (4, 3), scale=0.5)
def _(a):
    a = _f32(a) + jnp.asarray(np.eye(4, 3) * [3.0, 2.0, 1.0], _F32)
    s = jnp.linalg.svd(a, compute_uv=False)
    return s + jnp.linalg.norm(a, 2) + jnp.linalg.norm(a, "nuc") + jnp.linalg.norm(a, "fro")


@op("linalg_svd_vectors_pinv", (3, 3), scale=0.3)
def _(a):
    a = _f32(a) + jnp.asarray(np.diag([3.0, 2.0, 1.0]), _F32)
    u, s, vt = jnp.linalg.svd(a)
    return (u * s[None]) @ vt + jnp.linalg.pinv(a)


@op("linalg_eigh", (4, 4), scale=0.3)
def _(a):
    m = _f32(a + a.T) + jnp.asarray(np.diag([1.0, 2.0, 3.0, 4.0]), _F32)
    w, v = jnp.linalg.eigh(m)
    return (v * w[None]) @ v.T + jnp.linalg.eigvalsh(m)[None] + (v ** 2) @ jnp.diag(w)


@op("linalg_eig_eigvals", (3, 3), scale=0.2)
def _(a):
    m = _f32(a) + jnp.asarray(np.diag([1.0, 2.0, 3.0]), _F32)
    return jnp.real(jnp.linalg.eigvals(m)) ** 2


@op("linalg_det_slogdet_inv", (3, 3), scale=0.3)
def _(a):
    m = _f32(a) + 2 * jnp.eye(3)
    sign, logdet = jnp.linalg.slogdet(m)
    return jnp.linalg.inv(m) + jnp.linalg.det(m) + sign * logdet


@op("linalg_solve_lu", (3, 3), (3, 2), scale=0.3)
def _(a, b):
    import jax.scipy.linalg as jsl

    m = _f32(a) + 2 * jnp.eye(3)
    p, l, u = jsl.lu(m)
    lu_piv = jsl.lu_factor(m)
    return jnp.linalg.solve(m, _f32(b)) + jsl.lu_solve(lu_piv, _f32(b)) + (l @ u)[:, :2]


@op("linalg_solve_triangular", (3, 3), (3, 2), scale=0.3)
def _(a, b):
    import jax.scipy.linalg as jsl

    t = jnp.tril(_f32(a)) + 2 * jnp.eye(3)
    return jsl.solve_triangular(t, _f32(b), lower=True) + lax.linalg.triangular_solve(
        t, _f32(b).T, left_side=False, lower=True, transpose_a=True).T


@op("linalg_lstsq_matrix_power", (4, 3), (4,), scale=0.3)
def _(a, b):
    a = _f32(a) + jnp.eye(4, 3) * 2
    x = jnp.linalg.lstsq(a, _f32(b))[0]
    return x + jnp.linalg.matrix_power(a[:3] * 0.5, 3)[0] + jnp.linalg.multi_dot([a.T, a, x])


@op("linalg_expm", (3, 3), scale=0.3,
    heavy="Pade approximant with squaring loops: ~12 s of XLA:CPU compile on 2 shared cores")
def _(a):
    import jax.scipy.linalg as jsl

    return jsl.expm(_f32(a))


@op("lax_linalg_tridiagonal_solve", (3, 5), (5, 2), scale=0.3)
def _(d, b):
    d = _f32(d)
    dl = d[0].at[0].set(0.0)
    du = d[2].at[-1].set(0.0)
    return lax.linalg.tridiagonal_solve(dl, 3 + d[1] ** 2, du, _f32(b))


@op("lax_linalg_direct", (3, 3), scale=0.3)
def _(a):
    m = _spd(_f32(a))
    c = lax.linalg.cholesky(m)
    q, r = lax.linalg.qr(m)
    v, w = lax.linalg.eigh(m)
    return c + q @ r + (v * w[None]) @ v.T


# --------------------------------------------------------------------------- fft

@op("jnp_fft_family", (4, 6))
def _(x):
    x = _f32(x)
    f = jnp.fft.fft(x.astype(jnp.complex64))
    r = jnp.fft.irfft(jnp.fft.rfft(x) * (0.5 + 0.25j), n=6)
    f2 = jnp.fft.ifft2(jnp.fft.fft2(x) * 0.5)
    fn = jnp.fft.rfftn(x)
    return (jnp.real(f * jnp.conj(f)) * 0.1 + r + jnp.real(f2) + jnp.fft.hfft(x[:, :4], n=6)
            * 0.1 + jnp.fft.fftshift(x) + jnp.abs(fn).sum() * 0.01)


# --------------------------------------------------------------------------- jax.nn

@op("nn_activations_a", (3, 5))
def _(x):
    n = jax.nn
    return (n.relu6(3 * x) + n.hard_tanh(x) + n.leaky_relu(x, 0.1) + n.celu(x) + n.selu(x)
            + n.log_sigmoid(x) + n.soft_sign(x) + n.hard_sigmoid(x) + n.hard_silu(x))


@op("nn_activations_b", (3, 6))
def _(x):
    n = jax.nn
    return (n.mish(x) + n.squareplus(x) + n.sparse_plus(x) + n.elu(x) + n.gelu(x, approximate=False)
            + n.glu(x, axis=-1).repeat(2, axis=-1) + n.standardize(x, axis=-1)
            + n.log_softmax(x, axis=0) + n.softmax(x, axis=0))


@op("nn_dot_product_attention", (2, 4, 2, 8), (2, 5, 2, 8), (2, 5, 2, 8))
def _(q, k, v):
    if q.dtype == jnp.float16:  # XLA:CPU has no F16_F16_F32 dot (jax.grad under jit fails too)
        q, k, v = _f32(q), _f32(k), _f32(v)
    with jax.numpy_dtype_promotion("standard"):  # the xla implementation mixes dtypes
        a = jax.nn.dot_product_attention(q, k, v)
        b = jax.nn.dot_product_attention(q, k[:, :4], v[:, :4], is_causal=True)
    return a + b


@op("nn_one_hot_logsumexp_where", (3, 4))
def _(x):
    oh = jax.nn.one_hot(jnp.array([0, 3, 1]), 4, dtype=x.dtype)
    return jax.nn.logsumexp(x, axis=1, where=oh < 1)[:, None] + oh * x


# --------------------------------------------------------------------------- special functions

@op("scipy_special_gamma_family", (3, 4))
def _(x):
    s = jax.scipy.special
    p = 1.5 + x * x
    return (s.gammaln(p) + s.digamma(p) + s.polygamma(1, p) + s.gamma(p) * 0.1
            + s.betaln(p, 2 + 0 * p)
            + s.multigammaln(p + 1, 2) * 0.1 + lax.lgamma(p) + lax.digamma(p))


XFAIL["scipy_special_gamma_family"] = (
    lambda version, dtype, jit: version[:3] == (0, 11, 1) and dtype == "fp16" and jit,
    "jaxlib 0.11.1's XLA CPU miscompiles this fp16 program under jit: JAX's own fp16 jax.grad "
    "gives the same wrong value (-2.215 for -1.052 at x=-0.69, betaln + multigammaln); eager, "
    "bf16 and jax 0.10.2/0.11.0/0.11.2/0.12.x are right")


@op("scipy_special_incomplete", (3, 4))
def _(x):
    s = jax.scipy.special
    a = 1.5 + jnp.sin(x)
    z = 1.0 + jnp.cos(x) ** 2
    t = 0.5 + 0.3 * jnp.tanh(x)
    b = jnp.full_like(t, 2.0)  # JAX differentiates betainc in x only
    return (s.gammainc(a, z) + s.gammaincc(a, z) + s.betainc(b, b + 1, t)
            + lax.igamma(a, z) + lax.betainc(b, b, t))


@op("scipy_special_erf_family", (3, 4))
def _(x):
    s = jax.scipy.special
    t = 0.8 * jnp.tanh(x)
    # ndtr, ndtri and log_ndtr accept float32/float64 only
    ndtr = s.ndtr(_f32(x)) + s.ndtri(0.5 + 0.4 * _f32(t)) + s.log_ndtr(_f32(x))
    return (s.erf(x) + s.erfc(x) + s.erfinv(t) + lax.erf_inv(t)).astype(_F32) + ndtr


@op("scipy_special_bessel_xlogy", (3, 4))
def _(x):
    s = jax.scipy.special
    p = 1 + x * x
    # zeta in float32: its series casts Bernoulli numbers to the input dtype, which overflow
    # fp16 (numpy's "overflow encountered in cast", an error under the suite's filters).
    return ((s.i0e(x) + s.i1e(x) + s.i0(x) * 0.1 + s.i1(x) + lax.bessel_i0e(x) + s.xlogy(p, p)
             + s.xlog1py(p, p) + s.entr(0.5 + 0.3 * jnp.tanh(x))
             + s.logit(0.5 + 0.3 * jnp.tanh(x)) + s.expit(x)).astype(_F32)
            + s.zeta(_f32(2 + p), _f32(1.0 + 0 * p)) * 0.1)


@op("scipy_special_logsumexp_softmax", (3, 4))
def _(x):
    s = jax.scipy.special
    return s.logsumexp(x, axis=0)[None] + s.softmax(x, axis=1) + s.log_softmax(x, axis=1)


@op("scipy_stats_logpdfs", (3, 4))
def _(x):
    st = jax.scipy.stats
    x = _f32(x)  # norm.cdf (ndtr) accepts float32/float64 only
    return (st.norm.logpdf(x, 0.5, 2.0) + st.norm.cdf(x) + st.t.logpdf(x, 3.0)
            + st.gamma.logpdf(1 + x * x, 2.0) + st.beta.logpdf(0.5 + 0.3 * jnp.tanh(x), 2.0, 3.0)
            + st.poisson.logpmf(3, 1 + x * x) + st.logistic.logpdf(x))


# --------------------------------------------------------------------------- image, ops

@op("image_resize_methods", (1, 4, 4, 2))
def _(x):
    r = jax.image.resize
    return r(x, (1, 7, 6, 2), "linear") + r(x, (1, 7, 6, 2), "cubic") * 0.5


@op("image_scale_and_translate", (4, 4))
def _(x):
    return jax.image.scale_and_translate(x, (6, 5), (0, 1), jnp.array([1.5, 1.25]),
                                         jnp.array([0.2, -0.1]), "linear")


@op("ops_segment_reductions", (6, 2))
def _(x):
    seg = jnp.array([0, 0, 1, 2, 2, 2])
    o = jax.ops
    # (segment_prod: JAX differentiates scatter-mul only with unique indices; jax.grad raises)
    return (o.segment_sum(x, seg, 3) + o.segment_max(x, seg, 3) + o.segment_min(x, seg, 3)
            + o.segment_sum(x, seg, 3, indices_are_sorted=True) ** 2)


# --------------------------------------------------------------------------- random samplers
# Reparameterized samplers: the sample is differentiated with respect to the distribution's
# parameters (implicit reparameterization for gamma, beta and dirichlet). The key is fixed.

def _key(i=0):
    return jax.random.key(i)


@op("random_gamma_reparam", (6,))
def _(a):
    alpha = 1.5 + a * a
    return jax.random.gamma(_key(1), alpha) + jax.random.loggamma(_key(2), alpha) * 0.1


@op("random_beta_dirichlet_reparam", (4,), (3,),
    heavy="three rejection samplers (gamma loops): ~40 s of XLA:CPU compile on 2 shared cores")
def _(a, b):
    pa, pb = 1.5 + a * a, 2 + jnp.sin(a)
    with jax.numpy_dtype_promotion("standard"):  # the samplers mix dtypes internally
        d = jax.random.dirichlet(_key(3), 1.5 + b * b, shape=(2,))
        be = jax.random.beta(_key(4), pa, pb)
    return be + d.sum(0).repeat(2)[:4] * 0.5


@op("random_location_scale", (5,), (5,))
def _(mu, s):
    # The noise is drawn in float32 and rounded: a sampler run at bf16 draws other values than
    # at f32, and the f32 reference must see the same noise.
    dt = mu.dtype
    return (mu + jnp.exp(0.3 * s) * jax.random.normal(_key(5), mu.shape).astype(dt)
            + jax.random.truncated_normal(_key(6), -1.0, 1.0, mu.shape).astype(dt) * s
            + jax.random.uniform(_key(7), mu.shape).astype(dt) * mu
            + jax.random.split(_key(8), 2).shape[0] * s
            + jax.random.bits(jax.random.fold_in(_key(9), 3), mu.shape, jnp.uint8)[0].astype(
                s.dtype) * 0 * s)


# --------------------------------------------------------------------------- sparse

@op("sparse_bcoo_matmul_todense", (4, 5), (5, 3))
def _(a, w):
    from jax.experimental import sparse

    m = sparse.BCOO.fromdense(jnp.where(jnp.abs(a) > 0.3, a, 0), nse=a.size)
    return m @ w + (m.T @ a).sum() * 0.1 + m.todense()[:, :3] * 2


@op("sparse_bcoo_ops", (4, 4), (4, 4))
def _(a, b):
    from jax.experimental import sparse

    m = sparse.BCOO.fromdense(jnp.where(jnp.abs(a) > 0.3, a, 0), nse=a.size)
    mm = sparse.bcoo_sum_duplicates(sparse.bcoo_sort_indices(m), nse=m.nse)
    ext = sparse.bcoo_extract(mm, b)
    sampled = sparse.bcoo_dot_general_sampled(
        a, b, mm.indices, dimension_numbers=(((1,), (0,)), ((), ())))
    sampled = sparse.BCOO((sampled, mm.indices), shape=mm.shape)
    return sparse.todense(ext) + sampled.todense() + (mm @ b) * 0.5


@op("sparse_bcsr_and_sparsify", (4, 5), (5, 3))
def _(a, w):
    from jax.experimental import sparse

    m = sparse.BCSR.fromdense(jnp.where(jnp.abs(a) > 0.3, a, 0), nse=a.size)
    f = sparse.sparsify(lambda m, w: jnp.sin(1.0) * (m @ w))
    return m @ w + f(sparse.BCOO.fromdense(a, nse=a.size), w) + m.todense()[:, :3]


@op("sparse_legacy_coo_csr", (4, 4), (4,))
def _(a, v):
    from jax.experimental import sparse

    d = jnp.where(jnp.abs(a) > 0.3, a, 0)
    c = sparse.COO.fromdense(d, nse=d.size)
    r = sparse.CSR.fromdense(d, nse=d.size)
    return ((c @ v)[:, None] + (r @ v)[:, None] + c.todense() + r.todense() + (c @ a) * 0.5
            + (r @ a) * 0.25)


# --------------------------------------------------------------------------- transforms, calls

@op("lax_custom_root", (3,))
def _(b):
    b = _f32(b)

    def f(x):
        return x * x * x + x - b

    def solve(f, x0):
        def body(_, x):
            return x - f(x) / (3 * x * x + 1)
        return lax.fori_loop(0, 12, body, x0)

    def tangent_solve(g, y):  # f acts elementwise: its Jacobian is diagonal
        return y / g(jnp.ones_like(y))

    return lax.custom_root(f, jnp.zeros_like(b), solve, tangent_solve)


@op("custom_derivatives_linear_call", (3, 4))
def _(x):
    from jax.custom_derivatives import linear_call

    def fwd(s, v):
        return v * s

    def bwd(s, ct):
        return ct * s

    return jnp.sin(linear_call(fwd, bwd, 2.0, x)) + x


@op("debug_callback_and_print", (3, 4))
def _(x):
    jax.debug.callback(lambda v: None, x)
    jax.debug.print("hifigrad census: {}", x[0, 0])
    return jnp.sin(x)


@op("debug_inspect_sharding_dce_sink", (3, 4))
def _(x):
    jax.debug.inspect_array_sharding(x, callback=lambda s: None)
    y = jnp.sin(x)
    lax.dce_sink(y * 2)
    return y


@op("scheduling_group_metadata", (3, 4))
def _(x):
    from jax.experimental.scheduling_groups import scheduling_group

    return scheduling_group("hifigrad")(lambda v: jnp.sin(v) * 2)(x) * x


def _program_order():
    """`jax.experimental.overlap.program_order` (jax 0.11.1 to 0.11.2), or None."""
    try:
        from jax.experimental.overlap import program_order
    except ImportError:
        return None
    return program_order


if _program_order() is not None:
    @op("overlap_program_order", (3, 4))
    def _(x):
        ordered = _program_order()(enforce=False)(lambda v: jnp.sin(v) * v)
        return ordered(x) * 2


@jax.custom_vjp
def _sin_remat_opt(x):
    return jnp.sin(x)


_sin_remat_opt.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,),
                      optimize_remat=True)


@op("custom_vjp_optimize_remat", (3, 4))
def _(x):
    return _sin_remat_opt(x * 2) * x


@op("sparse_linalg_spsolve", (3, 3), (3,), scale=0.3)
def _(a, b):
    from jax.experimental import sparse
    from jax.experimental.sparse import linalg as spl

    m = sparse.BCSR.fromdense(_f32(a) + 3 * jnp.eye(3), nse=9)
    return spl.spsolve(m.data, m.indices, m.indptr, _f32(b))


@op("checkpoint_name_and_remat_policies", (3, 4), (4, 4), scale=0.5)
def _(x, w):
    from jax.ad_checkpoint import checkpoint_name

    def blk(x):
        return jnp.tanh(checkpoint_name(x @ w, "h")) * 2

    pol = jax.checkpoint_policies.save_any_names_but_these("h")
    return jax.checkpoint(blk, policy=pol, prevent_cse=False)(x) + jax.remat(blk)(x)


@op("compute_on_host", (3, 4))
def _(x):
    from jax.experimental import compute_on as co

    # jax 0.10: compute_on2 binds the compute_on primitive; 0.12 renamed it compute_on
    api = co.compute_on2 if hasattr(co, "compute_on2") else co.compute_on
    deco = api(compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)
    return deco(lambda v: v * 2)(jnp.sin(x))


@op("jax_device_put_in_jit", (3, 4))
def _(x):
    return jax.device_put(jnp.sin(x), jax.devices()[0]) * x


# --------------------------------------------------------------------------- refs

@op("mutable_refs", (3, 4), (3, 4))
def _(x, y):
    r = jax.new_ref(jnp.zeros_like(x))
    r[...] = jnp.sin(x)
    r[...] += y * 2
    old = r.swap(x * y) if hasattr(r, "swap") else r[...]
    return old + r[...] + jax.freeze(r) * 0.5


# --------------------------------------------------------------------------- sharding API
# On a one-device mesh (the test process has one CPU device): the primitives, their JVP and
# transpose rules are those of any mesh size; tests/test_distributed.py covers real meshes.

def _explicit_mesh():
    from jax.sharding import AxisType

    return jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))


@op("shard_map_reductions", (4, 3), (3, 3), scale=0.5)
def _(x, w):
    from jax.sharding import PartitionSpec as P

    def local(x, w):  # (pmax / pmin: JAX has no differentiation rule for them)
        y = jnp.tanh(x @ w)
        s = lax.psum(y, "d") + lax.pmean(y, "d")
        return s * (lax.axis_index("d") + 1).astype(y.dtype)

    return _shard_map(local, _mesh(), (P("d"), P()), P("d"))(x, w)


@op("shard_map_gathers_scatters", (4, 3), scale=0.5)
def _(x):
    from jax.sharding import PartitionSpec as P

    def local(x):
        g = lax.all_gather(x, "d", tiled=True)
        r = lax.psum_scatter(x * 2, "d", tiled=True)
        a = lax.all_to_all(x[None], "d", 0, 0, tiled=True)[0]
        p = lax.ppermute(x, "d", perm=[(0, 0)])
        return g * 2 + r + a * p

    return _shard_map(local, _mesh(), (P("d"),), P("d"))(x)


@op("shard_map_unchecked_psum", (4, 3), (3, 3), scale=0.5)
def _(x, w):
    from jax.sharding import PartitionSpec as P

    def local(x, w):  # without varying-axes checks, psum binds psum (transposed: pbroadcast)
        return lax.psum(jnp.tanh(x @ w), "d") * 2

    return jax.shard_map(local, mesh=_mesh(), in_specs=(P("d"), P()), out_specs=P(),
                         check_vma=False)(x, w)


@op("shard_map_all_gather_invarying", (4, 3), scale=0.5)
def _(x):
    from jax.sharding import PartitionSpec as P

    def local(x):
        return lax.all_gather(jnp.sin(x), "d", tiled=True, to="invarying") * 2

    return _shard_map(local, _mesh(), (P("d"),), P())(x)


@op("shard_map_pvary_pcast", (4, 3), scale=0.5)
def _(x):
    from jax.sharding import PartitionSpec as P

    def local(x, c):
        return x * lax.pcast(jnp.sin(c), "d", to="varying")

    return _shard_map(local, _mesh(), (P("d"), P()), P("d"))(x, x[:1])


@op("shard_map_ragged_all_to_all", (4, 3), scale=0.5, trace_only=(
    "XLA:CPU does not implement ragged-all-to-all (UNIMPLEMENTED: HLO opcode not supported by "
    "XLA:CPU ThunkEmitter): jax.grad cannot run it here either"))
def _(x):
    from jax.sharding import PartitionSpec as P

    def local(x):
        z = jnp.zeros_like(x)
        o = jnp.array([0], jnp.int32)
        n = jnp.array([x.shape[0]], jnp.int32)
        return lax.ragged_all_to_all(jnp.sin(x), z, o, n, o, n, axis_name="d") * 2

    return _shard_map(local, _mesh(), (P("d"),), P("d"))(x)


@op("sharding_explicit_mesh_reshard_auto_axes", (4, 3), scale=0.5,
    context=lambda: jax.set_mesh(_explicit_mesh()))
def _(x):
    from jax.sharding import PartitionSpec as P

    y = jax.sharding.reshard(jnp.sin(x), P("d"))
    z = jax.sharding.auto_axes(lambda v: jnp.tanh(v) * 2, out_sharding=P("d"))(y)
    e = jax.sharding.explicit_axes(lambda v: v * v, in_sharding=P("d"))(z)
    return y * z + e


@op("sharding_layout_constraint", (4, 3))
def _(x):
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(jnp.sin(x), Layout((1, 0))) * x


def _shard_alike(x, y):
    from jax.experimental.shard_alike import shard_alike

    a, b = shard_alike(jnp.sin(x), y * 2)
    return a * b


if importlib.util.find_spec("jax.experimental.shard_alike") is not None:  # not public on 0.12
    op("sharding_shard_alike", (4, 3), (4, 3))(_shard_alike)



# Elementwise primitives jax 0.12.1 added to lax, where the installed JAX has them: programs of
# the corpus (the census's coverage, test_rules' numerics) but not ops of the public-API table
# (`API`, whose bf16/fp16 alternation and input seeds, and the fuzzer's op table, stay the same
# on every release).
if hasattr(lax, "acospi"):
    @program("lax_pi_trigonometry")
    def _():
        def f(x, y):
            return _weigh(lax.acospi(x) + lax.asinpi(x) + lax.atanpi(y) + lax.tanpi(0.5 * x)
                          + lax.atan2pi(x, y + 2.0))
        return f, _args(((3, 4), 11, 0.3), ((3, 4), 12, 0.3))

if hasattr(lax, "exp2m1"):
    @program("lax_exp2m1_log2p1")
    def _():
        return (lambda x: _weigh(lax.exp2m1(x) + lax.log2p1(x * x))), _args(((3, 4), 13, 0.5))

if hasattr(lax, "fma"):
    @program("lax_fma_fmuladd")
    def _():
        def f(x, y, z):
            return _weigh(lax.fma(x, y, z) + lax.fmuladd(y, z, x))
        return f, _args(((3, 4), 14, 1.0), ((3, 4), 15, 1.0), ((3, 4), 16, 1.0))

API = sorted(API_NAMES)
EVERY = sorted(PROGRAMS)
