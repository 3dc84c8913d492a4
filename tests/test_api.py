"""hg.vjp / hg.grad / hg.value_and_grad / hg.precise_backward.

References are independent: float64 NumPy backward passes written out by hand over the same
low-precision forward values, or `jax.grad` where dtypes are equal.

Claims about float32 backward matmuls against a float64 reference run with
``Policy(matmul='exact')`` (what 'auto' resolves to on CPU; on a GPU 'auto' is 'fast', which
rounds the cotangent to the low dtype) inside `platforms.highest_precision()` (no TF32 on
GPUs; on CPU both change nothing). CPU-only claims (`platforms.cpu_only`):

| test | why only on XLA:CPU |
| --- | --- |
| `test_vmap_outside` | vmapped vs per-example programs: equal to 1e-6 only if no excess precision |
| `test_precise_backward_under_jax_grad` | two programs' bf16 forwards: likewise |

(Measured: both fail under jit with ``XLA_FLAGS=--xla_allow_excess_precision=true``.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from platforms import cpu_only, highest_precision

import hifigrad as hg

BF16_U = 2.0 ** -8  # bf16 unit roundoff (8 significand bits incl. the implicit one: eps/2)
F32_U = 2.0 ** -24


# --------------------------------------------------------------------------- the seed


@jax.custom_vjp
def identity(x):
    return x


identity.defvjp(lambda x: (x, None), lambda res, g: (g.astype(jnp.float32),))


def seed_model(x):
    def body(carry, _):
        return identity(carry), None

    x = identity(x)
    x = lax.scan(body, x, None, length=2)[0]
    return identity(x)


def test_seed_minimal_example(maybe_jit):
    x = jnp.asarray(8, dtype=jnp.bfloat16)
    g = maybe_jit(hg.grad(seed_model))(x)
    assert g.dtype == jnp.float32 and float(g) == 1.0


STEPS = 16


def realistic(x, w):
    def body(c, _):
        c = identity(jnp.tanh(c * w))
        return c, c

    x = identity(x)
    c, cs = lax.scan(body, x, None, length=STEPS)
    return identity(c).astype(jnp.float32), cs


def _realistic_reference(x, w):
    """float64 backward over the same bf16 forward values (the carries the bf16 forward made)."""
    _, cs = realistic(x, w)
    cs = np.concatenate([[np.float64(x)], np.asarray(cs, np.float64)])
    wf = np.float64(w)
    gc, gw = 1.0, 0.0
    for t in reversed(range(STEPS)):
        y = cs[t + 1]
        d = gc * (1 - y * y)
        gw += d * cs[t]
        gc = d * wf
    return gc, gw


@pytest.mark.parametrize("coefficients", ["forward", "tangent"])
def test_seed_realistic_matches_float64(maybe_jit, coefficients):
    x, w = jnp.asarray(0.8, jnp.bfloat16), jnp.asarray(1.3, jnp.bfloat16)
    pol = hg.Policy(coefficients=coefficients)
    gx, gw = maybe_jit(hg.grad(lambda x, w: realistic(x, w)[0], argnums=(0, 1), policy=pol))(x, w)
    assert gx.dtype == gw.dtype == jnp.float32
    rx, rw = _realistic_reference(x, w)
    if coefficients == "tangent":
        # Only f32 rounding is left: ~2 ops per step, STEPS steps, each 2^-24 relative.
        tol = 4 * STEPS * F32_U
    else:
        # JAX saves tanh's coefficient (1 - y^2, or 1 - y) in bf16: each step's coefficient is off
        # by up to one bf16 rounding, and the errors of STEPS steps add up.
        tol = STEPS * BF16_U
    np.testing.assert_allclose(float(gx), rx, rtol=tol)
    np.testing.assert_allclose(float(gw), rw, rtol=tol)


# --------------------------------------------------------------------------- backward exactness

D, B, L = 16, 4, 32


def mlp(params, x):
    ws, b = params

    def body(c, w):
        c = jnp.tanh(c @ w + b[None])
        return c, c

    c, cs = lax.scan(body, x, ws)
    return jnp.sum(c.astype(jnp.float32)), cs


def _mlp_setup():
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(L, D, D)) / np.sqrt(D) * 1.5, jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(D,)) * 0.1, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(B, D)), jnp.bfloat16)
    return (ws, b), x


def _mlp_reference(params, x):
    """float64 backward over the bf16 forward values, coefficients exact (1 - y^2 in f64)."""
    ws, b = params
    _, cs = mlp(params, x)
    cs = [np.asarray(x, np.float64)] + [np.asarray(c, np.float64) for c in cs]
    wf = np.asarray(ws, np.float64)
    g = np.ones((B, D))
    gws, gb = np.zeros_like(wf), np.zeros(D)
    for i in reversed(range(L)):
        d = g * (1 - cs[i + 1] ** 2)
        gws[i] = cs[i].T @ d
        gb += d.sum(0)
        g = d @ wf[i].T
    return gws, gb


def _rel(got, want):
    got = np.concatenate([np.asarray(a, np.float64).ravel() for a in got])
    want = np.concatenate([np.asarray(a, np.float64).ravel() for a in want])
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_mlp_backward_exact_with_tangent_coefficients(maybe_jit):
    params, x = _mlp_setup()
    ref = _mlp_reference(params, x)
    pol = hg.Policy(coefficients="tangent", matmul="exact")
    with highest_precision():
        g = maybe_jit(hg.grad(lambda p: mlp(p, x)[0], policy=pol))(params)
    err = _rel(g, ref)
    plain = _rel(jax.grad(lambda p: mlp(p, x)[0])(params), ref)
    # Bound: f32 accumulation over L steps of D-term dot products.
    assert err <= 1e-5, err
    assert plain > 100 * err


def test_mlp_backward_exact_over_the_same_residuals(maybe_jit):
    """Default policy vs a float64 backward over the very same bf16 residuals.

    The float64 backward is hifigrad's own with tangent_dtype=float64 under x64: it sees the
    same residuals (including JAX's bf16 coefficients), so the difference is the f32 arithmetic.
    """
    params, x = _mlp_setup()
    with highest_precision():
        g = maybe_jit(hg.grad(lambda p: mlp(p, x)[0], policy=hg.Policy(matmul="exact")))(params)
    with jax.enable_x64(True):
        ref = hg.grad(lambda p: mlp(p, x)[0], tangent_dtype=jnp.float64)(params)
        assert all(r.dtype == jnp.float64 for r in jax.tree_util.tree_leaves(ref))
    err = _rel(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref))
    assert err <= 1e-5, err
    # And against the exact-coefficient reference the default policy is within bf16 rounding of
    # the saved coefficients (one rounding per layer, accumulated over L layers).
    err_exact = _rel(g, _mlp_reference(params, x))
    plain = _rel(jax.grad(lambda p: mlp(p, x)[0])(params), _mlp_reference(params, x))
    assert err_exact <= L * BF16_U, err_exact
    assert plain > err_exact


# --------------------------------------------------------------------------- fp16 underflow


def test_fp16_underflow_without_loss_scaling(maybe_jit):
    """Cotangents of ~1e-9 underflow to zero in fp16 (smallest subnormal 6e-8)."""
    rng = np.random.default_rng(1)
    w1 = jnp.asarray(rng.normal(size=(8, 8)) * 0.3, jnp.float16)
    w2 = jnp.asarray(rng.normal(size=(8, 8)) * 0.3, jnp.float16)
    x = jnp.asarray(rng.normal(size=(2, 8)), jnp.float16)

    def loss(params):
        w1, w2 = params
        h = jnp.tanh(x @ w1)
        return jnp.sum((h @ w2).astype(jnp.float32)) * 1e-9

    g_jax = jax.grad(loss)((w1, w2))
    assert any(float(jnp.max(jnp.abs(g))) == 0.0 for g in g_jax)  # JAX loses them
    # 'exact' matmuls ('auto' on CPU): 'fast' (auto on GPUs) rounds the cotangent to fp16 at
    # each backward matmul, where 1e-9 underflows again. Highest precision: no TF32 on GPUs,
    # whose 2**-11 operand rounding would exceed the 2**-10 tolerance below with the products.
    with highest_precision():
        g = maybe_jit(hg.grad(loss, policy=hg.Policy(matmul="exact")))((w1, w2))
    # float64 reference over the fp16 forward values.
    xf, w1f, w2f = (np.asarray(a, np.float64) for a in (x, w1, w2))
    with highest_precision():  # the forward's fp16 h as in the loss (a TPU's default: bf16 pass)
        h = np.asarray(jnp.tanh(x @ w1), np.float64)
    gw2 = h.T @ np.full((2, 8), 1e-9)
    gh = np.full((2, 8), 1e-9) @ w2f.T
    gw1 = xf.T @ (gh * (1 - h * h))
    # fp16 coefficient (1 - h^2) rounding: 2^-11 relative, plus f32 arithmetic.
    np.testing.assert_allclose(np.asarray(g[1]), gw2, rtol=2 ** -10)
    np.testing.assert_allclose(np.asarray(g[0]), gw1, rtol=2 ** -9, atol=1e-15)
    assert all(float(jnp.max(jnp.abs(a))) > 0 for a in g)


# --------------------------------------------------------------------------- semantics


def test_forward_is_bitwise_unchanged(maybe_jit):
    params, x = _mlp_setup()
    f = lambda p: mlp(p, x)[0]
    v, _ = maybe_jit(hg.value_and_grad(f))(params)
    assert np.array_equal(np.asarray(v), np.asarray(maybe_jit(f)(params)))
    out, _ = hg.vjp(lambda p: mlp(p, x)[1], params)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out), np.asarray(mlp(params, x)[1]))


def test_grad_output_dtypes_and_pytrees(maybe_jit):
    params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float16),
              "c": jnp.ones(2, jnp.float32), "n": jnp.arange(2)}

    def f(p, scale):
        return jnp.sum((p["a"] * 2).astype(jnp.float32)) + jnp.sum(
            p["b"].astype(jnp.float32) * scale) + jnp.sum(p["c"] * p["n"].astype(jnp.float32))

    g, gs = maybe_jit(hg.grad(f, argnums=(0, 1), allow_int=True))(params, jnp.float32(3))
    assert g["a"].dtype == g["b"].dtype == g["c"].dtype == jnp.float32
    assert g["n"].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(g["a"], 2 * np.ones(3))
    np.testing.assert_array_equal(g["b"], 3 * np.ones(2))
    np.testing.assert_array_equal(gs, 2.0)


def test_has_aux_and_value_and_grad(maybe_jit):
    def f(w):
        y = jnp.tanh(w).sum()
        return y.astype(jnp.float32), {"y": y}

    (v, aux), g = maybe_jit(hg.value_and_grad(f, has_aux=True))(jnp.ones(4, jnp.bfloat16))
    assert v.dtype == jnp.float32 and aux["y"].dtype == jnp.bfloat16 and g.dtype == jnp.float32
    g2, aux2 = maybe_jit(hg.grad(f, has_aux=True))(jnp.ones(4, jnp.bfloat16))
    np.testing.assert_array_equal(g, g2)
    assert aux2["y"] == aux["y"]


def test_equals_jax_grad_in_f32(maybe_jit):
    f = lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2)
    w, x = jnp.ones((3, 2)) * 0.3, jnp.arange(6.0).reshape(2, 3)
    got = maybe_jit(hg.grad(f, argnums=(0, 1)))(w, x)
    want = maybe_jit(jax.grad(f, argnums=(0, 1)))(w, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_vjp_accepts_both_cotangent_dtypes(maybe_jit):
    x = jnp.linspace(-1, 1, 5).astype(jnp.bfloat16)
    out, f_vjp = hg.vjp(jnp.sin, x)
    (a,) = maybe_jit(f_vjp)(jnp.ones(5, jnp.bfloat16))
    (b,) = maybe_jit(f_vjp)(jnp.ones(5, jnp.float32))
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="shape"):
        f_vjp(jnp.ones(4, jnp.float32))


def test_vjp_fn_is_a_pytree_of_residuals():
    x = jnp.linspace(-1, 1, 5).astype(jnp.bfloat16)
    out, f_vjp = jax.jit(lambda x: hg.vjp(jnp.sin, x))(x)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    assert leaves and all(isinstance(l, jax.Array) for l in leaves)
    np.testing.assert_allclose(f_vjp(jnp.ones(5))[0], np.cos(np.asarray(x, np.float64)),
                               rtol=2 ** -8)


@cpu_only("vmapped and per-example programs agree to 1e-6 only without excess precision")
def test_vmap_outside(maybe_jit):
    w = jnp.ones((3,), jnp.bfloat16) * 0.5
    xs = jnp.arange(12.0).reshape(4, 3).astype(jnp.bfloat16) / 10
    per_ex = maybe_jit(jax.vmap(hg.grad(lambda w, x: jnp.sum(jnp.tanh(w * x)).astype(
        jnp.float32)), in_axes=(None, 0)))(w, xs)
    assert per_ex.shape == (4, 3) and per_ex.dtype == jnp.float32
    for i in range(4):
        one = hg.grad(lambda w, x: jnp.sum(jnp.tanh(w * x)).astype(jnp.float32))(w, xs[i])
        np.testing.assert_allclose(per_ex[i], one, rtol=1e-6)


def test_grad_of_mixed_precision_program_is_closer_to_f64_than_jax():
    rng = np.random.default_rng(3)
    w32 = jnp.asarray(rng.normal(size=(32, 32)) * 0.2, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)

    def f(w32):
        h = x.astype(jnp.bfloat16)
        for _ in range(6):
            h = jnp.tanh(h @ w32.astype(jnp.bfloat16))
        return jnp.sum(h.astype(jnp.float32) ** 2)

    # float64 backward over the bf16 forward values (taken from the same ops, outside x64).
    hs = [x.astype(jnp.bfloat16)]
    for _ in range(6):
        hs.append(jnp.tanh(hs[-1] @ w32.astype(jnp.bfloat16)))
    hs = [np.asarray(h, np.float64) for h in hs]
    wb = np.asarray(w32.astype(jnp.bfloat16), np.float64)
    g = 2 * hs[-1]
    ref = np.zeros_like(wb)
    for i in reversed(range(6)):
        d = g * (1 - hs[i + 1] ** 2)
        ref += hs[i].T @ d
        g = d @ wb.T

    def err(g):
        return np.linalg.norm(np.asarray(g) - ref) / np.linalg.norm(ref)

    e_jax = err(jax.grad(f)(w32))
    with highest_precision():  # f32 backward matmuls, not TF32, and 'exact' as on CPU
        e_hg = err(hg.grad(f, policy=hg.Policy(matmul="exact"))(w32))
        e_hg_tangent = err(hg.grad(
            f, policy=hg.Policy(coefficients="tangent", matmul="exact"))(w32))
    # The default policy keeps JAX's bf16 coefficients (their rounding dominates); with
    # coefficients in f32 only f32 arithmetic error is left.
    assert e_hg < e_jax, (e_hg, e_jax)
    assert e_hg_tangent < e_jax / 10, (e_hg_tangent, e_jax)


# --------------------------------------------------------------------------- precise_backward


@cpu_only("two programs' bf16 forwards agree to 1e-6 only without excess precision")
def test_precise_backward_under_jax_grad(maybe_jit):
    def layer(w32, x):
        return jnp.sum(jnp.tanh(x @ w32.astype(jnp.bfloat16)).astype(jnp.float32))

    f = hg.precise_backward(layer)
    w = jnp.ones((4, 3)) * 0.1
    x = jnp.ones((2, 4), jnp.bfloat16)
    gw, gx = maybe_jit(jax.grad(f, argnums=(0, 1)))(w, x)
    assert gw.dtype == jnp.float32 and gx.dtype == jnp.bfloat16
    hw, hx = hg.grad(layer, argnums=(0, 1))(w, x)
    np.testing.assert_allclose(gw, hw, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx, np.float32), hx, rtol=2 ** -8)
    assert np.array_equal(np.asarray(f(w, x)), np.asarray(layer(w, x)))


def test_precise_backward_inside_hg_grad_is_full_precision():
    """Nested in hg.grad, the boundary casts are promoted away: no bf16 rounding at all."""
    def block(x):
        return jnp.tanh(x) * 3

    x = jnp.linspace(-1, 1, 7).astype(jnp.bfloat16)
    g_nested = hg.grad(lambda x: jnp.sum(hg.precise_backward(block)(x).astype(jnp.float32)))(x)
    g_plain = hg.grad(lambda x: jnp.sum(block(x).astype(jnp.float32)))(x)
    np.testing.assert_array_equal(g_nested, g_plain)


def _closing_over(how):
    """A loss of `p` whose precise_backward-wrapped part closes over `p` (a value jax.grad is
    differentiating), and the same loss without the wrapper."""
    x = jnp.linspace(-1, 1, 6).astype(jnp.bfloat16)

    def inner(p, x):
        if how == "returned":  # the closed-over tracer leaves untouched
            return jnp.sum(jnp.tanh(x).astype(jnp.float32)), p
        return jnp.sum((jnp.tanh(x * p.astype(jnp.bfloat16)) ** 2).astype(jnp.float32)), p * 0

    def loss(p, wrap):
        f = (lambda x: inner(p, x))
        a, b = (hg.precise_backward(f) if wrap else f)(x)
        return a + 3 * b

    return loss


@pytest.mark.parametrize("how", ["used", "returned"])
def test_precise_backward_differentiates_values_it_closes_over(how, maybe_jit):
    """Eagerly, precise_backward runs the function as it is and falls back to converting its
    closure when a closed-over value is being differentiated; either way that value's gradient
    is the one hg.grad gives without the wrapper (the same float32 backward of the same bf16
    forward: equal up to float32 rounding)."""
    loss = _closing_over(how)
    p = jnp.float32(0.75)
    got = maybe_jit(jax.grad(lambda p: loss(p, True)))(p)
    want = hg.grad(lambda p: loss(p, False))(p)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=4 * float(jnp.finfo(jnp.float32).eps))
    # Under vmap (nothing eager): the closure is converted, as always.
    ps = jnp.asarray([0.5, 0.75], jnp.float32)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda p: loss(p, True)))(ps),
                               jax.vmap(hg.grad(lambda p: loss(p, False)))(ps),
                               rtol=4 * float(jnp.finfo(jnp.float32).eps))


def test_precise_backward_converts_closures_only_when_it_must(monkeypatch):
    """Eager calls under jax.grad run the function itself (converting its closure replays its
    program op by op); traced calls convert it."""
    calls = []
    convert = jax.closure_convert
    monkeypatch.setattr(jax, "closure_convert", lambda *a: calls.append(1) or convert(*a))
    f = hg.precise_backward(lambda w, x: jnp.sum(jnp.tanh(x * w.astype(jnp.bfloat16))
                                                 .astype(jnp.float32)))
    # (x not symmetric about 0: there the gradient is 0 up to rounding, whose sign eager and
    # jitted float32 coefficients, a TPU's default, drew differently: +-6e-8)
    w, x = jnp.float32(0.5), jnp.linspace(-1, 2, 4).astype(jnp.bfloat16)
    g_eager = jax.grad(f)(w, x)
    assert calls == []
    g_jit = jax.jit(jax.grad(f))(w, x)
    assert calls
    np.testing.assert_array_equal(g_eager, g_jit)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_float_tangent_dtype(bad):
    with pytest.raises(ValueError, match="tangent_dtype must be a real floating dtype"):
        hg.grad(jnp.sum, tangent_dtype=bad)(jnp.ones(2))


def test_tangent_dtype_less_precise_than_primal():
    with pytest.raises(ValueError) as e:
        hg.grad(jnp.sum, tangent_dtype=jnp.bfloat16)(jnp.ones(2, jnp.float32))
    assert "bfloat16" in str(e.value) and "float32" in str(e.value)
    with pytest.raises(ValueError, match="float16"):
        hg.vjp(jnp.sin, jnp.ones(2, jnp.bfloat16), tangent_dtype=jnp.float16)


def test_policy_conflict_and_bad_fields():
    with pytest.raises(ValueError, match="conflicts"):
        hg.grad(jnp.sum, tangent_dtype=jnp.float64, policy=hg.Policy())(jnp.ones(2))
    with pytest.raises(ValueError, match="matmul"):
        hg.Policy(matmul="fastest")


def test_grad_errors_mirror_jax():
    with pytest.raises(TypeError, match="scalar-output"):
        hg.grad(lambda x: x)(jnp.ones(2))
    with pytest.raises(TypeError, match="integer-valued inputs"):
        hg.grad(lambda x: jnp.sum(x).astype(jnp.float32))(jnp.ones(2, jnp.int32))
    with pytest.raises(TypeError, match="real-valued outputs"):
        hg.grad(lambda x: jnp.sum(x).astype(jnp.int32))(jnp.ones(2))


def test_second_order(maybe_jit):
    """hg.grad of hg.grad (the backward program, holding staged up-casts, is differentiated)."""
    f = lambda x: jnp.sum(jnp.tanh(x * 2).astype(jnp.float32) ** 2)
    x = jnp.linspace(-1, 1, 4)
    h = maybe_jit(hg.grad(lambda x: jnp.sum(hg.grad(f)(x))))(x)
    want = jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))(x)
    np.testing.assert_allclose(h, want, rtol=1e-5)
    hb = maybe_jit(hg.grad(lambda x: jnp.sum(hg.grad(f)(x))))(x.astype(jnp.bfloat16))
    assert hb.dtype == jnp.float32
    np.testing.assert_allclose(hb, want, rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- non-float leaves


def _keyed_loss(p):
    w, key = p
    noise = jax.random.normal(key, w.shape, w.dtype)
    return jnp.sum((w * noise).astype(jnp.float32) ** 2)


def test_typed_prng_key_leaves_flow_as_non_differentiable_values(maybe_jit):
    """A typed key (jax.random.key) in the differentiated pytree is passed through as it is and
    gets a float0 gradient, as under jax.grad(allow_int=True); float leaves beside it get their
    gradient (equal to jax.grad's in float32, where dtypes are equal)."""
    key = jax.random.key(3)
    w = jnp.linspace(-1, 1, 4, dtype=jnp.float32)
    got = maybe_jit(hg.grad(_keyed_loss, allow_int=True))((w, key))
    want = jax.grad(_keyed_loss, allow_int=True)((w, key))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1].dtype == jax.dtypes.float0 and got[1].shape == key.shape
    gb = maybe_jit(hg.grad(_keyed_loss, allow_int=True))((w.astype(jnp.bfloat16), key))
    assert gb[0].dtype == jnp.float32 and gb[1].dtype == jax.dtypes.float0


def test_typed_prng_keys_through_vjp_and_precise_backward(maybe_jit):
    key = jax.random.key(0)
    keys = jax.random.split(key, 2)
    w = jnp.linspace(-1, 1, 4, dtype=jnp.bfloat16)

    def f(w, keys):  # a key output, too
        return jnp.sum(w * jax.random.normal(keys[0], w.shape, w.dtype)), jax.random.split(keys[1])

    def run(w, keys):
        (y, k2), f_vjp = hg.vjp(f, w, keys)
        return y, k2, f_vjp((jnp.float32(1), np.zeros(k2.shape, jax.dtypes.float0)))

    y, k2, (gw, gk) = maybe_jit(run)(w, keys)
    assert jax.dtypes.issubdtype(k2.dtype, jax.dtypes.prng_key) and k2.shape == (2,)
    noise = jax.random.normal(keys[0], w.shape, w.dtype)
    np.testing.assert_array_equal(gw, noise.astype(jnp.float32))  # d(sum(w*n))/dw = n, exactly
    assert gw.dtype == jnp.float32 and gk.dtype == jax.dtypes.float0 and gk.shape == (2,)

    pb = hg.precise_backward(lambda w32, k: jnp.sum(
        w32.astype(jnp.bfloat16) * jax.random.normal(k, w32.shape, jnp.bfloat16)))
    g = maybe_jit(jax.grad(lambda w32, k: pb(w32, k).astype(jnp.float32)))(
        w.astype(jnp.float32), key)
    np.testing.assert_array_equal(
        g, jax.random.normal(key, w.shape, jnp.bfloat16).astype(jnp.float32))


def test_float0_leaves_are_passed_through_vjp(maybe_jit):
    z = np.zeros(3, jax.dtypes.float0)
    w = jnp.ones(3, jnp.bfloat16)
    y, f_vjp = hg.vjp(lambda w, z: jnp.sum(w * w), w, z)
    gw, gz = maybe_jit(f_vjp)(jnp.float32(1))
    np.testing.assert_array_equal(gw, np.full(3, 2.0, np.float32))
    assert gz.dtype == jax.dtypes.float0 and gz.shape == (3,)


# --------------------------------------------------------------------------- every policy
# Every non-default Policy over the program corpus (tests/programs.py), as the default policy
# runs it in test_rules: float32 gradients of bf16 programs that point where jax.grad's float32
# ones do, float32 programs equal to jax.grad's, and second derivatives. The whole sweep is
# marked `sweep` (`make test-all`); FAST_PROGRAMS (a matmul MLP, a scanned RNN, a user
# custom_vjp, integer_pow / div / rsqrt) runs by default, jitted (so CI's jitted subset runs it
# on every release).

from programs import ALL as _ALL_PROGRAMS  # noqa: E402
from programs import PROGRAMS as _PROGRAMS  # noqa: E402

F64 = jnp.float64
POLICIES = {
    "coefficients_tangent": dict(coefficients="tangent"),
    "matmul_fast": dict(matmul="fast"),
    "matmul_exact": dict(matmul="exact"),
    "unsupported_error": dict(unsupported="error"),
    "matmul_precision_highest": dict(matmul_precision="highest"),
    "tangent_float64_x64": dict(tangent_dtype=F64),
    "tangent_fast_error": dict(coefficients="tangent", matmul="fast", unsupported="error"),
}
FAST_PROGRAMS = ["matmul_mlp", "scan_rnn", "custom_vjp_user", "pow_div_rsqrt"]


def _float_argnums(args):
    return tuple(i for i, a in enumerate(args) if all(
        jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree_util.tree_leaves(a)))


def _flat64(t):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(t)])


