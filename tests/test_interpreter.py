"""The promoting interpreter: flag analysis (fixpoints) and evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


# ------------------------------------------------------------------------------ skip connections

def _residual_loss(n, dtype):
    """`n` residual blocks ``x + W2 gelu(W1 norm(x))`` over float32 masters cast to `dtype`."""
    def norm(x):
        m = x.mean(-1, keepdims=True)
        return (x - m) * lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)

    def loss(ws, x):
        x = x.astype(dtype)
        for w1, w2 in ws:
            x = x + jax.nn.gelu(norm(x) @ w1.astype(dtype)) @ w2.astype(dtype)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    return loss


def _residual_args(n, d=16):
    ks = jax.random.split(jax.random.key(0), 2 * n + 1)
    ws = [(jax.random.normal(ks[2 * i], (d, 4 * d)) * 0.1,
           jax.random.normal(ks[2 * i + 1], (4 * d, d)) * 0.1) for i in range(n)]
    return ws, jax.random.normal(ks[-1], (4, 8, d))


def test_skip_connection_adds_found_from_dataflow():
    from hifigrad._src.interpreter import skip_connection_adds

    # x + f(x) with a matmul in f: found; adds with no matmul between (a layer norm's, x*y + x)
    # are not.
    ws, x = _residual_args(3)
    closed = jax.make_jaxpr(_residual_loss(3, jnp.float32))(ws, x)
    adds = skip_connection_adds(closed.jaxpr)
    assert len(adds) == 3
    assert all(closed.jaxpr.eqns[i].primitive.name == "add" for i in adds)
    plain = jax.make_jaxpr(lambda x, y: (x * y + x) + jnp.mean(x))(x, x)
    assert skip_connection_adds(plain.jaxpr) == frozenset()


def _without_materialize(monkeypatch):
    from hifigrad._src import interpreter

    monkeypatch.setattr(interpreter, "materialize", lambda x: x)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_materialized_skip_connections_leave_gradients_bitwise(maybe_jit, monkeypatch, dtype):
    # The cotangent at each skip connection is divided by an opaque 1 on CPU (exact): the
    # gradients are bitwise those of the backward without it, jitted and not.
    ws, x = _residual_args(4)
    g = hg.grad(_residual_loss(4, dtype))
    with_it = maybe_jit(g)(ws, x)
    _without_materialize(monkeypatch)
    without = maybe_jit(g)(ws, x)
    for a, b in zip(jax.tree_util.tree_leaves(with_it), jax.tree_util.tree_leaves(without)):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _instructions(fn, args):
    import re

    text = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", text, re.M))


@pytest.mark.slow  # two compiles of a 16-block program: about 15 s on 2 shared cores
@pytest.mark.cpu_only(reason="XLA:CPU's instruction fusion duplicates cheap float32 producers")
def test_unrolled_backward_compiles_to_jax_grads_size():
    # 16 unrolled residual blocks: hg.grad's float32 backward compiles to at most 1.5x the
    # instructions of jax.grad's bf16 one.
    n = 16
    ws, x = _residual_args(n)
    loss = _residual_loss(n, jnp.bfloat16)
    ref = _instructions(jax.grad(loss), (ws, x))
    fixed = _instructions(hg.grad(loss), (ws, x))
    assert fixed <= 1.5 * ref, (fixed, ref)


@pytest.mark.slow
@pytest.mark.cpu_only(reason="XLA:CPU's instruction fusion duplicates cheap float32 producers")
@pytest.mark.xfail(strict=True, reason=(
    "the control no longer reproduces: without the materialized skip connections this program "
    "compiles to 5083 instructions against jax.grad's 5824 on jax 0.10.2 (4710 vs 5309 on "
    "0.12.1), not more than 1.5x; strict, so that XLA:CPU cloning the chain again is seen"))
def test_without_materialized_skips_the_backward_compiles_larger(monkeypatch):
    # The control of the test above: without the materialized skip connections XLA:CPU cloned
    # the cotangent chain into every block's fusions (more than 1.5x jax.grad's instructions).
    n = 16
    ws, x = _residual_args(n)
    loss = _residual_loss(n, jnp.bfloat16)
    ref = _instructions(jax.grad(loss), (ws, x))
    _without_materialize(monkeypatch)
    unfixed = _instructions(hg.grad(loss), (ws, x))
    assert unfixed > 1.5 * ref, (unfixed, ref)


@pytest.mark.parametrize("n, divides", [(1, False), (2, False), (4, True)])
def test_skip_connections_materialized_only_in_a_chain_of_blocks(n, divides):
    # One or two skip connections (a scanned stack's step, one recomputed block): nothing is
    # materialized (it would cost an activation-sized buffer and save nothing); a chain of
    # MIN_SKIP_CHAIN or more: each one is (an opaque divide on CPU).
    ws, x = _residual_args(n)
    text = str(jax.make_jaxpr(hg.grad(_residual_loss(n, jnp.bfloat16)))(ws, x))
    assert ("optimization_barrier" in text) == divides


@pytest.mark.parametrize("platform,divides", [("cpu", True), ("tpu", False), ("cuda", False)])
def test_materialize_branch_of_each_platform(platform, divides):
    """`materialize` is XLA:CPU's opaque identity (a divide by a barrier-hidden one, which
    XLA:CPU never duplicates into consumers) and the plain value elsewhere: each platform's
    branch, lowered on this host."""
    from hifigrad._src import compat
    from hifigrad._src.interpreter import materialize

    x = jnp.linspace(-1.0, 1.0, 8)
    text = compat.lower_for(jax.jit(lambda x: materialize(x) * 2.0), (x,), platform)
    assert ("stablehlo.divide" in text) == divides, text
