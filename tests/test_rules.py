"""The rule table against `jax.grad`, over a table of programs covering every construct.

With float32 primals and tangent dtype float32 nothing is promoted, so `hg.grad` must equal
`jax.grad` (rtol 1e-6: the same operations, at most reassociated by a different jaxpr; run in
`platforms.highest_precision()`, since on an NVIDIA GPU a reassociated float32 operand of a
default-precision matmul can round to a TF32 value 2**-10 away). With bf16
primals every rule runs in promotion; the gradient must be float32 and match the float32 model's
gradient to within the forward's bf16 rounding (cosine similarity >= 0.99: each forward op rounds
to 2^-9 relative, and these programs have at most a few dozen ops on any path).

CPU-only claims (`platforms.cpu_only`):

| test | why only on XLA:CPU |
| --- | --- |
| `test_mutable_refs_are_discharged` | ref program vs pure rewrite: 1e-6 if no excess precision |

(Measured: fails under jit with ``XLA_FLAGS=--xla_allow_excess_precision=true``.)
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from lanes import turn
from platforms import cpu_only, highest_precision
from programs import ALL, PROGRAMS

import hifigrad as hg
from hifigrad._src import interpreter
from hifigrad._src.rules import PROMOTE


def _argnums(args):
    def floating(a):
        return all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree_util.tree_leaves(a))
    return tuple(i for i, a in enumerate(args) if floating(a))


def _leaves(t):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]


def test_table_is_large_enough():
    assert len(ALL) >= 40


# Programs whose f32 version contains an explicit bf16 section: there hg is *meant* to differ
# from jax.grad (it runs that section's backward in f32); checked in test_api instead.
_INTERNAL_LOW_PRECISION = {"mixed_precision_casts"}


# Each program runs jitted in float32, bf16 and fp16, and eagerly in one of the three, taken in
# turn along the table (the other eager runs are `slow`). The rules a program runs are traced
# the same way eagerly and under jit (an eager backward program is traced once, then evaluated
# op by op: `api._backward`), so eagerly in another dtype differs from jitted in that dtype
# only by evaluating JAX's own ops one at a time.
_EAGER_DTYPE = {name: "bf16" if name in _INTERNAL_LOW_PRECISION else ("f32", "bf16", "fp16")[i % 3]
                for i, name in enumerate(ALL)}
# The jitted float32 gradients (hg.grad's, jax.grad's) test_f32_equals_jax_grad computed, by
# program: test_report_bitwise_equal_count counts on them instead of compiling both again.
_F32_JIT: dict = {}


def _jit_params(names, dname):
    return [pytest.param(name, jit, id=f"{'jit' if jit else 'eager'}-{name}",
                         marks=[] if jit or _EAGER_DTYPE[name] == dname else [pytest.mark.slow])
            for name in names for jit in (False, True)]


@pytest.mark.parametrize(("name", "jit"), _jit_params(
    [n for n in ALL if n not in _INTERNAL_LOW_PRECISION], "f32"))
def test_f32_equals_jax_grad(name, jit):
    fun, make = PROGRAMS[name]
    args = make(jnp.float32)
    nums = _argnums(args)
    maybe_jit = jax.jit if jit else (lambda f: f)
    with highest_precision():  # f32 vs f32 to 1e-6: no TF32 (module docstring)
        got = maybe_jit(hg.grad(fun, argnums=nums))(*args)
        want = maybe_jit(jax.grad(fun, argnums=nums))(*args)
    if jit:
        _F32_JIT[name] = (got, want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * float(
            np.max(np.abs(np.asarray(w))) + 1e-30))


def test_report_bitwise_equal_count(capsys):
    """Reports how many of the table's programs give bitwise-equal gradients (jit): those
    test_f32_equals_jax_grad computed, the others (not selected, or failed) computed here."""
    equal = 0
    names = [n for n in ALL if n not in _INTERNAL_LOW_PRECISION]
    for name in names:
        if name in _F32_JIT:
            got, want = _F32_JIT[name]
        else:
            fun, make = PROGRAMS[name]
            args = make(jnp.float32)
            nums = _argnums(args)
            got = jax.jit(hg.grad(fun, argnums=nums))(*args)
            want = jax.jit(jax.grad(fun, argnums=nums))(*args)
        equal += all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                     zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    with capsys.disabled():
        print(f"\n[hifigrad] bitwise-equal gradients: {equal}/{len(names)} programs (jit, f32)")
    assert equal >= len(names) // 2


def _low_precision_params():
    """Every program in bf16 and fp16, jitted and eagerly. The default suite runs half of the
    programs jitted, each in one of the two dtypes, alternating along the table, in pairs (a
    bf16 one and an fp16 one), which pairs and which dtype depending on the lane
    (tests/lanes.py: each CI lane's are its own; issue 48 halved the programs: 133 of the
    default suite's 2276 s on jax 0.10.2), and eagerly in its `_EAGER_DTYPE` (in turn,
    tests/conftest.py); the other runs are `slow`. Both dtypes run in every lane, each on a
    quarter of the programs; the `slow` tier runs every combination, and every program's rules
    run in float32 in every lane (`test_f32_equals_jax_grad`)."""
    out = []
    for i, name in enumerate(ALL):
        jitted = ("bf16", "fp16")[turn(i, 2)] if turn(i // 2, 2) == 0 else None
        for dname, dtype in (("bf16", jnp.bfloat16), ("fp16", jnp.float16)):
            for jit in (False, True):
                default = dname == jitted if jit else _EAGER_DTYPE[name] == dname
                marks = [] if default else [pytest.mark.slow]
                out.append(pytest.param(name, dtype, jit, marks=marks,
                                        id=f"{'jit' if jit else 'eager'}-{dname}-{name}"))
    return out


_REF_F32: dict = {}


def _f32_reference(name):
    """jax.grad of the float32 program (eager, as the test computed it before), shared by the
    program's four low-precision runs."""
    if name not in _REF_F32:
        fun, make = PROGRAMS[name]
        ref_args = make(jnp.float32)
        _REF_F32[name] = jax.grad(fun, argnums=_argnums(ref_args))(*ref_args)
    return _REF_F32[name]