def _policy_case(policy_id):
    """(Policy, context manager): float64 tangents need x64, entered only around the case."""
    kw = POLICIES[policy_id]
    import contextlib

    ctx = jax.enable_x64(True) if kw.get("tangent_dtype") == F64 else contextlib.nullcontext()
    return kw, ctx


def _run_program_under_policy(name, policy_id, dtype):
    fun, make = _PROGRAMS[name]
    kw, ctx = _policy_case(policy_id)
    with ctx:
        policy = hg.Policy(**kw)
        args = make(dtype)
        nums = _float_argnums(args)
        got = jax.jit(hg.grad(fun, argnums=nums, policy=policy))(*args)
        ref_args = make(jnp.float32)
        with highest_precision():
            want = jax.jit(jax.grad(fun, argnums=nums))(*ref_args)
    want_dtype = F64 if kw.get("tangent_dtype") == F64 else jnp.float32
    for g in jax.tree_util.tree_leaves(got):
        assert g.dtype == want_dtype, (g.dtype, want_dtype)
        assert np.all(np.isfinite(np.asarray(g)))
    return _flat64(got), _flat64(want)


def _check_low_precision(name, policy_id, dtype):
    g, w = _run_program_under_policy(name, policy_id, dtype)
    # As test_rules' default-policy check: a bf16/fp16 forward's rounding (2**-8 / 2**-11
    # relative per op) moves the gradient a few percent at most over these programs.
    cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30)
    assert cos >= 0.99, cos


