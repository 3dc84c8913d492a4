"""Bad and unusual inputs: each gets a clear error, or the behaviour `jax.grad` has.

Covered: tangent dtypes that are not real floats or are less precise than a primal; complex
primals; integer and bool inputs and outputs (float0, ``allow_int``); zero-size arrays; Python
scalars, NumPy scalars and weak types; NaN and inf in inputs and cotangents; pytrees with None
leaves; donated buffers; ``jax.debug.print``, ``io_callback`` and ``pure_callback``; an
unsupported primitive; codecs on all-zero, constant, huge, subnormal, NaN and inf groups (through
``hg.scan``); and hifigrad changing no global JAX configuration.

CPU-only claims (`platforms.cpu_only`):

| test | why only on XLA:CPU |
| --- | --- |
| `test_donated_buffers` | fwd, bwd as two programs vs one: bitwise if no excess precision |

(Measured: fails with ``XLA_FLAGS=--xla_allow_excess_precision=true``.)
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback
from platforms import cpu_only, on_cpu

import hifigrad as hg

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FLOAT0 = jax.dtypes.float0


def _leaves(t):
    return jax.tree_util.tree_leaves(t)


def _loss(x):
    return jnp.sum(jnp.tanh(x) * x).astype(F32)


# ------------------------------------------------------------------------------ tangent dtype

@pytest.mark.parametrize("bad", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64, FLOAT0,
                                 "not-a-dtype"], ids=str)
def test_tangent_dtype_must_be_a_real_float(bad):
    x = jnp.ones(3, BF16)
    for call in (lambda: hg.grad(_loss, tangent_dtype=bad)(x),
                 lambda: hg.value_and_grad(_loss, tangent_dtype=bad)(x),
                 lambda: hg.vjp(_loss, x, tangent_dtype=bad),
                 lambda: hg.precise_backward(_loss, tangent_dtype=bad)(x),
                 lambda: hg.checkpoint(_loss, codec="none", tangent_dtype=bad)(x),
                 lambda: hg.Policy(tangent_dtype=bad)):
        with pytest.raises(ValueError, match="real floating dtype"):
            call()


@pytest.mark.parametrize("tangent,primal", [(BF16, F32), (F16, BF16), (BF16, F16),
                                            (jnp.float8_e4m3fn, BF16)], ids=str)
def test_tangent_dtype_less_precise_than_a_primal(tangent, primal):
    x = jnp.ones(3, primal)
    with pytest.raises(ValueError, match="less precise than a primal"):
        hg.grad(_loss, tangent_dtype=tangent)(x)
    with pytest.raises(ValueError, match="less precise than a primal"):
        hg.vjp(lambda x: x * 2, x, tangent_dtype=tangent)
    with pytest.raises(ValueError, match="less precise than a primal"):
        jax.grad(hg.precise_backward(_loss, tangent_dtype=tangent))(x)


def test_tangent_dtype_float32_below_a_float64_primal():
    with jax.enable_x64(True):
        x = jnp.ones(3, jnp.float64)
        with pytest.raises(ValueError, match="less precise than a primal of dtype float64"):
            hg.grad(_loss)(x)
        g = hg.grad(_loss, tangent_dtype=jnp.float64)(x)
        assert g.dtype == jnp.float64
        # A TPU emulates float64 with pairs of float32, not IEEE-rounded: two programs of the
        # same math agree to a few float64 ulps there (seen: 1.1e-15 on a TPU v5e).
        np.testing.assert_allclose(g, jax.grad(_loss)(x),
                                   rtol=1e-15 if on_cpu() else 16 * np.finfo(np.float64).eps)


def test_tangent_dtype_equal_to_the_primal_is_jax_grad():
    """A tangent dtype as precise as the primal (bf16 for bf16) promotes nothing."""
    x = jnp.linspace(-1, 1, 5).astype(BF16)
    g = jax.jit(hg.grad(_loss, tangent_dtype=BF16))(x)
    assert g.dtype == BF16
    want = np.asarray(jax.jit(jax.grad(_loss))(x), np.float32)
    if on_cpu():  # bitwise: the same bf16 ops, each rounded (no excess precision on XLA:CPU)
        np.testing.assert_array_equal(np.asarray(g, np.float32), want)
    else:  # XLA:TPU/GPU may keep a fusion's bf16 intermediates in float32: one bf16 rounding
        np.testing.assert_allclose(np.asarray(g, np.float32), want, rtol=2.0 ** -7)


def test_fp8_primal_with_a_float16_tangent_dtype():
    x = jnp.linspace(-1, 1, 5).astype(jnp.float8_e4m3fn)
    g = hg.grad(lambda x: jnp.sum(x.astype(F32) ** 2), tangent_dtype=F16)(x)
    assert g.dtype == F16
    np.testing.assert_allclose(np.asarray(g, np.float32), 2 * np.asarray(x, np.float32))


def test_conflicting_tangent_dtype_and_policy():
    with pytest.raises(ValueError, match="conflicts with"):
        hg.grad(_loss, tangent_dtype=jnp.float64, policy=hg.Policy())(jnp.ones(2, BF16))
    with pytest.raises(TypeError, match="policy must be a hifigrad.Policy"):
        hg.grad(_loss, policy={"tangent_dtype": F32})(jnp.ones(2, BF16))


# ------------------------------------------------------------------------------ complex primals
# Decision: complex primals are never promoted (complex64 already holds float32 parts); for a
# real-valued function of complex inputs hg.grad is jax.grad, and a complex output is the same
# TypeError as in jax.grad (hifigrad has no `holomorphic` mode).

def _creal(z):
    return jnp.sum(jnp.abs(jnp.sin(z)) ** 2 + jnp.real(z * z))


def test_complex_primals_are_not_promoted_and_match_jax_grad(maybe_jit):
    z = jnp.array([1 + 1j, 0.3 - 2j, -0.5 + 0.25j], jnp.complex64)
    g = maybe_jit(hg.grad(_creal))(z)
    assert g.dtype == jnp.complex64
    np.testing.assert_allclose(g, maybe_jit(jax.grad(_creal))(z), rtol=1e-6)


def test_complex_and_bf16_primals_together():
    def f(z, w):
        return jnp.sum(jnp.real(z * w.astype(F32).astype(jnp.complex64)) ** 2)

    z = jnp.array([1 + 1j, 0.5 - 2j], jnp.complex64)
    w = jnp.array([0.75, -1.5], BF16)
    gz, gw = hg.grad(f, argnums=(0, 1))(z, w)
    assert gz.dtype == jnp.complex64 and gw.dtype == F32
    jz, jw = jax.grad(f, argnums=(0, 1))(z, w.astype(F32))  # same values, all-f32 reference
    np.testing.assert_allclose(gz, jz, rtol=1e-6)
    np.testing.assert_allclose(gw, jw, rtol=1e-6)


def test_complex_intermediates_in_a_bf16_model():
    """A bf16 model with an FFT inside: the backward through the complex values is exact."""
    x = jnp.linspace(-1, 1, 8).astype(BF16)

    def f(x):
        y = jnp.fft.irfft(jnp.fft.rfft(x.astype(F32)) * (0.5 + 0.25j), n=8)
        return jnp.sum(jnp.tanh(y.astype(BF16)).astype(F32) * jnp.arange(8.0, dtype=F32))

    g = jax.jit(hg.grad(f))(x)
    # The float64 reference on the CPU: XLA:TPU has no complex128 FFT ("Unexpected operand type
    # for FFT: c128"); on CPU hosts this is where it ran anyway.
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        g64 = jax.jit(hg.grad(f, tangent_dtype=jnp.float64))(jax.device_put(x, cpu))
    assert g.dtype == F32
    np.testing.assert_allclose(g, g64, rtol=1e-5, atol=1e-6)


def test_complex_output_is_a_clear_error():
    z = jnp.ones(2, jnp.complex64)
    with pytest.raises(TypeError, match="real-valued outputs"):
        hg.grad(lambda z: jnp.sum(z * z))(z)
    with pytest.raises(TypeError, match="real-valued outputs"):
        jax.grad(lambda z: jnp.sum(z * z))(z)


def test_complex_vjp_matches_jax():
    z = jnp.array([1 + 2j, 0.5 - 1j], jnp.complex64)
    ct = jnp.array([1 - 1j, 2 + 0.5j], jnp.complex64)
    (got,) = hg.vjp(lambda z: jnp.sin(z) * z, z)[1](ct)
    (want,) = jax.vjp(lambda z: jnp.sin(z) * z, z)[1](ct)
    assert got.dtype == jnp.complex64
    np.testing.assert_allclose(got, want, rtol=1e-6)


# ------------------------------------------------------------------------------ int and bool

def _fi(x, i):
    return jnp.sum(x * i.astype(x.dtype)).astype(F32)


def test_int_input_without_allow_int_is_the_jax_error():
    x, i = jnp.ones(3, BF16), jnp.arange(3)
    with pytest.raises(TypeError, match="allow_int") as hg_err:
        hg.grad(_fi, argnums=1)(x, i)
    with pytest.raises(TypeError, match="allow_int") as jax_err:
        jax.grad(_fi, argnums=1)(x, i)
    assert "int32" in str(hg_err.value) and "int32" in str(jax_err.value)
    with pytest.raises(TypeError, match="allow_int"):
        hg.grad(lambda b: jnp.sum(b))(jnp.array([True, False]))


@pytest.mark.parametrize("idx", [jnp.arange(3), jnp.array([True, False, True])],
                         ids=["int", "bool"])
def test_int_and_bool_inputs_with_allow_int_get_float0(idx, maybe_jit):
    x = jnp.array([0.5, -1.0, 2.0], BF16)
    gx, gi = maybe_jit(hg.grad(_fi, argnums=(0, 1), allow_int=True))(x, idx)
    jx, ji = jax.grad(_fi, argnums=(0, 1), allow_int=True)(x, idx)
    assert gx.dtype == F32 and gi.dtype == ji.dtype == FLOAT0 and gi.shape == ji.shape
    np.testing.assert_array_equal(gx, np.asarray(jx, np.float32))


def test_vjp_of_int_inputs_and_int_outputs():
    """Integer outputs take float0 cotangents (regression: hg.vjp of a function with an integer
    output used to fail in `linear_transpose`)."""
    x = jnp.array([0.5, -1.0, 2.0], BF16)

    def f(x, i):
        return x * i.astype(BF16), jnp.argmax(x), x > 0

    out, vjp_fn = hg.vjp(f, x, jnp.arange(3))
    cts = (jnp.ones(3, BF16), np.zeros((), FLOAT0), np.zeros(3, FLOAT0))
    gx, gi = vjp_fn(cts)
    jx, ji = jax.vjp(f, x, jnp.arange(3))[1](cts)
    assert gx.dtype == F32 and gi.dtype == ji.dtype == FLOAT0
    np.testing.assert_array_equal(gx, np.asarray(jx, np.float32))
    # Only integer outputs: the gradient is zero.
    (g0,) = hg.vjp(lambda x: jnp.argsort(x), x)[1](np.zeros(3, FLOAT0))
    assert g0.dtype == F32 and not np.any(np.asarray(g0))
    # has_aux with an integer aux, under jit.
    (v, aux), g = jax.jit(hg.value_and_grad(
        lambda x: (jnp.sum(x).astype(F32), jnp.argmax(x)), has_aux=True))(x)
    assert int(aux) == 2 and g.dtype == F32


def test_integer_output_of_grad_is_the_jax_error():
    with pytest.raises(TypeError, match="real-valued outputs"):
        hg.grad(lambda x: jnp.argmax(x))(jnp.ones(3, BF16))


def test_cotangent_of_a_wrong_dtype_or_shape():
    _, vjp_fn = hg.vjp(lambda x: x * 2, jnp.ones(3, BF16))
    with pytest.raises(TypeError, match="cotangent 0 has dtype int32"):
        vjp_fn(jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="cotangent 0 has shape"):
        vjp_fn(jnp.ones(4, BF16))
    with pytest.raises(TypeError, match="tree structure"):
        vjp_fn((jnp.ones(3, BF16),))


# ------------------------------------------------------------------------------ zero-size

def test_zero_size_arrays(maybe_jit):
    cases = [
        (lambda x: jnp.sum(jnp.tanh(x)).astype(F32), (jnp.ones((0, 3), BF16),)),
        (lambda a, b: jnp.sum(a @ b).astype(F32), (jnp.ones((2, 0), BF16), jnp.ones((0, 3), BF16))),
        (lambda w, xs: lax.scan(lambda c, x: (jnp.tanh(c * w + x), None), jnp.zeros(3, BF16),
                                xs)[0].astype(F32).sum(),
         (jnp.ones(3, BF16), jnp.ones((0, 3), BF16))),
        (lambda x, y: jnp.sum(jnp.concatenate([x, y]) ** 2).astype(F32),
         (jnp.ones(0, F16), jnp.ones(2, F16))),
    ]
    for f, args in cases:
        argnums = tuple(range(len(args)))
        got = maybe_jit(hg.grad(f, argnums))(*args)
        want = jax.grad(f, argnums)(*args)
        for g, w, a in zip(got, want, args):
            assert g.dtype == F32 and g.shape == w.shape == a.shape
            np.testing.assert_array_equal(g, np.asarray(w, np.float32))


# ------------------------------------------------------------------------------ scalars, weak types

def test_python_and_numpy_scalars():
    sq = lambda x: x * x
    for x in (3.0, np.float32(3.0), jnp.asarray(3.0)):
        g = hg.grad(sq)(x)
        assert g.dtype == F32 and float(g) == 6.0
    g = hg.grad(sq)(np.float16(3.0))  # a float16 primal: float32 gradient
    assert g.dtype == F32 and float(g) == 6.0
    with pytest.raises(TypeError, match="allow_int"):
        hg.grad(sq)(3)
    g = hg.grad(lambda x, n: x * n, argnums=(0, 1), allow_int=True)(2.0, 3)
    assert float(g[0]) == 3.0 and g[1].dtype == FLOAT0


def test_weak_types():
    """A weakly typed (Python scalar) input mixed with bf16 arrays: its value follows JAX's
    weak-type rules in the forward (the product stays bf16), its gradient is float32. hifigrad's
    gradients are never weakly typed (jax.grad's are, for weak inputs; values and dtypes are the
    same)."""
    x = jnp.array([1.0, 2.0, 3.0], BF16)

    def f(x, s):
        y = x * s
        assert y.dtype == BF16
        return jnp.sum(y).astype(F32)

    gx, gs = hg.grad(f, argnums=(0, 1))(x, 2.0)
    jx, js = jax.grad(f, argnums=(0, 1))(x, 2.0)
    assert gx.dtype == F32 and gs.dtype == F32 == js.dtype
    np.testing.assert_array_equal(gx, np.asarray(jx, np.float32))
    assert float(gs) == float(js) == 6.0
    assert js.weak_type and not gs.weak_type
    v, g = hg.value_and_grad(lambda s: s * s)(3.0)
    assert v.weak_type and float(v) == 9.0 and float(g) == 6.0


# ------------------------------------------------------------------------------ NaN and inf

def test_nan_and_inf_inputs_propagate(maybe_jit):
    x = jnp.array([0.5, np.nan, np.inf, -np.inf, -2.0], BF16)
    f = lambda x: jnp.sum(x * x * 0.5 + jnp.sin(x)).astype(F32)
    g = maybe_jit(hg.grad(f))(x)
    want = np.asarray(jax.grad(f)(x), np.float32)  # JAX's bf16 backward
    assert g.dtype == F32
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(g), np.isinf(want))
    assert np.isnan(g[1]) and np.isnan(g[2])  # sin'(inf) is NaN: never hidden
    np.testing.assert_allclose(np.asarray(g)[[0, 4]], want[[0, 4]], rtol=2 ** -7)


def test_nan_and_inf_cotangents_propagate(maybe_jit):
    """A NaN / inf cotangent reaches every input it depends on, through a matmul and a scan."""
    w = jnp.full((3, 3), 0.5, BF16)
    xs = jnp.ones((2, 3), BF16)

    def f(w, xs):
        c, ys = lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c), jnp.zeros(3, w.dtype), xs)
        return c, ys

    ct = (jnp.array([np.nan, 0.0, 0.0], BF16), jnp.array([[0, 0, 0], [np.inf, 0, 0]], BF16))
    got = maybe_jit(lambda w, xs, ct: hg.vjp(f, w, xs)[1](ct))(w, xs, ct)
    want = jax.vjp(f, w.astype(F32), xs.astype(F32))[1](
        jax.tree_util.tree_map(lambda c: c.astype(F32), ct))
    for g, wnt in zip(got, want):
        assert g.dtype == F32
        np.testing.assert_array_equal(np.isnan(g), np.isnan(wnt))
        np.testing.assert_array_equal(np.isinf(g), np.isinf(wnt))
        assert np.any(np.isnan(g))


def test_inf_times_zero_in_the_backward_is_nan():
    x = jnp.array([0.0, 1.0], BF16)
    (g,) = hg.vjp(lambda x: x * 0, x)[1](jnp.array([np.inf, 1.0], BF16))
    assert np.isnan(g[0]) and g[1] == 0


def test_fp16_backward_that_would_overflow_stays_finite():
    """In fp16 the backward of this loss overflows (inf) in JAX; in float32 it is exact."""
    x = jnp.array([1.0, 2.0], F16)
    f = lambda x: jnp.sum(x * x * 300.0) * 300.0
    assert np.all(np.isinf(np.asarray(jax.grad(f)(x), np.float32)))
    np.testing.assert_allclose(hg.grad(f)(x), [180000.0, 360000.0], rtol=1e-6)


# ------------------------------------------------------------------------------ None leaves

def test_pytrees_with_none_leaves(maybe_jit):
    x = jnp.array([1.0, -2.0], BF16)
    params = {"w": x, "b": None, "nested": (None, [x * 2, None])}

    def f(p):
        return jnp.sum(p["w"] * p["nested"][1][0]).astype(F32)

    got = maybe_jit(hg.grad(f))(params)
    want = jax.grad(f)(params)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert got["b"] is None and got["nested"][0] is None
    for g, w in zip(_leaves(got), _leaves(want)):
        assert g.dtype == F32
        np.testing.assert_array_equal(g, np.asarray(w, np.float32))
    # None as a whole argument, None in the output and in aux.
    g = hg.grad(lambda x, n: jnp.sum(x).astype(F32), argnums=(0, 1))(x, None)
    assert g[1] is None
    out, vjp_fn = hg.vjp(lambda x: (x * 2, None), x)
    assert out[1] is None
    (gx,) = vjp_fn((jnp.ones(2, BF16), None))
    assert gx.dtype == F32
    g, aux = hg.grad(lambda x: (jnp.sum(x).astype(F32), None), has_aux=True)(x)
    assert aux is None and g.dtype == F32


# ------------------------------------------------------------------------------ donated buffers

@cpu_only("bitwise equal gradients from differently compiled bf16 programs (no excess precision)")
def test_donated_buffers():
    f = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2).astype(F32)
    w0 = jnp.full((4, 4), 0.25, BF16)
    x = jnp.ones((2, 4), BF16)
    ref = jax.jit(hg.grad(f))(w0, x)
    with warnings.catch_warnings():
        # The bf16 inputs cannot hold the float32 gradient: JAX may say so, and ignores them.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        g = jax.jit(hg.grad(f), donate_argnums=(0, 1))(w0.copy(), x.copy())
    np.testing.assert_array_equal(g, ref)

    def step(w, x):
        return (w.astype(F32) - 0.1 * hg.grad(f)(w, x)).astype(BF16)

    donating = jax.jit(step, donate_argnums=0)
    w = w0.copy()
    w1 = donating(w, x)
    assert w.is_deleted()
    np.testing.assert_array_equal(w1, jax.jit(step)(w0, x))
    # vjp_fn (residuals in a pytree) returned from jit, then donated to the backward.
    # Its bf16 residuals cannot hold float32 results either: JAX may warn again.
    out, vjp_fn = jax.jit(lambda w: hg.vjp(lambda w: f(w, x), w))(w0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        (gw,) = jax.jit(lambda fn, ct: fn(ct), donate_argnums=0)(vjp_fn, jnp.ones((), F32))
    np.testing.assert_array_equal(gw, ref)


# ------------------------------------------------------------------------------ callbacks

def test_debug_print_in_forward_and_backward(capfd):
    @jax.custom_vjp
    def ident(x):
        return x

    def bwd(_, g):
        jax.debug.print("cotangent {g}", g=g)
        return (g,)

    ident.defvjp(lambda x: (x, None), bwd)

    def f(x):
        jax.debug.print("forward {x}", x=x)
        return jnp.sum(ident(x) * 3).astype(F32)

    x = jnp.array([0.5, 1.0], BF16)
    for fn in (hg.grad(f), jax.jit(hg.grad(f))):
        g = fn(x)
        jax.effects_barrier()
        np.testing.assert_array_equal(g, [3.0, 3.0])
        out = capfd.readouterr().out
        assert "forward [0.5 1" in out and "cotangent [3. 3.]" in out, out


def test_io_callback():
    calls = []

    def record(v):
        calls.append(np.asarray(v))
        return np.asarray(v) * 2

    x = jnp.array([0.5, -1.0], BF16)

    def f(x):  # the callback sees a value no tangent flows through
        y = io_callback(record, jax.ShapeDtypeStruct(x.shape, x.dtype), lax.stop_gradient(x),
                        ordered=True)
        return jnp.sum(jnp.tanh(x) * y).astype(F32)

    g = jax.jit(hg.grad(f))(x)
    jax.effects_barrier()  # the callback has run (dispatch is asynchronous on a TPU)
    assert len(calls) == 1 and calls[0].dtype == np.dtype(BF16)
    want = jax.jit(jax.grad(f))(x.astype(F32))
    np.testing.assert_allclose(g, want, rtol=2e-2)  # tanh' saved in bf16
    assert g.dtype == F32

    def g_bad(x):  # a tangent would flow through the callback: JAX's own error
        return jnp.sum(io_callback(record, jax.ShapeDtypeStruct(x.shape, x.dtype), x)).astype(F32)

    with pytest.raises(ValueError, match="IO callbacks do not support JVP"):
        jax.grad(g_bad)(x)
    with pytest.raises(ValueError, match="IO callbacks do not support JVP"):
        hg.grad(g_bad)(x)


def test_callbacks_in_a_backward_run_at_their_declared_dtypes():
    seen = []

    def host(v):
        seen.append(v.dtype)
        return np.asarray(v) * 2

    for call in ("io", "pure"):
        @jax.custom_vjp
        def double_ct(x):
            return x

        def bwd(_, g, call=call):
            spec = jax.ShapeDtypeStruct(g.shape, g.dtype)
            if call == "io":
                return (io_callback(host, spec, g, ordered=True),)
            return (jax.pure_callback(host, spec, g),)

        double_ct.defvjp(lambda x: (x, None), bwd)
        f = lambda x: jnp.sum(double_ct(jnp.tanh(x)) * 3).astype(F32)
        x = jnp.array([0.25, 0.5], BF16)
        g = jax.jit(hg.grad(f))(x)
        jax.effects_barrier()  # the callback has run (dispatch is asynchronous on a TPU)
        assert g.dtype == F32 and seen[-1] == np.dtype(BF16)
        np.testing.assert_allclose(g, jax.grad(f)(x).astype(F32), rtol=2e-2)


# ------------------------------------------------------------------------- unsupported primitive

def _make_opaque():
    """A primitive no rule names whose output dtype is pinned to bf16 whatever its input: its
    abstract evaluation at f32 shows it cannot run promoted."""
    from hifigrad._src import compat

    p = compat.new_primitive("bad_inputs_opaque_triple")
    compat.register_impl_and_lowering(p, lambda x: (x * 3).astype(BF16),
                                      lambda x: x.update(dtype=jnp.dtype(BF16), weak_type=False))
    compat.register_jvp(p, lambda primals, tangents: (p.bind(primals[0]), p.bind(tangents[0])))
    compat.register_transpose(p, lambda ct, x: [p.bind(ct)])
    return p


_OPAQUE = _make_opaque()


def _opaque_model(w, xs):
    def body(c, x):
        return jnp.tanh(_OPAQUE.bind(c * w) + x), None

    return jnp.sum(lax.scan(body, jnp.zeros(3, BF16), xs)[0]).astype(F32)


def test_unsupported_primitive_names_it_and_the_fallback_switch(maybe_jit):
    w, xs = jnp.full(3, 0.5, BF16), jnp.ones((4, 3), BF16)
    with pytest.raises(hg.UnsupportedPrimitiveError) as e:
        maybe_jit(hg.grad(_opaque_model, policy=hg.Policy(unsupported="error")))(w, xs)
    msg = str(e.value)
    assert "'bad_inputs_opaque_triple'" in msg
    assert "Policy(unsupported='fallback')" in msg and "register_rule" in msg
    # jax.grad itself works on it (in bf16), so this is hifigrad's limit, stated clearly.
    assert jax.grad(_opaque_model)(w, xs).dtype == BF16


def test_unsupported_primitive_fallback():
    from hifigrad._src import interpreter

    w, xs = jnp.full(3, 0.5, BF16), jnp.ones((4, 3), BF16)
    interpreter._warned.discard("bad_inputs_opaque_triple")
    with pytest.warns(hg.PrecisionFallbackWarning, match="bad_inputs_opaque_triple"):
        g = hg.grad(_opaque_model)(w, xs)
    assert g.dtype == F32
    np.testing.assert_allclose(g, jax.grad(_opaque_model)(w, xs).astype(F32), rtol=3e-2)


def test_effect_only_primitive_on_the_cotangent_path_runs_without_a_rule(maybe_jit):
    """A primitive with no outputs (an effect: here `inspect_sharding`, which hifigrad has no
    rule for) that a cotangent reaches cannot change any gradient: it runs at its declared
    dtypes, with no error. (Regression: it raised UnsupportedPrimitiveError.)"""
    log = []

    @jax.custom_vjp
    def tap(x):
        return x

    def bwd(_, g):
        jax.debug.inspect_array_sharding(g, callback=log.append)
        return (g,)

    tap.defvjp(lambda x: (x, None), bwd)
    x = jnp.array([0.5, 2.0], BF16)
    g = maybe_jit(hg.grad(lambda x: jnp.sum(tap(x) * 3).astype(F32)))(x)
    np.testing.assert_array_equal(g, [3.0, 3.0])
    assert g.dtype == F32 and len(log) == 1


# ------------------------------------------------------------------------------ codecs

CODECS = ["none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]


def _group_values(kind, dtype):
    fi = jnp.finfo(dtype)
    return {"zero": 0.0, "constant": 0.3, "huge": float(fi.max),
            "subnormal": 3 * float(fi.smallest_subnormal), "nan": np.nan, "inf": np.inf}[kind]


def _scan_body(c, w):
    return jnp.tanh(c * w) + c * 0.5, None


def _scan_loss(c, w, codec):
    return jnp.sum(hg.scan(_scan_body, c, w, codec=codec)[0].astype(F32))


def _step_loss(c, w):
    return jnp.sum(_scan_body(c, w[0])[0].astype(F32))


# Compiled once per codec and carry dtype, shared by the six kinds of special rows (which
# differ only in the values they pass): the gradient through the scan, and its reference.
_SCAN_GRAD = {codec: jax.jit(hg.grad(functools.partial(_scan_loss, codec=codec), argnums=(0, 1)))
              for codec in CODECS}
_STEP_GRAD = jax.jit(hg.grad(_step_loss, argnums=(0, 1)))


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", ["zero", "constant", "huge", "subnormal", "nan", "inf"])
@pytest.mark.parametrize("codec", CODECS)
def test_codec_groups_through_scan(codec, kind, dtype):
    """One carry row (one group or more) of a special kind, the other rows ordinary. The
    gradient equals the float32 backward of the step at the *decoded* carry; finite carries
    decode finite (huge ones saturate, never inf); NaN and inf reach the gradient."""
    special = _group_values(kind, dtype)
    rows = np.full((4, 64), 0.4, np.float32)
    rows[1] = np.linspace(-1, 1, 64)
    rows[2] = special
    c0 = jnp.asarray(rows, dtype)
    w = jnp.full((1, 4, 64), 0.5, dtype)
    c_codec = hg.get_codec(codec)
    dec = c_codec.decode(c_codec.encode(c0), dtype)

    gc, gw = _SCAN_GRAD[codec](c0, w)
    assert gc.dtype == gw.dtype == F32
    # reference: the step's float32 backward (hg.grad) at the decoded carry
    rc, rw = _STEP_GRAD(dec, w)
    finite = np.isfinite(special)
    if finite:
        assert np.all(np.isfinite(np.asarray(dec, np.float32))), "finite values must decode finite"
        assert np.all(np.isfinite(gc)) and np.all(np.isfinite(gw))
    else:
        assert not np.all(np.isfinite(np.asarray(dec, np.float32)[2]))
        assert not np.all(np.isfinite(gw[0, 2])), "a NaN/inf group must not be hidden"
    if kind in ("zero", "subnormal"):
        # Zero, or the tiny value itself (a backend may flush subnormals to zero, and
        # stochastic int codes may round it down), never noise: within the coarsest codec's
        # rounding (int2, one level: its bf16 scale rounded up) of the value.
        d = np.asarray(dec, np.float32)[2]
        assert np.all((d == 0) | (np.abs(d - special) <= 2.0 ** -6 * special)), d
    np.testing.assert_allclose(gc, rc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ JAX config

_SNAPSHOT = textwrap.dedent("""
    import json, os, sys
    import jax

    def snapshot():
        names = set(jax.config.values) | set(getattr(jax.config, "_value_holders", {}))
        out = {}
        for n in sorted(names):
            holder = getattr(jax.config, "_value_holders", {}).get(n)
            try:
                v = holder.value if holder is not None else jax.config.values[n]
            except Exception as e:  # noqa: BLE001
                v = f"<{type(e).__name__}>"
            out[n] = repr(v)
        out["env"] = repr({k: v for k, v in os.environ.items()
                           if k.startswith(("JAX_", "XLA_"))})
        return out