@pytest.mark.parametrize(("name", "dtype", "jit"), _low_precision_params())
def test_low_precision_runs_every_rule(name, dtype, jit):
    fun, make = PROGRAMS[name]
    args = make(dtype)
    nums = _argnums(args)
    got = (jax.jit if jit else (lambda f: f))(hg.grad(fun, argnums=nums))(*args)
    want = _f32_reference(name)
    for g in jax.tree_util.tree_leaves(got):
        assert g.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(g)))
    g, w = np.concatenate([x.ravel() for x in _leaves(got)]), np.concatenate(
        [x.ravel() for x in _leaves(want)])
    cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30)
    assert cos >= 0.99, cos


# --------------------------------------------------------------------------- unsupported


def _opaque_p(name, pinned_dtype=None):
    """A primitive no rule names: dtype-polymorphic (its abstract evaluation follows its
    input), or, with `pinned_dtype`, one whose output dtype is fixed whatever its input."""
    from hifigrad._src import compat

    p = compat.new_primitive(name)
    if pinned_dtype is None:
        compat.register_impl_and_lowering(p, lambda x: x * 2, lambda x: x)
    else:
        compat.register_impl_and_lowering(
            p, lambda x: (x * 2).astype(pinned_dtype),
            lambda x: x.update(dtype=jnp.dtype(pinned_dtype), weak_type=False))
    compat.register_jvp(p, lambda primals, tangents: (p.bind(primals[0]), p.bind(tangents[0])))

    def transpose(ct, x):
        return [p.bind(ct)]
    compat.register_transpose(p, transpose)
    return p


_OPAQUE = _opaque_p("test_opaque_double")
_PINNED = _opaque_p("test_pinned_double", jnp.bfloat16)


def _opaque_fun(x):
    return jnp.sum(_OPAQUE.bind(jnp.sin(x)).astype(jnp.float32))