def _check_f32(name, policy_id):
    g, w = _run_program_under_policy(name, policy_id, jnp.float32)
    # float32 primals: the backward is float32 (float64 under the f64 policy) over the same
    # residuals; tangent coefficients use other float32 formulas than JAX's. Differences are
    # float32 roundings accumulated over at most ~1e3 operations: 1e-4 of the gradient's norm.
    assert np.linalg.norm(g - w) <= 1e-4 * np.linalg.norm(w) + 1e-30, (
        np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-30))


@pytest.mark.parametrize("name", FAST_PROGRAMS)
@pytest.mark.parametrize("policy_id", sorted(POLICIES))
def test_policy_over_programs_bf16_jit(policy_id, name):
    _check_low_precision(name, policy_id, jnp.bfloat16)


@pytest.mark.sweep
@pytest.mark.parametrize("name", _ALL_PROGRAMS)
@pytest.mark.parametrize("policy_id", sorted(POLICIES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_policy_over_all_programs_low_precision_jit(policy_id, name, dtype):
    _check_low_precision(name, policy_id, dtype)


@pytest.mark.sweep
@pytest.mark.parametrize("name", [n for n in _ALL_PROGRAMS if n != "mixed_precision_casts"])
@pytest.mark.parametrize("policy_id", sorted(POLICIES))
def test_policy_over_all_programs_f32_jit(policy_id, name):
    _check_f32(name, policy_id)


# Programs whose second derivative jax.grad itself cannot take (hg raises JAX's error there).
_NO_SECOND_ORDER = {
    "pure_callback_in_backward": "a pure_callback has no JVP rule in JAX",
    "remat_offload": "JAX's transpose of host-offloaded residuals rejects a float32<host> "
                     "cotangent",
    "while_in_backward": "JAX cannot reverse-differentiate the backward's while_loop",
}
FAST_SECOND_ORDER = ["custom_vjp_user", "pow_div_rsqrt"]


def _second_order_param(name):
    if name in _NO_SECOND_ORDER:
        return pytest.param(name, marks=pytest.mark.xfail(
            reason=_NO_SECOND_ORDER[name], raises=ValueError, strict=True))
    return name


def _check_second_order(name, policy_id):
    """jax.grad of a weighted sum of hg.grad(policy)'s float32 gradient equals the same with
    jax.grad inside (float32 programs; float64 tangents under the float64 policy)."""
    fun, make = _PROGRAMS[name]
    kw, ctx = _policy_case(policy_id)

    def second(inner, args, nums):
        def h(*a):
            g = inner(fun, argnums=nums)(*a)
            return sum(jnp.sum(x.astype(jnp.float32) * 0.5) for x in jax.tree_util.tree_leaves(g))
        return jax.jit(jax.grad(h, argnums=nums))(*args)

    with ctx:
        args = make(jnp.float32)
        nums = _float_argnums(args)
        with highest_precision():
            got = second(lambda f, argnums: hg.grad(f, argnums=argnums,
                                                    policy=hg.Policy(**kw)), args, nums)
            want = second(jax.grad, args, nums)
    g, w = _flat64(got), _flat64(want)
    # float32 roundings of two second-order programs over ~1e2 ops (measured <= 3e-7)
    assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w) + 1e-30, (
        np.linalg.norm(g - w) / (np.linalg.norm(w) + 1e-30))


@pytest.mark.parametrize("name", FAST_SECOND_ORDER)
@pytest.mark.parametrize("policy_id", sorted(POLICIES))
def test_policy_second_order_jit(policy_id, name):
    _check_second_order(name, policy_id)


@pytest.mark.sweep
@pytest.mark.parametrize("name", [_second_order_param(n) for n in _ALL_PROGRAMS
                                  if n != "mixed_precision_casts"])
@pytest.mark.parametrize("policy_id", sorted(POLICIES))
def test_policy_second_order_over_all_programs_jit(policy_id, name):
    _check_second_order(name, policy_id)


# ------------------------------------------------------------------------------ program cache

def _program_cache():
    from hifigrad._src import api as _api

    return _api


def _uncached(monkeypatch):
    monkeypatch.setattr(_program_cache(), "_backward_program", lambda *a, **k: None)


def test_eager_backward_is_traced_once_and_replayed_bitwise(monkeypatch):
    api = _program_cache()
    api._PROGRAMS.clear()
    w = jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16).reshape(2, 3)

    def f(w):
        return jnp.sum(jnp.tanh(w @ w.T))

    first, second = hg.grad(f)(w), hg.grad(f)(w)
    assert len(api._PROGRAMS) == 1  # the second call replayed the first call's program
    _, vjp_fn = hg.vjp(f, w)
    reused = [vjp_fn(jnp.float32(1.0))[0] for _ in range(2)]
    assert len(api._PROGRAMS) == 1  # a vjp_fn over the same program shares it
    _uncached(monkeypatch)
    fresh = hg.grad(f)(w)
    for g in (first, second, *reused):
        assert g.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(fresh))