""")

_CALLS = textwrap.dedent("""
    import jax.numpy as jnp
    from jax import lax
    x = jnp.ones((2, 3), jnp.bfloat16)
    f = lambda x: jnp.sum(jnp.tanh(x) ** 2).astype(jnp.float32)
    hg.grad(f)(x)
    jax.jit(hg.value_and_grad(f, policy=hg.Policy(coefficients="tangent", matmul="fast")))(x)
    jax.grad(hg.precise_backward(f))(x)
    jax.grad(lambda x: hg.checkpoint(f, codec="int4")(x.astype(jnp.float32)))(x)
    jax.grad(lambda c: hg.scan(lambda c, _: (jnp.tanh(c), None), c, None, length=2,
                               codec="fp8_e4m3")[0].sum())(jnp.ones(3))
    hg.vjp(lambda x: x * 2, x)[1](x)
    with jax.enable_x64(True):
        hg.grad(f, tangent_dtype=jnp.float64)(x)
""")


def test_importing_and_calling_hifigrad_changes_no_jax_config():
    """Every JAX config option (all names jax.config enumerates), and JAX_/XLA_ environment
    variables, are the same before importing hifigrad, after importing it, and after calling
    each of its transforms. Run in a fresh interpreter so the import is really the first."""
    script = _SNAPSHOT + textwrap.dedent("""
        before = snapshot()
        import hifigrad as hg
        after_import = snapshot()
    """) + _CALLS + textwrap.dedent("""
        after_calls = snapshot()
        print(json.dumps([before, after_import, after_calls]))
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(hg.__file__)))]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    before, after_import, after_calls = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(before) > 50  # the enumeration found the options
    assert after_import == before
    assert after_calls == before


