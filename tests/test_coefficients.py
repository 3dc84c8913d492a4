"""Policy(coefficients='tangent'): each elementwise op's derivative coefficient in f32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hifigrad as hg

OPS = {
    "tanh": (jnp.tanh, lambda x: 1 - np.tanh(x) ** 2),
    "logistic": (jax.nn.sigmoid, lambda x: np.exp(-x) / (1 + np.exp(-x)) ** 2),
    "exp": (jnp.exp, np.exp),
    "expm1": (jnp.expm1, np.exp),
    "log": (jnp.log, lambda x: 1 / x),
    "log1p": (jnp.log1p, lambda x: 1 / (1 + x)),
    "sin": (jnp.sin, np.cos),
    "cos": (jnp.cos, lambda x: -np.sin(x)),
    "sqrt": (jnp.sqrt, lambda x: 0.5 / np.sqrt(x)),
    "rsqrt": (lax.rsqrt, lambda x: -0.5 * x ** -1.5),
    "erf": (jax.scipy.special.erf, lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x)),
    "integer_pow": (lambda x: x ** 3, lambda x: 3 * x ** 2),
    "div": (lambda x: 1 / x, lambda x: -1 / x ** 2),
}
POSITIVE = {"log", "log1p", "sqrt", "rsqrt", "div"}


@pytest.mark.parametrize("name", sorted(OPS))
def test_coefficient_in_f32(name, maybe_jit):
    fn, deriv = OPS[name]
    lo, hi = (0.5, 2.5) if name in POSITIVE else (-1, 1)
    x = jnp.linspace(lo, hi, 33).astype(jnp.bfloat16)
    f = lambda x: jnp.sum(fn(x).astype(jnp.float32))
    g = maybe_jit(hg.grad(f, policy=hg.Policy(coefficients="tangent")))(x)
    want = deriv(np.asarray(x, np.float64))
    # The coefficient is computed in f32 from the bf16-exact input (or the bf16 output): only
    # f32 rounding, plus the bf16 rounding of the saved output where the coefficient uses it
    # (tanh, logistic, exp, expm1, sqrt keep y = f(x) rounded to bf16: 2^-9 relative).
    saves_output = name in ("tanh", "logistic", "exp", "expm1", "sqrt")
    tol = 2 ** -7 if saves_output else 1e-5
    np.testing.assert_allclose(np.asarray(g), want, rtol=tol, atol=tol)
    # The forward is unchanged.
    v, _ = hg.value_and_grad(f, policy=hg.Policy(coefficients="tangent"))(x)
    assert np.array_equal(np.asarray(v), np.asarray(f(x)))


def test_inside_scan_and_remat(maybe_jit):
    def f(w, xs):
        body = jax.checkpoint(lambda c, x: (jnp.tanh(c * w + x), None))
        return jnp.sum(lax.scan(body, jnp.zeros(4, w.dtype), xs)[0].astype(jnp.float32))

    w = jnp.full(4, 0.7, jnp.bfloat16)
    xs = jnp.linspace(-1, 1, 24).reshape(6, 4).astype(jnp.bfloat16)
    pol = hg.Policy(coefficients="tangent")
    g = maybe_jit(hg.grad(f, policy=pol))(w, xs)
    g_fwd = hg.grad(f)(w, xs)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_fwd, rtol=2 ** -5)


TANGENT = hg.Policy(coefficients="tangent")
# 0, -0, +-inf, NaN, float32 subnormals (the smallest, one near the top of the range), and
# ordinary values on both sides of 1.
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.4e-45, -1e-39, 1e-38, 1.0, -1.5, 3.0],
                   np.float32)


@pytest.mark.parametrize("n", range(-3, 5))
def test_integer_pow_at_special_values_matches_jax_grad(n, maybe_jit):
    """x**n for every exponent -3..4 at 0, -0, +-inf, NaN and subnormals: in float32 the
    tangent coefficient is JAX's own formula at the same dtype, so values, NaN and inf
    positions match jax.grad exactly (x**0 used to give 0 * x**-1: NaN at 0)."""
    f = lambda x: jnp.sum(lax.integer_pow(x, n))
    x = jnp.asarray(SPECIAL)
    got = maybe_jit(hg.grad(f, policy=TANGENT))(x)
    want = jax.grad(f)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_polynomial_with_a_constant_term_at_zero():
    """sum(c[i] * x**i), i = 0..3, at x = 0 in bf16: the x**0 term's derivative is 0."""
    c = jnp.array([0.5, -1.0, 2.0, 0.25])
    p = lambda x: jnp.sum(sum(c[i] * x.astype(jnp.float32) ** i for i in range(4)))
    for dt in (jnp.bfloat16, jnp.float32):
        xs = jnp.array([0.0, 1.0, -0.5], dt)
        got = hg.grad(p, policy=TANGENT)(xs)
        xd = np.asarray(xs, np.float64)
        want = -1.0 + 4.0 * xd + 0.75 * xd ** 2  # p'(x), exact in float32 at these points
        np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def _tanh_sq(x):
    return jnp.sum(jnp.tanh(x) ** 2 + jnp.exp(x) / (1 + x * x))