def test_cached_backward_never_serves_a_stale_program():
    api = _program_cache()
    api._PROGRAMS.clear()
    w = jnp.linspace(0.5, 1.5, 4, dtype=jnp.bfloat16)
    scale = [2.0]

    def f(w):  # a Python closure value: part of the program, not an input
        return jnp.sum(jnp.sin(w) * scale[0])

    def g(w):  # another function, same avals
        return jnp.sum(jnp.cos(w))

    # The coefficients as the forward computes them (the default on CPU; a TPU's default is
    # 'tangent', float32 coefficients): the values below are the forward's own.
    policy = hg.Policy(coefficients="forward")

    def check(fun, w, want):
        got = hg.grad(fun, policy=policy)(w)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)

    # The derivative coefficients are the forward's own (cos and sin rounded to the input's
    # dtype); the backward multiplies them exactly in float32.
    def cos(w):
        return np.asarray(jnp.cos(w), np.float32)

    check(f, w, 2.0 * cos(w))
    scale[0] = 3.0
    check(f, w, 3.0 * cos(w))
    check(g, w, -np.asarray(jnp.sin(w), np.float32))
    w16 = w.astype(jnp.float16)  # another dtype
    check(f, w16, 3.0 * cos(w16))
    # The closure value reaches the linear program as a residual (an input), so both scales
    # share one program; the other function and the other dtype have their own.
    assert len(api._PROGRAMS) == 3
    # A changed rule table is a new program too (its version is part of the key).
    from hifigrad._src.rules import PROMOTE

    before = PROMOTE.version
    PROMOTE.register([], None)  # registers nothing, but bumps the version
    assert PROMOTE.version == before + 1
    check(f, w, 3.0 * cos(w))
    assert len(api._PROGRAMS) == 4