def test_calling_hifigrad_changes_no_jax_config_in_process():
    ns: dict = {}
    exec(_SNAPSHOT, ns)  # noqa: S102
    before = ns["snapshot"]()
    exec(_CALLS, {"hg": hg, "jax": jax})  # noqa: S102
    assert ns["snapshot"]() == before


# ------------------------------------------------------------------------------ grad arguments
# Every invalid form of jax.grad's arguments, run through jax.grad and hg.grad side by side: hg
# raises the exception type jax raises, with a message naming the cause (for repeated argnums
# jax's own error is incidental -- the function receives None -- and hg's says why).

def _sq(a):
    return jnp.sum(a ** 2)


def _mul(a, b):
    return jnp.sum(a ** 2 * b)


_V = jnp.array([3.0, 1.0])
_C = jnp.array([1 + 1j, 2 - 1j], jnp.complex64)

# (id, transform name, fun, transform kwargs, call args, hg message regex)
_INVALID = [
    ("argnums_repeated", "grad", _sq, dict(argnums=(0, 0)), (_V,), "argument 0 more than once"),
    ("argnums_aliased_negative", "grad", _mul, dict(argnums=(0, -2)), (_V, _V),
     "argument 0 more than once"),
    ("argnums_repeated_value_and_grad", "value_and_grad", _mul, dict(argnums=(1, 1)), (_V, _V),
     "argument 1 more than once"),
    ("argnums_negative_out_of_range", "grad", _mul, dict(argnums=-3), (_V, _V),
     r"position -3 is out of range for 2 positional arguments.*>= -2"),
    ("argnums_out_of_range", "grad", _mul, dict(argnums=2), (_V, _V),
     "requires at least 3 positional arguments"),
    ("argnums_empty_tuple", "grad", _mul, dict(argnums=()), (_V, _V), "selects no argument"),
    ("argnums_empty_list", "grad", _mul, dict(argnums=[]), (_V, _V), "selects no argument"),
    ("argnums_float", "grad", _mul, dict(argnums=1.0), (_V, _V),
     "argnums must be an int or a sequence of ints.*1.0"),
    ("argnums_str", "grad", _mul, dict(argnums="a"), (_V, _V), "argnums must be an int"),
    ("argnums_none", "grad", _mul, dict(argnums=None), (_V, _V), "argnums must be an int"),
    ("argnums_tuple_with_float", "grad", _mul, dict(argnums=(0, 1.0)), (_V, _V),
     "argnums must be an int"),
    ("argnums_nested", "grad", _mul, dict(argnums=((0,),)), (_V, _V), "argnums must be an int"),
    ("keyword_only_call", "grad", _mul, dict(), (), "requires at least 1 positional"),
    ("string_leaf", "grad", lambda p: jnp.sum(p["w"]), dict(), ({"w": _V, "n": "layer0"},),
     "'layer0' of type <class 'str'> is not a valid JAX type"),
    ("object_leaf", "grad", lambda p: jnp.sum(p[0]), dict(), ((_V, object()),),
     "is not a valid JAX type"),
    ("int_input", "grad", lambda i: jnp.sum(i).astype(F32), dict(), (jnp.arange(2),),
     "but got int32.*allow_int"),
    ("bool_input", "grad", lambda i: jnp.sum(i).astype(F32), dict(), (jnp.ones(2, bool),),
     "but got bool.*allow_int"),
    ("key_input", "grad", lambda p: jnp.sum(p[0]), dict(), ((_V, jax.random.key(0)),),
     r"but got key<fry>.*allow_int"),
    ("float0_input", "grad", lambda p: jnp.sum(p[0]), dict(), ((_V, np.zeros(2, FLOAT0)),),
     "numerical-valued inputs"),
    ("float0_input_allow_int", "grad", lambda p: jnp.sum(p[0]), dict(allow_int=True),
     ((_V, np.zeros(2, FLOAT0)),), "numerical-valued inputs"),
    ("holomorphic_real_input", "grad", _sq, dict(holomorphic=True), (_V,),
     "holomorphic=True requires inputs with complex dtype"),
    ("holomorphic_real_output", "grad", lambda z: jnp.sum(z).real, dict(holomorphic=True),
     (_C,), "holomorphic=True requires outputs with complex dtype"),
    ("complex_output", "grad", lambda z: jnp.sum(z), dict(), (_C,),
     "real-valued outputs.*holomorphic=True"),
    ("int_output", "grad", lambda x: jnp.argmax(x), dict(), (_V,), "real-valued outputs"),
    ("key_output", "grad", lambda x: jax.random.key(0), dict(), (_V,), "output element type"),
    ("vector_output", "grad", lambda x: x, dict(), (_V,), "scalar-output"),
    ("has_aux_not_a_pair", "grad", _sq, dict(has_aux=True), (_V,), "two-element tuple"),
    ("has_aux_triple", "grad", lambda x: (_sq(x), 1, 2), dict(has_aux=True), (_V,),
     "two-element tuple"),
    ("not_callable", "grad", 3, dict(), (_V,), "Expected a callable value"),
]


