"""The promoting interpreter: flag analysis (fixpoints) and evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hifigrad as hg
from hifigrad._src.interpreter import Interpreter
from hifigrad._src.rules import PROMOTE


def test_accumulator_started_from_a_literal_zero_is_promoted():
    """A carry that starts as a literal zero and accumulates a tangent must be found promoted
    (fixpoint over the body), or the scan's carry types mismatch."""
    def lin(t, xs):
        def body(acc, x):
            return acc + t * x, None
        return lax.scan(body, jnp.zeros((), jnp.bfloat16), xs)[0]

    jaxpr = jax.make_jaxpr(lin)(jnp.ones((), jnp.bfloat16), jnp.ones(5, jnp.bfloat16))
    interp = Interpreter(hg.Policy(), PROMOTE)
    assert interp.flags(jaxpr, [True, False]) == [True]
    assert interp.flags(jaxpr, [False, False]) == [False]
    outs, flags = interp.eval_closed(jaxpr, [jnp.ones((), jnp.float32),
                                             jnp.arange(5).astype(jnp.bfloat16)], [True, False])
    assert flags == [True] and outs[0].dtype == jnp.float32
    assert float(outs[0]) == 10.0


def test_unflagged_equations_are_bound_unchanged():
    def f(x, r):
        return jnp.sin(r) * 2, x * r

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.bfloat16))
    interp = Interpreter(hg.Policy(), PROMOTE)
    x = jnp.ones(3, jnp.float32)
    r = jnp.linspace(0, 1, 3).astype(jnp.bfloat16)
    (a, b), flags = interp.eval_closed(jaxpr, [x, r], [True, False])
    assert a.dtype == jnp.bfloat16 and flags[0] is False  # residual-only: stays bf16
    assert b.dtype == jnp.float32 and flags[1] is True
    np.testing.assert_array_equal(b, np.asarray(r, np.float32))


def test_while_fixpoint():
    def f(t):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + c[2], c[2]),
                              (0, jnp.zeros((), jnp.bfloat16), t))[1]

    jaxpr = jax.make_jaxpr(f)(jnp.ones((), jnp.bfloat16))
    interp = Interpreter(hg.Policy(), PROMOTE)
    outs, flags = interp.eval_closed(jaxpr, [jnp.float32(1.5)], [True])
    assert flags == [True] and outs[0].dtype == jnp.float32 and float(outs[0]) == 4.5
