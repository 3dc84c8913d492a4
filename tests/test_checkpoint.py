"""hg.checkpoint and hg.scan: compressed saved activations with float32 backward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hifigrad as hg

L, B, D = 8, 16, 64


def _setup(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(L, D, D)) / np.sqrt(D) * 1.2, dtype)
    x = jnp.asarray(rng.normal(size=(B, D)), dtype)
    return ws, x


def body(c, w):
    return jnp.tanh(c @ w), None


def loss(ws, x, codec):
    c = hg.scan(body, x, ws, codec=codec)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def loss_ref(ws, x):
    c = lax.scan(jax.checkpoint(body), x, ws)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def _sqnr(g, ref):
    g, ref = np.asarray(g, np.float64), np.asarray(ref, np.float64)
    return 10 * np.log10(np.sum(ref ** 2) / max(np.sum((g - ref) ** 2), 1e-300))


def test_uncompressed_equals_jax_remat(maybe_jit):
    ws, x = _setup()
    g = maybe_jit(jax.grad(lambda w: loss(w, x, "none")))(ws)
    want = jax.grad(lambda w: loss_ref(w, x))(ws)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("codec,min_db", [("bf16", 40), ("fp8_e4m3", 20), ("fp8_e5m2", 15),
                                          ("int8", 25), ("int4", 10)])
def test_gradient_sqnr(codec, min_db, maybe_jit):
    """Floors from each format's resolution: bf16 8 bits, e4m3 4, e5m2 3, int8 ~8, int4 ~4
    significant bits (about 6 dB per bit, minus the amplification through L tanh layers)."""
    ws, x = _setup()
    want = jax.grad(lambda w: loss_ref(w, x))(ws)
    g = maybe_jit(jax.grad(lambda w: loss(w, x, codec)))(ws)
    assert g.dtype == jnp.float32
    assert _sqnr(g, want) >= min_db


def test_under_hg_grad_with_bf16_model(maybe_jit):
    ws, x = _setup(jnp.bfloat16)
    g = maybe_jit(hg.grad(lambda w: loss(w, x, "fp8_e4m3")))(ws)
    assert g.dtype == jnp.float32
    want = jax.grad(lambda w: loss_ref(w.astype(jnp.float32), x.astype(jnp.float32)))(ws)
    assert _sqnr(g, want) >= 15


def test_only_encoded_carries_are_saved():
    ws, x = _setup()
    _, f_vjp = jax.vjp(lambda w: loss(w, x, "int4"), ws)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    carry_like = [l for l in leaves if l.shape == (L, B, D)]  # a stacked full-precision carry
    assert not carry_like, [(l.shape, l.dtype) for l in leaves]
    assert any(l.dtype == jnp.uint8 for l in leaves)


def test_checkpoint_function(maybe_jit):
    f = hg.checkpoint(lambda x, w: jnp.tanh(x @ w), codec="int8")
    ws, x = _setup()
    g = maybe_jit(jax.grad(lambda w: jnp.sum(f(x, w[0]) ** 2)))(ws)
    want = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w[0]) ** 2))(ws)
    assert _sqnr(g, want) >= 25


def test_nan_is_not_hidden():
    ws, x = _setup()
    x = x.at[0, 0].set(jnp.nan)
    g = jax.grad(lambda w: loss(w, x, "int8"))(ws)
    assert np.isnan(np.asarray(g)).any()


def test_vmap_over_hg_scan():
    ws, x = _setup()
    xs = jnp.stack([x, 2 * x])
    g = jax.vmap(lambda x: jax.grad(lambda w: loss(w, x, "fp8_e4m3"))(ws))(xs)
    assert g.shape == (2,) + ws.shape and np.isfinite(np.asarray(g)).all()


def test_already_encoded_input_is_an_error():
    enc = hg.get_codec("int8").encode(jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="already"):
        hg.checkpoint(lambda e: e, codec="int8")(enc)
