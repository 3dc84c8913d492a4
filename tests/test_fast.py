"""Policy(matmul='fast'): bf16 operands, f32 accumulation in backward matmuls.

The exact reference is ``Policy(matmul="exact", matmul_precision="highest")``: float32
operands multiplied in float32 on every platform. (At JAX's default precision a TPU multiplies
float32 operands in one bf16 pass, which is what 'fast' does: there the two are the same
arithmetic, `test_on_a_tpu_exact_at_default_precision_is_fast`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from platforms import tpu_only

import hifigrad as hg

EXACT = hg.Policy(matmul="exact", matmul_precision="highest")


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
    exact = hg.grad(loss, policy=EXACT)(ws, x)
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
    exact = str(jax.make_jaxpr(hg.grad(loss, policy=hg.Policy(matmul="exact")))(ws, x))
    # In exact mode every backward dot multiplies f32 operands.
    assert "bf16[8,32] = convert_element_type" not in exact
    assert "bf16[8,32] = convert_element_type" in text


def attention_loss(q):
    """Batched `dot_general`s (attention), the shape XLA's CPU DotThunk cannot run as
    bf16 x bf16 -> f32: the fast rewrite must still run there."""
    def body(c, _):
        s = jnp.einsum("bqhd,bkhd->bhqk", c, c) * 0.25
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), c), None
    c = lax.scan(body, q, None, length=2)[0]
    return jnp.sum(c.astype(jnp.float32) ** 2)


def test_fast_batched_matmuls_run_on_every_backend(maybe_jit):
    q = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 2, 4)), jnp.bfloat16)
    exact = hg.grad(attention_loss, policy=EXACT)(q)
    fast = maybe_jit(hg.grad(attention_loss, policy=hg.Policy(matmul="fast")))(q)
    assert fast.dtype == jnp.float32
    rel = float(jnp.linalg.norm(fast - exact) / jnp.linalg.norm(exact))
    assert 0 < rel <= 4 * 2 ** -9, rel


@tpu_only("a TPU's default float32 matmul precision is one bf16 pass")
def test_on_a_tpu_exact_at_default_precision_is_fast():
    """What 'fast' means on a TPU: the same arithmetic as a float32 matmul at JAX's default
    precision (operands rounded to bf16 once, products accumulated in float32), without the
    float32 copies of the residuals; only ``matmul_precision='highest'`` multiplies in
    float32 there."""
    ws, x = _setup()
    exact = hg.grad(loss, policy=hg.Policy(matmul="exact"))(ws, x)
    fast = hg.grad(loss, policy=hg.Policy(matmul="fast"))(ws, x)
    np.testing.assert_allclose(fast, exact, rtol=2 ** -20, atol=0)


# ---- Policy(matmul='auto') as it runs on a GPU/TPU host (here: 'auto' resolved as off CPU)

@pytest.fixture
def auto_as_on_gpu(monkeypatch):
    monkeypatch.setenv("HIFIGRAD_PLATFORM", "gpu")
    assert hg.Policy().resolved_matmul() == "fast"


def test_auto_off_cpu_is_fast_for_bf16(auto_as_on_gpu):
    ws, x = _setup()
    auto = jax.make_jaxpr(hg.grad(loss))(ws, x)
    fast = jax.make_jaxpr(hg.grad(loss, policy=hg.Policy(matmul="fast")))(ws, x)
    assert str(auto) == str(fast)


def _fp16_tiny_loss(ws, x):
    # Cotangents of about 1e-9 reach the matmuls: below fp16's smallest subnormal (6e-8).
    c = lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
    return jnp.sum(c.astype(jnp.float32)) * 1e-9


def test_auto_off_cpu_keeps_fp16_matmuls_exact(auto_as_on_gpu, maybe_jit):
    """Rounding an fp16 cotangent to fp16 flushes it to zero: 'auto' keeps fp16 matmuls exact,
    where an explicit 'fast' loses the gradient (the reason for the exception)."""
    ws, x = (a.astype(jnp.float16) for a in _setup())
    exact = hg.grad(_fp16_tiny_loss, policy=hg.Policy(matmul="exact"))(ws, x)
    auto = maybe_jit(hg.grad(_fp16_tiny_loss))(ws, x)
    fast = hg.grad(_fp16_tiny_loss, policy=hg.Policy(matmul="fast"))(ws, x)
    assert float(jnp.abs(exact).max()) > 0
    np.testing.assert_allclose(auto, exact, rtol=2 ** -20, atol=0)  # the same f32 program
    assert float(jnp.linalg.norm(fast - exact) / jnp.linalg.norm(exact)) > 0.5


# ---- each platform's branch, lowered on this host (CI has no accelerator)

def _backward_dots(text):
    import re

    return sorted(set(re.findall(
        r"stablehlo.dot_general.*?: \((tensor<[^)]*)\) -> (tensor<[^>]*xf32>)", text)))


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_fast_matmul_branch_of_each_platform(platform):
    """`Policy(matmul='fast')` stages each backward matmul in a `lax.platform_dependent`: lowered
    for a TPU or a GPU (here, on any host) the backward's dots take the bf16 operands and
    accumulate in float32; lowered for CPU, they multiply the same rounded values up-cast to
    float32 (XLA:CPU cannot run every mixed dot)."""
    from hifigrad._src import compat

    ws = [jnp.full((16, 16), 0.05, jnp.bfloat16) * (i + 1) for i in range(2)]
    x = jnp.linspace(-1, 1, 64, dtype=jnp.bfloat16).reshape(4, 16)

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    f = jax.jit(hg.grad(loss, policy=hg.Policy(matmul="fast")))
    dots = _backward_dots(compat.lower_for(f, (ws, x), platform))
    low = "xbf16>" if platform != "cpu" else "xf32>"
    assert dots and all(a.count(low) == 2 for a, _ in dots), dots
