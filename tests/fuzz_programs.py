"""A hypothesis generator of random JAX programs, for hifigrad's fuzz tests (`test_fuzz.py`).

A program is Python source text: a factory ``make(DA, DB, DC, D8)`` that returns
``f(x0, x1, ...)`` (or ``f(p)`` of a dict of them), a function of one to three arrays returning a
scalar. Every dtype in the program is one of the names ``DA``, ``DB``, ``DC``, ``D8`` (or ``F32``),
bound when the factory is called: all float32 for the comparison with `jax.grad`; for the
low-precision comparison, each of DA/DB/DC a draw from bfloat16 / float16 / float32 and D8
float8_e4m3fn (values are rounded through it). Because the program *is* its source, a failing
example is printed as code that can be pasted into a regression test (see ``Program.__repr__``).

Programs compose the ops of the public-API program table (`programs.OPS` in tests/programs.py:
jnp, jax.nn, lax, lax.linalg, scipy.special, fft, image, segment ops, random samplers, sparse,
sharding, refs; the "table" op), elementwise ops, matmuls / einsum / convolution, linear solves,
FFTs (complex intermediates), pooling, reductions and cumulative ops, indexing (slices, gathers,
scatters, dynamic slices), explicit broadcasting, casts between the
dtype names, and nested ``lax.scan`` (with xs, length-only, reversed, unrolled, tuple and integer
carries), ``lax.fori_loop`` with static bounds (reverse-differentiable: it lowers to a scan),
``lax.cond`` / ``lax.switch``, ``jax.checkpoint`` (with policies), ``jax.jit``, ``jax.vmap``,
``jax.custom_jvp``, ``jax.custom_vjp`` (plain, recomputing, up-casting its cotangent to float32 as
in the seed issue, running a ``lax.while_loop`` in its backward), a forward-only ``while_loop``
on non-differentiated values, and a nested ``jax.grad`` (second order).

Values stay in safe ranges: inputs are uniform in [-1, 1] and ops are bounded or mildly growing
(``tanh``, ``sin``, means rather than sums over long axes, scaled matmuls), so that float16 does
not overflow and the gradients compared are meaningful numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from programs import CONTEXT, OPS, TRACE_ONLY, XFAIL

DTYPE_NAMES = ("DA", "DB", "DC")
FACTORY_ARGS = (*DTYPE_NAMES, "D8")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
F32 = jnp.float32


# ------------------------------------------------------------------------------ runtime helpers
# Available to every program (their names are in the namespace the source is executed in).

def W(shape, dtype=jnp.float32):
    """Deterministic non-uniform weights with no zeros, so that the output's cotangent is
    neither all ones nor symmetric (a transposed or permuted gradient would show)."""
    n = math.prod(shape)
    k = np.arange(n)
    w = np.where(k % 2 == 0, 1.0, -1.0) * (0.5 + (k + 1) / (n + 1))
    return jnp.asarray(w.reshape(shape), dtype)


def fit(v, shape, dtype):
    """Brings `v` to `shape` and `dtype` with ordinary differentiable ops: means over extra
    leading axes, new leading axes, broadcasts of size-1 axes, tiling and slicing."""
    shape = tuple(shape)
    while v.ndim > len(shape):
        v = jnp.mean(v, axis=0)
    while v.ndim < len(shape):
        v = v[None]
    for ax, t in enumerate(shape):
        d = v.shape[ax]
        if d == t:
            continue
        if d == 1:
            v = jnp.broadcast_to(v, v.shape[:ax] + (t,) + v.shape[ax + 1:])
            continue
        if d < t:
            v = jnp.concatenate([v] * (-(-t // d)), axis=ax)
        v = lax.slice_in_dim(v, 0, t, axis=ax)
    return v.astype(dtype)


def namespace() -> dict:
    import hifigrad as hg

    ns = {"jax": jax, "jnp": jnp, "lax": lax, "np": np, "W": W, "fit": fit, "F32": F32,
          "checkpoint_name": checkpoint_name, "hg": hg, "OPS": OPS}
    return ns


def build(source: str):
    """Executes a program's source and returns its factory ``make(DA, DB, DC, D8)``."""
    ns = namespace()
    exec(compile(source, "<fuzz program>", "exec"), ns)  # noqa: S102
    return ns["make"]