def _pinned_fun(x):
    return jnp.sum(_PINNED.bind(jnp.sin(x)).astype(jnp.float32))


def test_unnamed_dtype_polymorphic_primitive_runs_promoted(maybe_jit):
    """No rule names it, and its abstract evaluation at f32 gives f32: it is re-bound at f32,
    with no warning, and its gradient is exact in f32 over the bf16 forward."""
    x = jnp.linspace(0, 1, 3).astype(jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = maybe_jit(hg.grad(_opaque_fun))(x)
    assert g.dtype == jnp.float32
    # d/dx 2 sin(x) = 2 cos(x), with cos(x) the forward's bf16 coefficient: bf16 rounding.
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x, np.float64)), rtol=2 ** -8)


def test_unpromotable_primitive_error_names_it_and_the_switch():
    x = jnp.ones(3, jnp.bfloat16)
    with pytest.raises(hg.UnsupportedPrimitiveError) as e:
        hg.grad(_pinned_fun, policy=hg.Policy(unsupported="error"))(x)
    msg = str(e.value)
    assert "test_pinned_double" in msg and "register_rule" in msg
    assert "returns bfloat16[3] where float32[3] is needed" in msg


def test_unpromotable_primitive_fallback_warns_once_and_is_correct(maybe_jit):
    x = jnp.linspace(0, 1, 3).astype(jnp.bfloat16)
    from hifigrad._src import interpreter

    interpreter._warned.discard("test_pinned_double")
    with pytest.warns(hg.PrecisionFallbackWarning, match="test_pinned_double"):
        g = maybe_jit(hg.grad(_pinned_fun))(x)
    assert g.dtype == jnp.float32
    # The cotangent is rounded to bf16 through the primitive: bf16 relative error.
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x, np.float64)), rtol=2 ** -7)


def test_register_rule_into_a_copy_of_the_table():
    table = PROMOTE.copy()
    from hifigrad._src.rules import promote_rule

    table.register(_OPAQUE, promote_rule)
    assert _OPAQUE in table.rules and _OPAQUE not in PROMOTE.rules


# ------------------------------------------------------------------ issue 9 regressions
# Each was an UnsupportedPrimitiveError, a crash or a silently low-precision gradient.

_BF = jnp.bfloat16


def _f32_model_ref(fn, x):
    """jax.grad of the f32 model: the same program with its inputs in float32. Note that
    `fn` casts its own constants; the forward's bf16 rounding is the only difference."""
    return jax.grad(fn)(np.asarray(x, np.float32))


@pytest.mark.parametrize("name,fn", [
    ("stack", lambda x: jnp.stack([x, 2 * x]).astype(jnp.float32).sum()),
    ("tile", lambda x: (jnp.tile(x, 2) * jnp.tile(x, 2)).astype(jnp.float32).sum()),
    ("unstack", lambda x: (lambda a, b: (a * b).astype(jnp.float32).sum())(*x.reshape(2, 3))),
    ("polyval", lambda x: jnp.polyval(x, jnp.asarray(0.5, x.dtype)).astype(jnp.float32)),
    ("ldexp", lambda x: (jnp.ldexp(x, jnp.int32(2)) ** 2).astype(jnp.float32).sum()),
    ("frexp", lambda x: (jnp.frexp(x)[0] * x).astype(jnp.float32).sum()),
])
def test_primitives_no_list_named(maybe_jit, name, fn):
    """Primitives that JAX releases added (or that were never listed) run promoted with no
    warning and give JAX's own f32 backward over the bf16 forward."""
    x = jnp.linspace(0.1, 1.2, 6).astype(_BF)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = maybe_jit(hg.grad(fn))(x)
    assert g.dtype == jnp.float32
    # vs the f32 model, only the bf16 forward's rounding differs: each op rounds to 2^-9
    # relative, and these programs have at most 3 ops on a path, so 2^-7.
    np.testing.assert_allclose(g, _f32_model_ref(fn, x), rtol=2 ** -7, atol=1e-6)