def _transform(lib, name, fun, kwargs):
    return getattr(lib, name)(fun, **kwargs)


@pytest.mark.parametrize("case", _INVALID, ids=[c[0] for c in _INVALID])
def test_invalid_grad_arguments_raise_what_jax_grad_raises(case):
    _, name, fun, kwargs, args, msg = case
    with pytest.raises(Exception) as jax_err:
        _transform(jax, name, fun, kwargs)(*args)
    with pytest.raises(type(jax_err.value), match=msg):
        _transform(hg, name, fun, kwargs)(*args)
    # under jit too (the checks run at trace time)
    with pytest.raises(type(jax_err.value), match=msg):
        jax.jit(lambda *a: _transform(hg, name, fun, kwargs)(*a))(*args) if all(
            isinstance(a, jax.Array) for a in args) else _transform(hg, name, fun, kwargs)(*args)


# (id, transform name, fun, transform kwargs, call args): unusual but valid, as in jax.grad
_VALID = [
    ("argnums_list", "grad", _mul, dict(argnums=[0, 1]), (_V, _V)),
    ("argnums_numpy_int", "grad", _mul, dict(argnums=np.int64(1)), (_V, _V)),
    ("argnums_jax_int", "grad", _mul, dict(argnums=jnp.int32(1)), (_V, _V)),
    ("argnums_bool", "grad", _mul, dict(argnums=True), (_V, _V)),
    ("argnums_negative", "grad", _mul, dict(argnums=-1), (_V, _V)),
    ("argnums_negative_tuple", "value_and_grad", _mul, dict(argnums=(-1, 0)), (_V, _V)),
    ("has_aux_list", "grad", lambda x: [_sq(x), 1], dict(has_aux=True), (_V,)),
    ("has_aux_string", "grad", lambda x: (_sq(x), "layer0"), dict(has_aux=True), (_V,)),
    ("none_leaf", "grad", lambda p: jnp.sum(p["w"]), dict(), ({"w": _V, "n": None},)),
    ("python_float", "grad", lambda x: x * 2.0, dict(), (3.0,)),
    ("int_allow_int", "grad", lambda x, i: jnp.sum(x * i), dict(argnums=(0, 1), allow_int=True),
     (_V, jnp.arange(2.0).astype(jnp.int32).astype(F32))),
    ("key_allow_int", "grad", lambda p: jnp.sum(p[0] * jax.random.normal(p[1], (2,))),
     dict(allow_int=True), ((_V, jax.random.key(1)),)),
    ("holomorphic", "grad", lambda z: jnp.sum(z * z), dict(holomorphic=True), (_C,)),
    ("complex_input_real_output", "grad", lambda z: jnp.sum(z * z).real, dict(), (_C,)),
]