def test_program_cache_is_bounded(monkeypatch):
    api = _program_cache()
    api._PROGRAMS.clear()
    monkeypatch.setattr(api, "_PROGRAMS_SIZE", 2)
    # Four programs (distinct shapes), of which the cache keeps the last two.
    for k in range(4):
        v = jnp.ones(3 + k, jnp.bfloat16)
        g = hg.grad(lambda w: jnp.sum(w * w))(v)
        np.testing.assert_array_equal(np.asarray(g), np.full(3 + k, 2.0, np.float32))
    assert len(api._PROGRAMS) == 2


def test_traced_calls_bypass_the_program_cache():
    api = _program_cache()
    api._PROGRAMS.clear()
    w = jnp.ones(3, jnp.bfloat16)
    g = jax.jit(hg.grad(lambda w: jnp.sum(jnp.exp(w))))(w)
    np.testing.assert_allclose(np.asarray(g), np.full(3, np.e), rtol=1e-2)
    assert len(api._PROGRAMS) == 0


# --------------------------------------------------------------------------- extended leaves
_EXTRA_LEAVES = {
    "typed_key": lambda: jax.random.key(7),
    "key_array": lambda: jax.random.split(jax.random.key(7), 3),
    "int4": lambda: jnp.array([1, -2, 3], jnp.int4),
    "int8": lambda: jnp.array([1, -2, 3], jnp.int8),
    "bool": lambda: jnp.array([True, False, True]),
    "float8_e8m0fnu": lambda: jnp.array([0.5, 1.0, 4.0], jnp.float8_e8m0fnu),
    "float8_e3m4": lambda: jnp.array([0.5, -1.0, 3.0], jnp.float8_e3m4),
    "float64_numpy_without_x64": lambda: np.array([0.5, -1.0, 3.0]),
}


