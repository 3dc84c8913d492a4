"""hifigrad.equinox: filter_grad / filter_value_and_grad against eqx.filter_grad /
filter_value_and_grad, eagerly and under eqx.filter_jit.

float32 gradients compared with equinox's to float32 rounding run in
`platforms.highest_precision()`: on an NVIDIA GPU a float32 matmul at the default precision is
TF32, and operands that differ by a reordered float32 sum can round to TF32 values 2**-10 apart
(on CPU the context changes nothing).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from platforms import highest_precision

import hifigrad as hg

eqx = pytest.importorskip("equinox", reason="equinox is not installed")


class _Net(eqx.Module):
    """Linear -> BatchNorm (eqx.nn.State) -> activation -> Linear, with non-array fields: a
    function, a string, an int, an integer array and a static field."""

    lin1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    lin2: eqx.nn.Linear
    act: object
    name: str
    depth: int
    steps: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, key, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(4, 8, key=k1, dtype=dtype)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.5, mode="batch",
                                   dtype=dtype)
        self.lin2 = eqx.nn.Linear(8, 3, key=k2, dtype=dtype)
        self.act = jax.nn.gelu
        self.name = "net"
        self.depth = 2
        self.steps = jnp.zeros((), jnp.int32)
        self.scale = 0.5

    def __call__(self, x, state):
        h, state = self.bn(self.act(self.lin1(x)), state)
        return self.scale * self.lin2(h), state


def _make(dtype=jnp.float32):
    return eqx.nn.make_with_state(_Net)(jax.random.key(0), dtype)


def _x(dtype=jnp.float32):
    return jnp.sin(jnp.arange(24, dtype=jnp.float32).reshape(6, 4)).astype(dtype)


def _loss(model, state, x):
    """Returns (loss, new BatchNorm state): equinox's way of threading mutable state."""
    y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state)
    y = y.astype(jnp.float32)
    return jnp.mean(y * y), state


def _arrays(tree) -> list:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _maybe_filter_jit(maybe_jit):
    return eqx.filter_jit if maybe_jit is jax.jit else (lambda f: f)


@pytest.mark.parametrize("kind", ["filter_grad", "filter_value_and_grad"])
def test_f32_equals_equinox(maybe_jit, kind):
    """At float32: the same gradient pytree as equinox's (None for the function, string, int,
    integer-array and static fields) with the same values, and bitwise the same loss and new
    BatchNorm state (returned as aux)."""
    jit = _maybe_filter_jit(maybe_jit)
    model, state = _make()
    with highest_precision():  # float32 vs float32 to 64 eps32: no TF32 (module docstring)
        ref = jit(getattr(eqx, kind)(_loss, has_aux=True))(model, state, _x())
        got = jit(getattr(hg.equinox, kind)(_loss, has_aux=True))(model, state, _x())
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    if kind == "filter_grad":  # (grads, new state)
        (g_ref, fwd_ref), (g, fwd) = ref, got
    else:  # ((loss, new state), grads)
        (fwd_ref, g_ref), (fwd, g) = ref, got
    for a, b in zip(_arrays(fwd_ref), _arrays(fwd)):  # forward values: bitwise
        np.testing.assert_array_equal(a, b)
    # Same forward, float32 backward: equal up to the order of float32 sums (at most 6 * 8
    # terms per element here, of the order of the largest gradient entry: 64 eps32 of that
    # bounds a reordering). Measured: bitwise under jit, 1e-5 relative on a near-cancelling
    # element eagerly (jax 0.12).
    scale = max(float(np.max(np.abs(a))) for a in _arrays(g_ref))
    for a, b in zip(_arrays(g_ref), _arrays(g)):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=0, atol=64 * np.finfo(np.float32).eps * scale)
    assert g.act is None and g.name is None and g.depth is None and g.steps is None
    assert g.lin1.weight.shape == (8, 4)


# Eagerly, every op of the vmapped BatchNorm model compiles on its own: ~25 s here (slow suite).
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow, id="eager"),
                                 pytest.param(True, id="jit")])