def make_args(inputs, dtypes: dict, seed: int, scale: float = 1.0):
    """The program's arguments: uniform in [-scale, scale] from `seed`, in each input's dtype
    (``dtypes`` maps the names DA/DB/DC to dtypes)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, name in inputs:
        x = rng.uniform(-scale, scale, size=shape)
        out.append(jnp.asarray(x, dtypes.get(name, F32)))
    return out


# ------------------------------------------------------------------------------ the program

@dataclasses.dataclass(frozen=True)
class Program:
    source: str                    # defines make(DA, DB, DC, D8) -> f
    inputs: tuple                  # ((shape, dtype name), ...)
    dtypes: tuple                  # the low-precision binding: e.g. ("bf16", "f16", "f32")
    seed: int
    n_ops: int                     # operations in the program (nested ones included)
    depth: int                     # deepest nesting of control flow / transforms
    tree: bool = False             # f takes one dict of the inputs (with a None leaf)

    def call_args(self, args):
        """The arguments `f` is called with, and the argnums to differentiate."""
        if self.tree:
            return [{**{f"x{i}": a for i, a in enumerate(args)}, "unused": None}], (0,)
        return list(args), tuple(range(len(args)))

    def binding(self, all_f32: bool = False) -> dict:
        """The dtypes of DA, DB, DC and D8 (an fp8 dtype values are rounded through)."""
        if all_f32:
            return dict.fromkeys(FACTORY_ARGS, jnp.float32)
        return {**{n: DTYPES[d] for n, d in zip(DTYPE_NAMES, self.dtypes)},
                "D8": jnp.float8_e4m3fn}

    def __repr__(self):
        # Pasteable as a regression test body (see tests/test_fuzz.py).
        return (f"\n# dtypes={self.dtypes!r} seed={self.seed} ops={self.n_ops} "
                f"depth={self.depth} tree={self.tree}\n# inputs={self.inputs!r}\n{self.source}")


@dataclasses.dataclass
class V:
    name: str
    shape: tuple
    dt: str  # "DA", "DB", "DC", "F32" or "I32" (an integer index)

    @property
    def ndim(self):
        return len(self.shape)


def _prod(shape):
    return math.prod(shape)


UNARY = [
    "jnp.tanh({0})", "jnp.sin({0})", "({0} * jnp.tanh({0}))", "jnp.cos({0})",
    "jax.nn.sigmoid({0})", "(-{0})", "jnp.exp(jnp.tanh({0}))", "jnp.log1p({0} * {0})",
    "jnp.sqrt({0} * {0} + 1)", "lax.rsqrt({0} * {0} + 1)", "({0} / (2 + jnp.cos({0})))",
    "jax.nn.relu({0})", "jax.nn.gelu({0})", "jax.nn.silu({0})", "jax.nn.softplus({0})",
    "jnp.abs({0})", "lax.integer_pow(jnp.tanh({0}), 3)", "jnp.arctan({0})", "lax.erf({0})",
    "jnp.expm1(jnp.tanh({0}))", "jnp.clip({0}, -0.5, 0.5)", "jnp.where({0} > 0, {0}, 0.25 * {0})",
    "jnp.log(2 + jnp.sin({0}))", "jnp.sinh(jnp.tanh({0}))", "jnp.square({0})",
    "({0} * 0.5 + 0.25)", "lax.stop_gradient({0})", "jnp.arcsinh({0})", "jax.nn.elu({0})",
    "lax.reduce_precision({0}, exponent_bits=5, mantissa_bits=7)",
    "{0}.astype(D8).astype({0}.dtype)",
    "checkpoint_name({0}, 'saved')",
]
BINARY = [
    "({0} + {1})", "({0} - {1}) * 0.5", "({0} * jnp.tanh({1}))", "jnp.maximum({0}, {1})",
    "jnp.minimum({0}, {1})", "({0} / (1.5 + {1} * {1}))", "({0} * {1})",
    "jnp.arctan2({0}, 2 + jnp.cos({1}))", "jnp.where({1} > 0, {0}, {1})",
]
REDUCE = [
    "jnp.mean({0}, axis={ax})", "jnp.sum({0}, axis={ax})", "jnp.max({0}, axis={ax})",
    "jax.nn.logsumexp({0}, axis={ax})", "jnp.prod(1 + 0.25 * jnp.tanh({0}), axis={ax})",
    "jnp.min({0}, axis={ax})", "jnp.var({0}, axis={ax})", "jnp.linalg.norm({0} + 2, axis={ax})",
]
SCAN_LIKE = [
    "jnp.cumsum({0}, axis={ax})", "jax.nn.softmax({0}, axis={ax})", "lax.cummax({0}, axis={ax})",
    "jnp.cumprod(1 + 0.25 * jnp.tanh({0}), axis={ax})", "jnp.sort({0}, axis={ax})",
    "lax.cumlogsumexp({0}, axis={ax})", "jnp.flip({0}, axis={ax})", "jnp.roll({0}, 1, axis={ax})",
    "jax.nn.log_softmax({0}, axis={ax})", "lax.cummin({0}, axis={ax})",
    "lax.associative_scan(jnp.add, {0}, axis={ax})",
    "lax.associative_scan(jnp.maximum, {0}, axis={ax})",
]
CKPT_POLICIES = [
    "None", "jax.checkpoint_policies.nothing_saveable", "jax.checkpoint_policies.dots_saveable",
    "jax.checkpoint_policies.everything_saveable",
    "jax.checkpoint_policies.save_only_these_names('saved')",
]

# Operation kinds, simplest first (hypothesis shrinks towards the start of the list).
LEAF_OPS = ["unary", "binary", "reduce", "cast", "matmul", "structural", "index", "cumulative",
            "scatter", "broadcast", "while_fwd", "pool", "linalg", "fft", "table"]
NEST_OPS = ["scan", "fori", "cond", "checkpoint", "custom_vjp", "custom_jvp", "jit", "vmap",
            "switch", "scan_len", "inner_grad", "hg_checkpoint", "hg_scan", "hg_precise"]
CODECS = ["none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]


def _jax_version():
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def _known_failure(name) -> bool:
    when = XFAIL[name][0] if name in XFAIL else None
    return when is not None and any(when(_jax_version(), d, j) for d in ("bf16", "fp16")
                                    for j in (False, True))


# The ops of the public-API program table (tests/programs.py `OPS`) that are not marked as known
# failures on this JAX version, run on this machine and need no context (a mesh) around jax.jit:
# the "table" leaf op draws from them.
TABLE_OPS = tuple(n for n in sorted(OPS)
                  if not _known_failure(n) and n not in CONTEXT and n not in TRACE_ONLY)


@functools.cache
def table_out_shape(name) -> tuple:
    op = OPS[name]
    out = jax.eval_shape(op.fn, *[jax.ShapeDtypeStruct(s, F32) for s in op.shapes])
    return tuple(out.shape)


class _Gen:
    def __init__(self, draw, max_depth: int, max_ops: int):
        self.draw = draw
        self.max_depth = max_depth
        self.max_ops = max_ops
        self.count = 0
        self.n_ops = 0
        self.deepest = 0

    # ---------------------------------------------------------------- helpers
    def name(self, prefix="v"):
        self.count += 1
        return f"{prefix}{self.count}"

    def pick(self, pool, pred=lambda v: True):
        cands = [v for v in pool if v.dt != "I32" and pred(v)]
        if not cands:
            return None
        # Prefer recent values (deeper programs), but allow any.
        i = self.draw(st.integers(0, len(cands) - 1))
        return cands[len(cands) - 1 - i]

    def dtname(self):
        return self.draw(st.sampled_from(DTYPE_NAMES))

    def shape(self, max_rank=2):
        rank = self.draw(st.integers(0, max_rank))
        return tuple(self.draw(st.integers(1, 4)) for _ in range(rank))

    @staticmethod
    def fit(v: V, shape, dt):
        if tuple(v.shape) == tuple(shape) and v.dt == dt:
            return v.name
        if tuple(v.shape) == tuple(shape):
            return f"{v.name}.astype({dt})"
        return f"fit({v.name}, {tuple(shape)!r}, {dt})"

    def same_as(self, v: V, other: V) -> str:
        """`other` in `v`'s shape and dtype."""
        return self.fit(other, v.shape, v.dt)

    # ---------------------------------------------------------------- blocks
    def block(self, pool, depth, n_ops):
        """A block of up to `n_ops` random ops over `pool` (the values in scope). Returns
        (lines, the values it assigned)."""
        pool = list(pool)
        lines: list[str] = []
        new_vals: list[V] = []
        self.deepest = max(self.deepest, depth)
        for _ in range(n_ops):
            if self.n_ops >= self.max_ops:
                break
            nest = depth < self.max_depth and self.draw(st.integers(0, 3)) == 0
            kind = self.draw(st.sampled_from(NEST_OPS if nest else LEAF_OPS))
            self.n_ops += 1
            nl, nv = getattr(self, "op_" + kind)(pool, depth)
            lines += nl
            pool += nv
            new_vals += [v for v in nv if v.dt != "I32"]
        return lines, new_vals

    def block_out(self, pool, depth, n_ops, out_shape, out_dt):
        """A block whose result (its last value, or a value in scope when it assigned none)
        is brought to out_shape/out_dt. Returns (lines, result expression)."""
        lines, vals = self.block(pool, depth, n_ops)
        last = vals[-1] if vals else self.pick(pool)
        return lines, self.fit(last, out_shape, out_dt)

    def sub_function(self, fname, params, pool, depth, out_shape, out_dt, closure=True,
                     n_ops=None):
        """Source of `def fname(*params)` whose body is a random block returning a value of
        out_shape/out_dt. `params` are V's; with closure, outer `pool` values are in scope."""
        if n_ops is None:
            n_ops = self.draw(st.integers(1, 3))
        inner = [*(pool if closure else []), *params]
        lines, out = self.block_out(inner, depth + 1, n_ops, out_shape, out_dt)
        head = f"def {fname}({', '.join(p.name for p in params)}):"
        return [head] + ["    " + ln for ln in lines + [f"return {out}"]]

    # ---------------------------------------------------------------- leaf ops
    def op_unary(self, pool, depth):
        v = self.pick(pool)
        t = self.draw(st.sampled_from(UNARY))
        out = V(self.name(), v.shape, v.dt)
        return [f"{out.name} = {t.format(v.name)}"], [out]

    def op_binary(self, pool, depth):
        a, b = self.pick(pool), self.pick(pool)
        t = self.draw(st.sampled_from(BINARY))
        out = V(self.name(), a.shape, a.dt)
        return [f"{out.name} = {t.format(a.name, self.same_as(a, b))}"], [out]

    def op_cast(self, pool, depth):
        v = self.pick(pool)
        dt = self.draw(st.sampled_from(DTYPE_NAMES + ("F32",)))
        out = V(self.name(), v.shape, dt)
        return [f"{out.name} = {v.name}.astype({dt})"], [out]

    def op_reduce(self, pool, depth):
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        ax = self.draw(st.integers(0, v.ndim - 1))
        t = self.draw(st.sampled_from(REDUCE))
        out = V(self.name(), v.shape[:ax] + v.shape[ax + 1:], v.dt)
        return [f"{out.name} = {t.format(v.name, ax=ax)}"], [out]

    def op_cumulative(self, pool, depth):
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        ax = self.draw(st.integers(0, v.ndim - 1))
        t = self.draw(st.sampled_from(SCAN_LIKE))
        out = V(self.name(), v.shape, v.dt)
        return [f"{out.name} = {t.format(v.name, ax=ax)}"], [out]

    def op_matmul(self, pool, depth):
        a = self.pick(pool, lambda v: 1 <= v.ndim <= 2)
        if a is None:
            return self.op_unary(pool, depth)
        b = self.pick(pool)
        k = a.shape[-1]
        kind = self.draw(st.integers(0, 4))
        if kind == 4 and a.ndim == 1:  # 1-D convolution ('same': a kernel no longer than a)
            m = self.draw(st.integers(1, min(3, a.shape[0])))
            b_expr = self.fit(b, (m,), a.dt)
            out = V(self.name(), a.shape, a.dt)
            return [f"{out.name} = jnp.convolve({a.name}, {b_expr}, mode='same')"], [out]
        n = self.draw(st.integers(1, 4))
        vec = self.draw(st.booleans())
        bshape = (k,) if vec else (k, n)
        b_expr = self.fit(b, bshape, a.dt)
        oshape = a.shape[:-1] + bshape[1:]
        scale = f" * {1 / k!r}" if k > 1 else ""
        if kind == 1:
            out = V(self.name(), oshape, "F32")
            line = f"jnp.matmul({a.name}, {b_expr}, preferred_element_type=F32){scale}"
        elif kind == 2 and a.ndim == 2 and not vec:
            out = V(self.name(), oshape, a.dt)
            line = f"jnp.einsum('ij,jk->ik', {a.name}, {b_expr}){scale}"
        elif kind == 3:
            out = V(self.name(), oshape, a.dt)
            line = f"jnp.tanh({a.name} @ {b_expr})"
        else:
            out = V(self.name(), oshape, a.dt)
            line = f"({a.name} @ {b_expr}){scale}"
        return [f"{out.name} = {line}"], [out]

    def op_structural(self, pool, depth):
        v = self.pick(pool)
        kind = self.draw(st.integers(0, 5))
        if v.ndim == 2 and kind == 0:
            out = V(self.name(), v.shape[::-1], v.dt)
            return [f"{out.name} = {v.name}.T"], [out]
        if v.ndim == 2 and kind == 1:
            out = V(self.name(), (_prod(v.shape),), v.dt)
            return [f"{out.name} = {v.name}.reshape(-1)"], [out]
        if v.ndim == 1 and kind <= 1:
            n = v.shape[0]
            p = self.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
            out = V(self.name(), (p, n // p), v.dt)
            return [f"{out.name} = {v.name}.reshape({p}, {n // p})"], [out]
        if v.ndim >= 1 and kind == 2 and v.shape[0] > 1:
            out = V(self.name(), (v.shape[0] - 1,) + v.shape[1:], v.dt)
            return [f"{out.name} = {v.name}[1:]"], [out]
        if v.ndim >= 1 and kind == 3:
            b = self.pick(pool)
            out = V(self.name(), (2 * v.shape[0],) + v.shape[1:], v.dt)
            return [f"{out.name} = jnp.concatenate([{v.name}, {self.same_as(v, b)}], axis=0)"
                    ], [out]
        if v.ndim >= 1 and kind == 4:
            pads = [(1, 0)] + [(0, 0)] * (v.ndim - 1)
            out = V(self.name(), (v.shape[0] + 1,) + v.shape[1:], v.dt)
            return [f"{out.name} = jnp.pad({v.name}, {pads!r})"], [out]
        if v.ndim <= 1:
            out = V(self.name(), (1,) + v.shape, v.dt)
            return [f"{out.name} = {v.name}[None]"], [out]
        k = self.draw(st.integers(1, v.shape[-1]))
        out = V(self.name(), v.shape[:-1] + (k,), v.dt)
        return [f"{out.name} = lax.top_k({v.name}, {k})[0]"], [out]

    def op_index(self, pool, depth):
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        n = v.shape[0]
        kind = self.draw(st.integers(0, 3))
        idx_vars = [u for u in pool if u.dt == "I32"]
        if kind == 0:
            m = self.draw(st.integers(1, 4))
            idx = [self.draw(st.integers(0, n - 1)) for _ in range(m)]
            out = V(self.name(), (m,) + v.shape[1:], v.dt)
            return [f"{out.name} = {v.name}[jnp.array({idx!r})]"], [out]
        if kind == 1:
            i = self.draw(st.integers(0, n - 1))
            out = V(self.name(), v.shape[1:], v.dt)
            return [f"{out.name} = {v.name}[{i}]"], [out]
        if kind == 2 and idx_vars:  # dynamic index with a loop counter
            i = idx_vars[-1]
            out = V(self.name(), v.shape[1:], v.dt)
            return [f"{out.name} = lax.dynamic_index_in_dim({v.name}, {i.name} % {n}, "
                    f"keepdims=False)"], [out]
        if kind == 2:  # an index computed from data
            u = self.pick(pool)
            out = V(self.name(), v.shape[1:], v.dt)
            return [f"{out.name} = {v.name}[jnp.argmax({u.name}) % {n}]"], [out]
        size = self.draw(st.integers(1, n))
        start = self.draw(st.integers(0, n - size))
        out = V(self.name(), (size,) + v.shape[1:], v.dt)
        return [f"{out.name} = lax.dynamic_slice_in_dim({v.name}, {start}, {size}, axis=0)"], [out]

    def op_scatter(self, pool, depth):
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        u = self.pick(pool)
        n = v.shape[0]
        kind = self.draw(st.integers(0, 2))
        out = V(self.name(), v.shape, v.dt)
        if kind == 2:
            size = self.draw(st.integers(1, n))
            start = self.draw(st.integers(0, n - size))
            upd = self.fit(u, (size,) + v.shape[1:], v.dt)
            return [f"{out.name} = lax.dynamic_update_slice_in_dim({v.name}, {upd}, {start}, "
                    f"axis=0)"], [out]
        m = self.draw(st.integers(1, 3))
        idx = [self.draw(st.integers(0, n - 1)) for _ in range(m)]
        if kind == 1:
            idx = sorted(set(idx))
        upd = self.fit(u, (len(idx),) + v.shape[1:], v.dt)
        meth = "add" if kind == 0 else "set"
        return [f"{out.name} = {v.name}.at[jnp.array({idx!r})].{meth}({upd})"], [out]

    def op_broadcast(self, pool, depth):
        a = self.pick(pool, lambda v: v.ndim <= 1)
        if a is None:
            return self.op_unary(pool, depth)
        b = self.pick(pool, lambda v: v.ndim <= 1)
        if a.ndim == 1 and b.ndim == 1:  # outer product
            out = V(self.name(), (a.shape[0], b.shape[0]), a.dt)
            bx = b.name if b.dt == a.dt else f"{b.name}.astype({a.dt})"
            return [f"{out.name} = {a.name}[:, None] * {bx}[None, :]"], [out]
        n = self.draw(st.integers(1, 4))
        if a.ndim == 0:
            out = V(self.name(), (n,), a.dt)
            return [f"{out.name} = jnp.broadcast_to({a.name}, ({n},))"], [out]
        out = V(self.name(), (n, a.shape[0]), a.dt)
        return [f"{out.name} = jnp.broadcast_to({a.name}[None, :], {out.shape!r})"], [out]

    def op_while_fwd(self, pool, depth):
        """A forward-only while_loop on a non-differentiated value, used as a multiplier."""
        v = self.pick(pool)
        u = self.pick(pool)
        k = self.draw(st.integers(0, 3))
        m, out = self.name("m"), V(self.name(), u.shape, u.dt)
        return [
            f"{m} = lax.while_loop(lambda s: s[0] < {k}, lambda s: (s[0] + 1, jnp.cos(s[1])), "
            f"(0, jnp.mean(lax.stop_gradient({v.name})).astype(F32)))[1]",
            f"{out.name} = {u.name} * {m}.astype({u.dt})",
        ], [out]

    def op_pool(self, pool, depth):
        """Windowed reductions (pooling) along the first axis."""
        v = self.pick(pool, lambda v: v.ndim >= 1 and v.shape[0] >= 2)
        if v is None:
            return self.op_unary(pool, depth)
        win = (2,) + (1,) * (v.ndim - 1)
        out = V(self.name(), (v.shape[0] - 1,) + v.shape[1:], v.dt)
        if self.draw(st.booleans()):
            line = (f"lax.reduce_window({v.name}, -jnp.inf, lax.max, {win!r}, "
                    f"{(1,) * v.ndim!r}, 'VALID')")
        else:
            line = (f"lax.reduce_window({v.name}, 0.0, lax.add, {win!r}, {(1,) * v.ndim!r}, "
                    f"'VALID') * 0.5")
        return [f"{out.name} = {line}"], [out]

    def op_linalg(self, pool, depth):
        """A well-conditioned linear solve (in float32: LAPACK has no bf16/fp16 kernels)."""
        a, b = self.pick(pool), self.pick(pool)
        n = self.draw(st.integers(1, 3))
        m = self.name("m")
        out = V(self.name(), (n,), "F32")
        return [f"{m} = {self.fit(a, (n, n), 'F32')}",
                f"{out.name} = jnp.linalg.solve({m} @ {m}.T * 0.25 + 2 * jnp.eye({n}, "
                f"dtype=F32), {self.fit(b, (n,), 'F32')})"], [out]

    def op_table(self, pool, depth, name=None):
        """An op of the public-API program table (`programs.OPS`): its inputs fitted to the
        op's shapes in one drawn dtype name, its output brought to rank <= 2 in that dtype."""
        if name is None:
            name = self.draw(st.sampled_from(TABLE_OPS))
        op = OPS[name]
        dt = self.dtname()
        args = ", ".join(self.fit(self.pick(pool), s, dt) for s in op.shapes)
        shape = table_out_shape(name)
        out = V(self.name(), shape[-2:], dt)
        return [f"{out.name} = fit(OPS[{name!r}].fn({args}), {out.shape!r}, {dt})"], [out]

    def op_fft(self, pool, depth):
        """Complex intermediates: an FFT round trip (complex64 values are never promoted)."""
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        n = v.shape[-1]
        out = V(self.name(), v.shape, v.dt)
        if self.draw(st.booleans()):
            line = (f"jnp.fft.irfft(jnp.fft.rfft({v.name}.astype(F32)) * (0.5 + 0.25j), "
                    f"n={n}).astype({v.dt})")
        else:
            fv = self.name("z")
            return [f"{fv} = jnp.fft.fft({v.name}.astype(jnp.complex64))",
                    f"{out.name} = (jnp.real({fv} * jnp.conj({fv})) * {1 / n!r}).astype({v.dt})"
                    ], [out]
        return [f"{out.name} = {line}"], [out]

    # ---------------------------------------------------------------- nested ops
    def op_scan(self, pool, depth):
        xs = self.pick(pool, lambda v: v.ndim >= 1)
        if xs is None:
            return self.op_unary(pool, depth)
        return self._scan(pool, depth, xs)

    def op_scan_len(self, pool, depth):
        return self._scan(pool, depth, None)

    def op_hg_scan(self, pool, depth):
        """hifigrad's scan: carries saved encoded, steps recomputed in the backward."""
        xs = self.pick(pool, lambda v: v.ndim >= 1) if self.draw(st.booleans()) else None
        return self._scan(pool, depth, xs, codec=self.draw(st.sampled_from(CODECS)))

    def _scan(self, pool, depth, xs, codec=None):
        srcs = [self.pick(pool)]
        if self.draw(st.booleans()):
            srcs.append(self.pick(pool))
        # carries: the first keeps its source's dtype, a second one gets a drawn dtype
        cs = [V(self.name("c"), s.shape, s.dt if i == 0 else self.dtname())
              for i, s in enumerate(srcs)]
        k = V(self.name("k"), (), "I32") if self.draw(st.booleans()) else None
        x = V(self.name("e"), xs.shape[1:], xs.dt) if xs is not None else None
        length = xs.shape[0] if xs is not None else self.draw(st.integers(1, 4))
        inner = [*pool, *cs] + ([k] if k else []) + ([x] if x else [])
        lines, vals = self.block(inner, depth + 1, self.draw(st.integers(1, 3)))
        # each new carry from a value of the block or in scope (a carry may pass unchanged)
        new_c = [self.fit(self.pick(vals) if vals and self.draw(st.integers(0, 3)) else
                          self.pick(inner), c.shape, c.dt) for c in cs]
        y = vals[-1] if vals and self.draw(st.booleans()) else None
        yshape = None if y is None else (y.shape[-1:] if y.ndim > 1 else y.shape)
        tup = lambda xs: "(" + ", ".join(xs) + ("," if len(xs) == 1 else "") + ")"
        carry_in = tup([c.name for c in cs])
        carry_out = tup(new_c)
        if k:
            carry_in, carry_out = f"({carry_in}, {k.name})", f"({carry_out}, {k.name} + 1)"
        f = self.name("body")
        body = [f"def {f}(carry, {x.name if x else '_'}):", f"    {carry_in} = carry"]
        body += ["    " + ln for ln in lines]
        y_expr = "None" if y is None else self.fit(y, yshape, y.dt)
        body += [f"    return {carry_out}, {y_expr}"]
        init = tup([self.fit(s, c.shape, c.dt) for s, c in zip(srcs, cs)])
        if k:
            init = f"({init}, jnp.int32(0))"
        out_c = [V(self.name(), c.shape, c.dt) for c in cs]
        ys = None if y is None else V(self.name(), (length,) + yshape, y.dt)
        lhs = tup([c.name for c in out_c])
        if k:
            lhs = f"({lhs}, _)"
        lhs = f"{lhs}, {ys.name if ys else '_'}"
        extra = f", length={length}" if xs is None else ""
        if self.draw(st.booleans()):
            extra += ", reverse=True"
        if self.draw(st.booleans()):
            extra += ", unroll=2"
        if codec is not None:
            extra += f", codec={codec!r}"
        fn = "lax.scan" if codec is None else "hg.scan"
        call = f"{lhs} = {fn}({f}, {init}, {xs.name if xs else 'None'}{extra})"
        return body + [call], out_c + ([ys] if ys else [])

    def op_fori(self, pool, depth):
        c0 = self.pick(pool)
        n = self.draw(st.integers(1, 4))
        f, i = self.name("body"), V(self.name("i"), (), "I32")
        c = V(self.name("c"), c0.shape, c0.dt)
        lines, out = self.block_out([*pool, i, c], depth + 1, self.draw(st.integers(1, 3)),
                                    c.shape, c.dt)
        body = [f"def {f}({i.name}, {c.name}):"] + ["    " + ln for ln in lines]
        body += [f"    return {out}"]
        res = V(self.name(), c.shape, c.dt)
        return body + [f"{res.name} = lax.fori_loop(0, {n}, {f}, {c0.name})"], [res]

    def op_cond(self, pool, depth):
        p = self.pick(pool)
        ops = [self.pick(pool)]
        if self.draw(st.booleans()):
            ops.append(self.pick(pool))
        params = [V(self.name("o"), o.shape, o.dt) for o in ops]
        oshape, odt = ops[0].shape, ops[0].dt
        fa, fb = self.name("br"), self.name("br")
        la = self.sub_function(fa, params, pool, depth, oshape, odt)
        lb = self.sub_function(fb, params, pool, depth, oshape, odt)
        out = V(self.name(), oshape, odt)
        args = ", ".join(o.name for o in ops)
        return la + lb + [
            f"{out.name} = lax.cond(jnp.sum({p.name}) > 0, {fa}, {fb}, {args})"], [out]

    def op_switch(self, pool, depth):
        p = self.pick(pool)
        o = self.pick(pool)
        param = V(self.name("o"), o.shape, o.dt)
        names = [self.name("br") for _ in range(3)]
        lines = []
        for nm in names:
            lines += self.sub_function(nm, [param], pool, depth, o.shape, o.dt)
        out = V(self.name(), o.shape, o.dt)
        idx = (f"(jnp.sum({p.name}) > 0).astype(jnp.int32) + "
               f"(jnp.max({p.name}) > 0.5).astype(jnp.int32)")
        return lines + [f"{out.name} = lax.switch({idx}, [{', '.join(names)}], {o.name})"], [out]

    def _call_like(self, pool, depth, closure=True, max_args=2):
        """A sub-function of 1..max_args pool values; returns (fname, lines, args, out V)."""
        nargs = self.draw(st.integers(1, max_args))
        args = [self.pick(pool) for _ in range(nargs)]
        params = [V(self.name("a"), a.shape, a.dt) for a in args]
        oshape = self.shape()
        odt = self.draw(st.sampled_from([a.dt for a in args]))
        fname = self.name("fn")
        lines = self.sub_function(fname, params, pool, depth, oshape, odt, closure=closure)
        return fname, lines, args, V(self.name(), oshape, odt)

    def _wrapped_call(self, pool, depth, wrapper):
        """``out = <wrapper(fname)>(args)`` for a new sub-function; `wrapper` may draw."""
        fname, lines, args, out = self._call_like(pool, depth)
        w = wrapper(fname)
        a = ", ".join(x.name for x in args)
        return lines + [f"{out.name} = {w}({a})"], [out]

    def op_checkpoint(self, pool, depth):
        return self._wrapped_call(pool, depth, lambda f: (
            f"jax.checkpoint({f}, policy={self.draw(st.sampled_from(CKPT_POLICIES))})"))

    def op_jit(self, pool, depth):
        return self._wrapped_call(pool, depth, lambda f: f"jax.jit({f})")

    def op_hg_checkpoint(self, pool, depth):
        return self._wrapped_call(pool, depth, lambda f: (
            f"hg.checkpoint({f}, codec={self.draw(st.sampled_from(CODECS))!r})"))

    def op_hg_precise(self, pool, depth):
        return self._wrapped_call(pool, depth, lambda f: f"hg.precise_backward({f})")

    def op_vmap(self, pool, depth):
        v = self.pick(pool, lambda v: v.ndim >= 1)
        if v is None:
            return self.op_unary(pool, depth)
        param = V(self.name("a"), v.shape[1:], v.dt)
        oshape = self.shape(max_rank=1)
        fname = self.name("fn")
        lines = self.sub_function(fname, [param], pool, depth, oshape, v.dt)
        out = V(self.name(), (v.shape[0],) + oshape, v.dt)
        return lines + [f"{out.name} = jax.vmap({fname})({v.name})"], [out]

    def op_custom_jvp(self, pool, depth):
        fname, lines, args, out = self._call_like(pool, depth, closure=False)
        cj = self.name("cj")
        a = ", ".join(x.name for x in args)
        return lines + [
            f"{cj} = jax.custom_jvp({fname})",
            f"{cj}.defjvp(lambda p, t: jax.jvp({fname}, p, t))",
            f"{out.name} = {cj}({a})",
        ], [out]

    def op_custom_vjp(self, pool, depth):
        fname, lines, args, out = self._call_like(pool, depth, closure=False)
        cv = self.name("cv")
        a = ", ".join(x.name for x in args)
        kind = self.draw(st.integers(0, 3))
        if kind == 1:  # recompute in the backward
            fwd = f"lambda *a: ({fname}(*a), a)"
            bwd = f"lambda a, g: jax.vjp({fname}, *a)[1](g)"
        else:
            fwd = f"lambda *a: jax.vjp({fname}, *a)"
            if kind == 0:
                bwd = "lambda vjp, g: vjp(g)"
            elif kind == 2:  # the seed's pattern: a float32 cotangent for a low-precision input
                bwd = "lambda vjp, g: tuple(c.astype(F32) for c in vjp(g))"
            else:  # a while_loop in the backward (exact: scales by 2**k then 2**-k)
                k = self.draw(st.integers(0, 3))
                bwd = (f"lambda vjp, g: vjp(lax.while_loop(lambda s: s[0] < {k}, "
                       f"lambda s: (s[0] + 1, s[1] * 2), (0, g))[1] * {2.0 ** -k!r})")
        return lines + [
            f"{cv} = jax.custom_vjp({fname})",
            f"{cv}.defvjp({fwd}, {bwd})",
            f"{out.name} = {cv}({a})",
        ], [out]

    def op_inner_grad(self, pool, depth):
        """A nested jax.grad: the program's gradient is a second derivative."""
        v = self.pick(pool)
        param = V(self.name("a"), v.shape, v.dt)
        fname = self.name("fn")
        lines = self.sub_function(fname, [param], pool, depth, (), "F32", closure=False,
                                  n_ops=self.draw(st.integers(1, 2)))
        out = V(self.name(), v.shape, v.dt)
        return lines + [f"{out.name} = jnp.tanh(jax.grad({fname})({v.name}))"], [out]


@st.composite
def programs(draw, max_depth: int = 2, max_ops: int = 10, max_inputs: int = 3,
             dtypes=None, table_op=None):
    """A random `Program`. ``dtypes``: a fixed binding for DA/DB/DC, or drawn. ``table_op``: a
    name of `programs.OPS` that the program applies first (to its inputs)."""
    gen = _Gen(draw, max_depth, max_ops)
    n_in = draw(st.integers(1, max_inputs))
    inputs = []
    params = []
    for i in range(n_in):
        shape = gen.shape()
        dt = draw(st.sampled_from(DTYPE_NAMES))
        inputs.append((shape, dt))
        params.append(V(f"x{i}", shape, dt))
    n_ops = draw(st.integers(1, max_ops))
    lines, vals = [], []
    if table_op is not None:
        gen.n_ops += 1
        lines, vals = gen.op_table(params, 0, name=table_op)
    more_lines, more_vals = gen.block(params + vals, 0, n_ops)
    lines, vals = lines + more_lines, vals + more_vals
    # The output: a weighted sum of the last value and, maybe, others (all inputs reach it
    # through some path when they are used; unused inputs get zero gradients).
    outs = [vals[-1]] if vals else [params[-1]]
    if draw(st.booleans()):
        outs.append(gen.pick(params + vals))
    terms = []
    for v in outs:
        if draw(st.booleans()):
            terms.append(f"jnp.sum({v.name}.astype(F32) * W({v.shape!r}))")
        else:
            terms.append(f"jnp.sum({v.name} * W({v.shape!r}, {v.dt})).astype(F32)")
    lines.append("return " + " + ".join(terms))
    tree = draw(st.booleans())
    names = ", ".join(p.name for p in params)
    if tree:
        unpack = ", ".join(f'p["{p.name}"]' for p in params)
        head = ["def f(p):", f"    {names} = {unpack}"]
    else:
        head = [f"def f({names}):"]
    body = "\n".join(head + ["    " + ln for ln in lines])
    source = "def make(DA, DB, DC, D8):\n" + textwrap.indent(body, "    ") + "\n    return f\n"
    if dtypes is None:
        dtypes = tuple(draw(st.sampled_from(sorted(DTYPES))) for _ in DTYPE_NAMES)
    seed = draw(st.integers(0, 2 ** 16))
    return Program(source=source, inputs=tuple(inputs), dtypes=tuple(dtypes), seed=seed,
                   n_ops=gen.n_ops, depth=gen.deepest, tree=tree)
