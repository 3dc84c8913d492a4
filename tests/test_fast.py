"""Policy(matmul='fast'): bf16 operands, f32 accumulation in backward matmuls."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hifigrad as hg


def _setup():
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.normal(size=(4, 32, 32)) / 6, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.bfloat16)
    return ws, x


def loss(ws, x):
    c = lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def test_fast_is_close_to_exact_and_f32(maybe_jit):
    ws, x = _setup()
    exact = hg.grad(loss)(ws, x)
    fast = maybe_jit(hg.grad(loss, policy=hg.Policy(matmul="fast")))(ws, x)
    assert fast.dtype == jnp.float32
    # Each backward matmul rounds the cotangent operand to bf16 once (2^-9 relative).
    rel = float(jnp.linalg.norm(fast - exact) / jnp.linalg.norm(exact))
    assert 0 < rel <= 4 * 2 ** -9, rel


def test_fast_backward_uses_low_precision_matmuls():
    ws, x = _setup()
    text = str(jax.make_jaxpr(hg.grad(loss, policy=hg.Policy(matmul="fast")))(ws, x))
    dots = [l for l in text.splitlines() if "dot_general[" in l]
    assert dots
    assert "preferred_element_type=float32" in text
    exact = str(jax.make_jaxpr(hg.grad(loss))(ws, x))
    # In exact mode every backward dot multiplies f32 operands.
    assert "bf16[8,32] = convert_element_type" not in exact
    assert "bf16[8,32] = convert_element_type" in text
