"""The staged up-cast: same values as convert_element_type, staged into the backward."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hifigrad._src.primitives import upcast, upcast_p


def test_values_and_transforms(maybe_jit):
    x = jnp.linspace(-3, 3, 7).astype(jnp.bfloat16)
    y = maybe_jit(lambda x: upcast(x, jnp.float32))(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, x.astype(jnp.float32))
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_array_equal(jax.vmap(lambda x: upcast(x, jnp.float32))(xs),
                                  xs.astype(jnp.float32))
    g = jax.grad(lambda x: jnp.sum(upcast(x, jnp.float32) ** 2))(x.astype(jnp.float16))
    assert g.dtype == jnp.float16


def test_partial_eval_stages_the_cast_inside_scans():
    """Transposing a scan whose body up-casts a residual stacks the bf16 residual, not f32."""
    xs = jnp.ones((5, 8), jnp.bfloat16)

    def lin(t):
        def body(c, x):
            return c + t * upcast(x, jnp.float32), None
        return lax.scan(body, jnp.zeros(8, jnp.float32), xs)[0]

    jaxpr = jax.make_jaxpr(jax.linear_transpose(lin, jnp.zeros(8, jnp.float32)))(
        jnp.ones(8, jnp.float32))
    text = str(jaxpr)
    assert "f32[5,8]" not in text, text
    assert upcast_p.name in text