def test_bf16_float32_grads(jit):
    """A bf16 model: float32 gradients, the same loss and BatchNorm state as equinox's bf16
    run (the forward is unchanged), and a gradient closer to the float32 model's (same
    bf16-rounded parameters and input, computed in float32) than equinox's bf16 gradient."""
    jit = eqx.filter_jit if jit else (lambda f: f)
    model, state = _make(jnp.bfloat16)
    x = _x(jnp.bfloat16)
    (l_ref, s_ref), g_ref = jit(eqx.filter_value_and_grad(_loss, has_aux=True))(model, state, x)
    (l_hg, s_hg), g_hg = jit(hg.equinox.filter_value_and_grad(_loss, has_aux=True))(
        model, state, x)
    np.testing.assert_array_equal(l_ref, l_hg)
    for a, b in zip(_arrays(s_ref), _arrays(s_hg)):
        np.testing.assert_array_equal(a, b)
    up = lambda t: jax.tree.map(  # noqa: E731
        lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, t)
    g32 = eqx.filter_jit(eqx.filter_grad(_loss, has_aux=True))(up(model), up(state), up(x))[0]
    got, bf16, ref = _arrays(g_hg), _arrays(g_ref), _arrays(g32)
    assert all(a.dtype == np.float32 for a in got)
    assert all(a.dtype == jnp.bfloat16 for a in bf16)

    def err(gs):
        d = np.concatenate([(a.astype(np.float64) - r).ravel() for a, r in zip(gs, ref)])
        return np.linalg.norm(d) / np.linalg.norm(np.concatenate([r.ravel() for r in ref]))

    # Left: the bf16 forward's roundings, 2^-8 relative per value, compounding through Linear,
    # GELU (its derivative coefficient is saved in bf16, see the README's Limitations),
    # BatchNorm and Linear. Measured 0.011 (equinox's bf16 backward: 0.010: on this model the
    # forward's roundings dominate, so the backward's precision barely shows).
    assert err(got) <= 8 * 2.0**-8


def test_filter_jit_training_step_matches_equinox():
    """Three SGD steps of a filter_jit-compiled step: at float32 the same parameters and
    BatchNorm state as the step written with eqx.filter_value_and_grad."""

    def make_step(value_and_grad):
        @eqx.filter_jit
        def step(model, state, x):
            (loss, state), g = value_and_grad(_loss, has_aux=True)(model, state, x)
            model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, g))
            return model, state, loss

        return step

    runs = []
    for vg in (eqx.filter_value_and_grad, hg.equinox.filter_value_and_grad):
        step, (model, state) = make_step(vg), _make()
        for _ in range(3):
            model, state, loss = step(model, state, _x())
        runs.append((model, state, loss))
    for a, b in zip(_arrays(runs[0]), _arrays(runs[1])):
        np.testing.assert_array_equal(a, b)
    assert runs[1][0].name == "net" and runs[1][0].act is jax.nn.gelu


def test_decorator_and_method_forms():
    """As a bare decorator, with arguments, and as a method (equinox's __get__ binding)."""

    class Holder(eqx.Module):
        w: jax.Array

        @hg.equinox.filter_grad
        def grad_wrt_self(self, x):
            return jnp.sum(jnp.tanh(self.w * x).astype(jnp.float32))

    h = Holder(jnp.full((3,), 0.5, jnp.bfloat16))
    g = h.grad_wrt_self(jnp.ones(3, jnp.bfloat16))
    assert g.w.dtype == jnp.float32
    ref = eqx.filter_grad(lambda h, x: jnp.sum(jnp.tanh(h.w.astype(jnp.float32) * x)))(
        Holder(h.w.astype(jnp.float32)), jnp.ones(3, jnp.float32))
    # bf16 forward (tanh of 0.5 rounded to bf16, 2^-8 relative), float32 backward.
    np.testing.assert_allclose(g.w, ref.w, rtol=2 * 2.0**-8)

    @hg.equinox.filter_value_and_grad(tangent_dtype=jnp.float32)
    def f(w):
        return jnp.sum(w.astype(jnp.float32) ** 2)

    v, gw = f(jnp.ones(2, jnp.bfloat16))
    assert float(v) == 2.0 and gw.dtype == jnp.float32


@pytest.mark.parametrize("case,error,match", [
    ("class_not_instance", TypeError, r"class _Net, not an instance"),
    ("function_first", TypeError, r"Pass the model first"),
    ("no_positional", TypeError, r"passed by position"),
    ("nnx_module", TypeError, r"hg.flax.grad"),
    ("non_scalar_loss", TypeError, r"shape \(6, 3\).*jnp.mean"),
    ("tuple_without_has_aux", TypeError, r"has_aux=True"),
    ("argnums", ValueError, r"argnums.*as a tuple in the first argument"),
])
def test_bad_input_errors_name_the_fix(case, error, match):
    model, state = _make()
    x = _x()
    with pytest.raises(error, match=match):
        if case == "class_not_instance":
            hg.equinox.filter_grad(_loss, has_aux=True)(_Net, state, x)
        elif case == "function_first":
            hg.equinox.filter_grad(lambda f, m: 0.0)(_loss, model)
        elif case == "no_positional":
            hg.equinox.filter_grad(_loss)(model=model)
        elif case == "nnx_module":
            from flax import nnx

            hg.equinox.filter_grad(lambda m: 0.0)(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        elif case == "non_scalar_loss":
            hg.equinox.filter_grad(lambda m, x: jax.vmap(m.lin2)(x[:, :2] @ jnp.ones((2, 8))))(
                model, x)
        elif case == "tuple_without_has_aux":
            hg.equinox.filter_grad(_loss)(model, state, x)
        elif case == "argnums":
            hg.equinox.filter_grad(_loss, argnums=1)