def test_custom_root_backward_runs_in_f32():
    """`lax.custom_root`'s tangent solve is an `eval_jaxpr` equation on jax 0.12: it is inlined
    and promoted, never re-bound at bf16 (which silently gave bf16 gradients)."""
    def f(x):
        root = lax.custom_root(lambda y: y * y - x, jnp.ones_like(x),
                               lambda _, y0: jnp.sqrt(x),
                               lambda g, y: y / (2 * jnp.sqrt(x)))
        return root.astype(jnp.float32).sum()

    x = jnp.linspace(0.5, 2, 4).astype(_BF)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = hg.grad(f)(x)
    assert g.dtype == jnp.float32
    # The f32 backward over the bf16 residuals: 1 / (2 * sqrt(x)), with sqrt(x) rounded to bf16
    # as the forward computes it and the division in f32 (jax.grad in bf16 rounds the quotient
    # too: 0.70703125 instead of 0.70718 at x = 0.5).
    s = np.asarray(jnp.sqrt(x), np.float32)
    np.testing.assert_allclose(g, np.float32(1) / (2 * s), rtol=1e-6)
    assert np.abs(np.asarray(jax.grad(f)(x), np.float32) - g).max() > 1e-4


@pytest.mark.parametrize("flag", [True, False])
def test_static_custom_vjp_residuals_reach_bwd_concrete(maybe_jit, flag):
    """A Python bool residual reaches the user's bwd as a Python value, as under jax.grad, so
    a bwd may branch on it (equinox's filter_custom_vjp does)."""
    seen = []

    @jax.custom_vjp
    def f(x):
        return 2 * x

    def bwd(res, g):
        b, n, none = res
        seen.append((type(b).__name__, none))
        return ((3.0 * g if b else 0 * g) * n,)

    f.defvjp(lambda x: (f(x), (flag, 2, None)), bwd)
    x = jnp.linspace(0, 1, 3).astype(_BF)
    fn = lambda x: f(x).astype(jnp.float32).sum()
    g = maybe_jit(hg.grad(fn))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, np.full(3, 6.0 if flag else 0.0, np.float32))
    np.testing.assert_array_equal(g, jax.grad(fn)(x).astype(jnp.float32))
    assert seen and all(not t.endswith("Tracer") and none is None for t, none in seen)


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="jax.new_ref is not in this JAX")
@cpu_only("two programs' bf16 forwards agree to 1e-6 only without excess precision")
def test_mutable_refs_are_discharged(maybe_jit):
    def fn(x):
        r = jax.new_ref(jnp.zeros_like(x))
        r[...] = x * x
        r[...] = r[...] + jnp.sin(x)
        r[2:4] = r[2:4] * x[:2]
        return r[...].astype(jnp.float32).sum()

    x = jnp.linspace(0.1, 1, 6).astype(_BF)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = maybe_jit(hg.grad(fn))(x)
    assert g.dtype == jnp.float32
    # Reference: the same program without refs, in hifigrad (bitwise: the same ops).
    def pure(x):
        y = x * x + jnp.sin(x)
        y = y.at[2:4].set(y[2:4] * x[:2])
        return y.astype(jnp.float32).sum()
    np.testing.assert_allclose(g, hg.grad(pure)(x), rtol=1e-6)
    # and the f32 model: a few bf16 roundings on each path (2^-9 each), so 2^-6.
    np.testing.assert_allclose(g, _f32_model_ref(pure, x), rtol=2 ** -6, atol=1e-6)


def test_log2_tangent_coefficient():
    """jax 0.12 has a `log2` primitive; Policy(coefficients='tangent') computes its coefficient
    1/(x ln 2) in f32 (on 0.10 log2 is log(x)/log(2), covered by log's coefficient)."""
    x = jnp.linspace(0.3, 3, 64).astype(_BF)
    fn = lambda x: jnp.sum(jnp.log2(x).astype(jnp.float32))
    g = hg.grad(fn, policy=hg.Policy(coefficients="tangent"))(x)
    exact = 1 / (np.asarray(x, np.float64) * np.log(2))
    from hifigrad._src import compat

    if compat.primitives_named(["log2"]):
        # The whole coefficient in f32: f32 rounding (a few ulps).
        np.testing.assert_allclose(g, exact, rtol=1e-6)
    else:
        # 1/x in f32, times the bf16-rounded constant 1/log(2): bf16 rounding, 2^-8.
        np.testing.assert_allclose(g, exact, rtol=2 ** -8)


