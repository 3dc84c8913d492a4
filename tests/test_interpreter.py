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


# --------------------------------------------------------------------------- fallback warnings

def _make_pinned(name):
    """A primitive no rule names whose output is pinned to bf16: it falls back."""
    from hifigrad._src import compat

    p = compat.new_primitive(name)
    compat.register_impl_and_lowering(p, lambda x: (x * 2).astype(jnp.bfloat16),
                                      lambda x: x.update(dtype=jnp.dtype(jnp.bfloat16),
                                                         weak_type=False))
    compat.register_jvp(p, lambda primals, tangents: (p.bind(primals[0]), p.bind(tangents[0])))
    compat.register_transpose(p, lambda ct, x: [p.bind(ct)])
    return p


_PINNED = _make_pinned("test_interpreter_pinned_double")


def _fallbacks(record):
    return [w for w in record if issubclass(w.category, hg.PrecisionFallbackWarning)
            and "test_interpreter_pinned_double" in str(w.message)]


def test_a_suppressed_fallback_warning_does_not_hide_another_functions():
    """Suppressing the warning for one function (inside catch_warnings) must not hide a later,
    different function falling back at the same primitive; one function warns once."""
    import warnings

    x = jnp.linspace(0, 1, 3).astype(jnp.bfloat16)
    f1 = lambda x: jnp.sum(_PINNED.bind(x * x)).astype(jnp.float32)
    f2 = lambda x: jnp.sum(_PINNED.bind(jnp.sin(x))).astype(jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.PrecisionFallbackWarning)
        hg.grad(f1)(x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hg.grad(f2)(x)
        jax.jit(hg.grad(f2))(x)  # the same function again: no second warning
        pb = hg.precise_backward(lambda x: jnp.sum(_PINNED.bind(jnp.cos(x))).astype(jnp.float32))
        jax.grad(pb)(x)
    assert len(_fallbacks(record)) == 2, [str(w.message) for w in record]