@pytest.mark.parametrize("how", ["jacfwd", "jacrev", "grad_of_grad", "hg_grad_of_grad"])
def test_higher_order_over_tangent_coefficients(how, maybe_jit):
    """Second derivatives of hg.grad(policy=tangent) equal jax's in float32 (they failed with a
    tuple-vs-list jvp error in coef_mul's JVP rule)."""
    x = jnp.linspace(-1, 1, 5)
    g = hg.grad(_tanh_sq, policy=TANGENT)
    got = maybe_jit({"jacfwd": jax.jacfwd(g), "jacrev": jax.jacrev(g),
                     "grad_of_grad": jax.grad(lambda x: jnp.sum(g(x))),
                     "hg_grad_of_grad": hg.grad(lambda x: jnp.sum(g(x)), policy=TANGENT)}[how])(x)
    want = jax.hessian(_tanh_sq)(x)
    if how.endswith("grad_of_grad"):
        want = want.sum(0)
    # float32 coefficients computed by two formulas (1 - y*y vs JAX's own): a few f32 ulps
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_python_control_flow_on_a_value_is_a_clear_error():
    def f(x):
        if x[0] > 0:  # Python control flow on a value
            return jnp.sum(jnp.tanh(x))
        return jnp.sum(x)

    x = jnp.linspace(-1, 1, 3)
    np.testing.assert_allclose(hg.grad(f)(x), jax.grad(f)(x))  # the default policy runs it
    with pytest.raises(TypeError, match=r"coefficients='tangent'.*abstractly.*jnp.where.*"
                                        r"coefficients='forward'"):
        hg.grad(f, policy=TANGENT)(x)


def test_non_array_aux_under_tangent_coefficients(maybe_jit):
    """A string, a Python int and None in has_aux output are returned as they are (they were
    traced, and a string failed); array aux leaves come back as values."""
    x = jnp.linspace(-1, 1, 3)
    aux_of = lambda x: {"name": "layer0", "n": 3, "none": None, "double": x * 2}
    f = lambda x: (_tanh_sq(x), aux_of(x))
    (v, aux), g = hg.value_and_grad(f, has_aux=True, policy=TANGENT)(x)
    (jv, jaux), jg = jax.value_and_grad(f, has_aux=True)(x)
    assert aux["name"] == "layer0" and aux["n"] == 3 and aux["none"] is None
    np.testing.assert_array_equal(aux["double"], jaux["double"])
    np.testing.assert_allclose(g, jg, rtol=1e-6)
    (_, aux_j), _ = maybe_jit(hg.value_and_grad(lambda x: (_tanh_sq(x), {"d": x * 2}),
                                                has_aux=True, policy=TANGENT))(x)
    np.testing.assert_array_equal(aux_j["d"], x * 2)