@pytest.mark.parametrize("case", _VALID, ids=[c[0] for c in _VALID])
def test_unusual_valid_grad_arguments_match_jax_grad(case):
    """Float32 inputs: hg's backward runs in float32 like jax's, so results agree to rounding."""
    _, name, fun, kwargs, args = case
    want = _transform(jax, name, fun, kwargs)(*args)
    got = _transform(hg, name, fun, kwargs)(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if isinstance(w, str):
            assert g == w
        elif np.asarray(w).dtype == FLOAT0:
            assert np.asarray(g).dtype == FLOAT0 and np.shape(g) == np.shape(w)
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


# ------------------------------------------------------------------------------ unusual dtypes

def test_float64_tangent_dtype_without_x64_is_a_clear_error():
    x = jnp.ones(3, BF16)
    f = lambda x: jnp.sum(x * x).astype(F32)
    with pytest.raises(ValueError, match=r"float64 needs JAX's 64-bit mode.*enable_x64"):
        hg.grad(f, tangent_dtype=jnp.float64)(x)
    with pytest.raises(ValueError, match="64-bit mode"):
        hg.vjp(f, x, policy=hg.Policy(tangent_dtype=jnp.float64))
    with pytest.raises(ValueError, match="64-bit mode"):
        jax.grad(hg.precise_backward(f, tangent_dtype=jnp.float64))(x)
    with jax.enable_x64(True):
        g = hg.grad(f, tangent_dtype=jnp.float64)(jnp.array([0.5, 1.0, 3.0], BF16))
        assert g.dtype == jnp.float64
        np.testing.assert_array_equal(g, [1.0, 2.0, 6.0])


def test_float64_numpy_inputs_without_x64_are_float32_as_in_jax():
    x = np.array([0.5, 1.5], np.float64)
    g, want = hg.grad(lambda x: jnp.sum(x * x))(x), jax.grad(lambda x: jnp.sum(x * x))(x)
    assert g.dtype == want.dtype == F32
    np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("dtype", [jnp.float8_e8m0fnu, jnp.float8_e3m4, jnp.float8_e4m3,
                                   jnp.float4_e2m1fn], ids=lambda d: jnp.dtype(d).name)
def test_unusual_float_inputs_get_float32_gradients(dtype, maybe_jit):
    """Scale and narrow float types (e8m0 holds only powers of two, no zero, no sign): their
    gradient is float32, exact where jax.grad's (in the input's own dtype) must round: the
    derivative of 3 * p is 3, which e8m0 cannot hold."""
    p = jnp.array([0.5, 1.0, 2.0], dtype)
    f = lambda p: jnp.sum(3 * p.astype(F32) * p.astype(F32))
    g = maybe_jit(hg.grad(f))(p)
    assert g.dtype == F32
    np.testing.assert_array_equal(g, 6 * np.asarray(p, np.float64))  # exact in float32
    assert jax.grad(f)(p).dtype == jnp.dtype(dtype)


def test_int4_inputs_with_allow_int_get_float0(maybe_jit):
    i = jnp.array([1, -2, 3], jnp.int4)
    w = jnp.ones(3, BF16)
    gi, gw = maybe_jit(hg.grad(lambda i, w: jnp.sum(i.astype(F32) * w.astype(F32)),
                               argnums=(0, 1), allow_int=True))(i, w)
    assert gi.dtype == FLOAT0 and gi.shape == (3,) and gw.dtype == F32
    np.testing.assert_array_equal(gw, [1.0, -2.0, 3.0])