def _uses_extra(w, extra):
    """A bf16 loss of `w` that reads `extra` (a key draws noise; a number scales)."""
    if jax.dtypes.issubdtype(extra.dtype, jax.dtypes.prng_key):
        k = extra if extra.shape == () else extra[0]
        s = jax.random.uniform(k, w.shape, jnp.float32)
    else:
        s = jnp.asarray(extra).astype(jnp.float32)
    return jnp.sum((jnp.tanh(w) * w).astype(jnp.float32) * s)


@pytest.mark.parametrize("kind", sorted(_EXTRA_LEAVES))
def test_extended_and_unusual_leaves_beside_a_bf16_weight(kind, maybe_jit):
    """Each leaf kind in the differentiated pytree: the weight's gradient is float32 and equals
    hg.grad with the leaf closed over; the leaf's gradient is float0 where jax.grad's is, and
    the exact float32 gradient where jax.grad differentiates it (a float leaf)."""
    extra = _EXTRA_LEAVES[kind]()
    w = jnp.linspace(-1, 1, 3).astype(jnp.bfloat16)
    gw, ge = maybe_jit(hg.grad(lambda p: _uses_extra(*p), allow_int=True))((w, extra))
    alone = hg.grad(lambda w: _uses_extra(w, extra))(w)
    assert gw.dtype == jnp.float32
    np.testing.assert_allclose(gw, alone, rtol=1e-6)
    jge = jax.grad(lambda p: _uses_extra(*p), allow_int=True)((w, extra))[1]
    if np.asarray(jge).dtype == jax.dtypes.float0:
        assert ge.dtype == jax.dtypes.float0 and ge.shape == np.shape(extra)
    else:
        # d/ds sum(y * s) = y = tanh(w) * w, a bf16 value: exact in float32. (jax.grad's own
        # gradient has the leaf's dtype: float8_e8m0fnu has no zero, so it gives NaN where
        # y = 0, and rounds 0.76 to 1.)
        assert ge.dtype == jnp.float32
        np.testing.assert_array_equal(ge, (jnp.tanh(w) * w).astype(jnp.float32))
    _, f_vjp = hg.vjp(_uses_extra, w, extra)
    vw, _ = maybe_jit(f_vjp)(jnp.float32(1))
    np.testing.assert_allclose(vw, alone, rtol=1e-6)
