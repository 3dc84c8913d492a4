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
        PROGRAMS[name] = fn()
        return fn
    return deco


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
    def host_scale(x):
        return np.asarray(x) * 2.0

    def f(x):
        s = jax.pure_callback(host_scale, jax.ShapeDtypeStruct(x.shape, x.dtype),
                              lax.stop_gradient(x))
        return _sum(jnp.sin(x) * s)
    return f, _args(((5,), 64, 1.0))


@jax.custom_vjp
def _host_bwd(x):
    return x


def _host_bwd_bwd(_, g):
    out = jax.pure_callback(lambda g: np.asarray(g) * 3.0,
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


ALL = sorted(PROGRAMS)