def _pallas_scale(ct, y):
    """`ct * y` as a Pallas kernel (interpreted on CPU), built for its operands' dtypes."""
    from jax.experimental import pallas as pl

    def kernel(c_ref, y_ref, o_ref):
        o_ref[...] = c_ref[...] * y_ref[...].astype(c_ref.dtype)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(ct.shape, ct.dtype),
                          interpret=jax.default_backend() != "tpu")(ct, y)


def _pallas_custom_vjp(bwd_dtypes):
    """``f(x, y) = x * y`` whose bwd computes ``ct * y`` in `_pallas_scale`; with `bwd_dtypes`,
    the bwd refuses cotangents of other dtypes (a kernel that is not generic in dtype)."""

    @jax.custom_vjp
    def f(x, y):
        return x * y

    def bwd(y, ct):
        if bwd_dtypes and ct.dtype not in bwd_dtypes:
            raise TypeError(f"this kernel takes {bwd_dtypes}, not {ct.dtype}")
        return _pallas_scale(ct, y), None

    f.defvjp(lambda x, y: (f(x, y), y), bwd)
    return f


def test_a_custom_vjp_backward_holding_a_pallas_kernel_is_built_for_float32(maybe_jit):
    """A kernel inside a custom_vjp backward (a `pallas_call`: typed at the dtypes it was built
    for, so the interpreter cannot promote it) is re-traced from the user's rule at float32
    (`rules._retrace_promoted`): no fallback, no warning, and the gradient is the float32
    product of the float32 cotangent and the bf16 residual, exact to float32 rounding (2**-24
    relative), where jax.grad's and the fallback's are rounded to bf16 (2**-9)."""
    f = _pallas_custom_vjp(())
    x = jnp.linspace(-1, 1, 256).astype(_BF).reshape(8, 32)
    y = jnp.linspace(0.3, 2.7, 256).astype(_BF).reshape(8, 32)
    w = jnp.linspace(-1.3, 1.1, 256, dtype=jnp.float32).reshape(8, 32) * np.float32(np.pi)
    fn = lambda x: jnp.sum(f(x, y).astype(jnp.float32) * w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.PrecisionFallbackWarning)
        g = maybe_jit(hg.grad(fn))(x)
    assert g.dtype == jnp.float32
    ref = np.asarray(w, np.float64) * np.asarray(y, np.float64)
    np.testing.assert_allclose(g, ref, rtol=2.0 ** -24, atol=0)
    assert np.abs(np.asarray(jax.grad(fn)(x), np.float64) - ref).max() > 2.0 ** -12


def test_a_pallas_backward_not_generic_in_dtype_falls_back_loudly(maybe_jit):
    """A rule that refuses float32 cotangents cannot be re-traced: the kernel runs at its own
    dtype, with the one `PrecisionFallbackWarning`, and the gradient is jax.grad's, up-cast."""
    f = _pallas_custom_vjp((jnp.dtype(_BF),))
    x = jnp.linspace(-1, 1, 256).astype(_BF).reshape(8, 32)
    y = jnp.linspace(0.3, 2.7, 256).astype(_BF).reshape(8, 32)
    w = jnp.linspace(-1.3, 1.1, 256, dtype=jnp.float32).reshape(8, 32)
    fn = lambda x: jnp.sum(f(x, y).astype(jnp.float32) * w)
    interpreter._warned.discard("pallas_call")
    with pytest.warns(hg.PrecisionFallbackWarning, match="pallas_call"):
        g = maybe_jit(hg.grad(fn))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(g, np.asarray(jax.grad(fn)(x), np.float32))
