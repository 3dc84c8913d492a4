"""The report that started hifigrad (jax issue 27144), fixed.

A `custom_vjp` whose backward returns a float32 cotangent for a bf16 input breaks `jax.grad`
inside `lax.scan`. Under `hg.grad` the same code runs, and the whole backward is float32.

Run: python examples/seed_issue.py
"""

import jax
import jax.numpy as jnp
from jax import lax

import hifigrad as hg


@jax.custom_vjp
def identity(x):
    return x


def identity_fwd(x):
    return x, None


def identity_bwd(res, g):
    return (g.astype(jnp.float32),)  # the user wants a float32 gradient


identity.defvjp(identity_fwd, identity_bwd)


def model(x):
    def scannable_identity_fn(carry, _):
        return identity(carry), None

    x = identity(x)
    x = lax.scan(scannable_identity_fn, x, None, length=2)[0]
    return identity(x)


def realistic(x, w):
    """A scanned tanh recurrence with the user's custom_vjp in every step."""
    def body(c, _):
        return identity(jnp.tanh(c * w)), None

    return lax.scan(body, identity(x), None, length=8)[0].astype(jnp.float32)


def main():
    x = jnp.asarray(8, dtype=jnp.bfloat16)
    args = (jnp.asarray(0.8, jnp.bfloat16), jnp.asarray(1.3, jnp.bfloat16))
    for name, f, a in (("minimal", model, (x,)), ("realistic", realistic, args)):
        try:
            g = jax.block_until_ready(jax.jit(jax.grad(f))(*a))
            print(f"jax.grad, {name}: ran, dtype {g.dtype}")
        except Exception as e:  # noqa: BLE001 - show whatever JAX raises
            print(f"jax.grad, {name}: fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
    g = hg.grad(model)(x)
    print(f"hg.grad:   {g} (dtype {g.dtype})")
    gx, gw = jax.jit(hg.grad(realistic, argnums=(0, 1)))(*args)
    print(f"realistic: d/dx = {gx:.6f}, d/dw = {gw:.6f} (dtype {gx.dtype})")


if __name__ == "__main__":
    main()
