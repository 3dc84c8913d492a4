"""build.py: the promoted linear program written directly is the interpreter's traced one.

Every program of the corpus (tests/programs.py) is differentiated both ways, with the program
`build.promoted_jaxpr` writes and with the one `jax.make_jaxpr` traces through the interpreter
(`api._BUILD = False`): the gradients must be equal bit for bit (the two programs hold the same
float32 arithmetic), and every written program must pass JAX's own type checker
(`check_jaxpr`: each equation's declared output types are what its abstract evaluation gives).
"""

import contextlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from lanes import in_turn
from programs import API, CONTEXT, HEAVY, PROGRAMS, TRACE_ONLY, xfail_reason

import hifigrad as hg
from hifigrad._src import api, build, compat
from hifigrad._src.interpreter import Interpreter
from hifigrad._src.primitives import upcast_p
from hifigrad._src.rules import PROMOTE


@contextlib.contextmanager
def _mode(built: bool, checked: list | None = None):
    """Differentiates with (`built`) or without `build.promoted_jaxpr`; with `checked`, each
    written program is type-checked and appended to it."""
    saved, orig = api._BUILD, build.promoted_jaxpr

    def promoted_jaxpr(*a, **k):
        closed = orig(*a, **k)
        jax.extend.core.check_jaxpr(compat.jaxpr_and_consts(closed)[0])
        checked.append(closed)
        return closed

    api._BUILD = built
    api._PROGRAMS.clear()  # eager programs cached under the other mode
    if checked is not None:
        build.promoted_jaxpr = promoted_jaxpr
    try:
        yield
    finally:
        api._BUILD, build.promoted_jaxpr = saved, orig
        api._PROGRAMS.clear()


def _floating_leaf(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _grads(name, dtype, jit, built, checked=None):
    fun, make = PROGRAMS[name]
    leaves, tree = jax.tree_util.tree_flatten(make(dtype))
    idx = [i for i, x in enumerate(leaves) if _floating_leaf(x)]

    def f(*diff):
        full = list(leaves)
        for i, d in zip(idx, diff):
            full[i] = d
        return fun(*jax.tree_util.tree_unflatten(tree, full))

    g = hg.grad(f, argnums=tuple(range(len(idx))))
    g = jax.jit(g) if jit else g
    diff = [leaves[i] for i in idx]
    with _mode(built, checked):
        if name in TRACE_ONLY:
            return [str(jax.make_jaxpr(g)(*diff))]
        return [np.asarray(x) for x in g(*diff)]


def _params():
    """Every corpus program in bf16, jitted; eagerly too for every fourth one (and for none of
    the `HEAVY` ones, which compile for seconds). The default suite runs every other program
    jitted, which half depending on the lane (tests/lanes.py: each CI lane's half is its own),
    and the eager runs in turn (tests/conftest.py); the rest are `slow` (issue 48: this test
    was 99 of the default suite's 1325 s on jax 0.12.1)."""
    out = []
    for i, name in enumerate(sorted(PROGRAMS)):
        for jit in (True, False):
            if not jit and (i % 4 or name in HEAVY):
                continue
            marks = [pytest.mark.slow] if jit and not in_turn(i, 2) else []
            out.append(pytest.param(name, jit, marks=marks,
                                    id=f"{name}-{'jit' if jit else 'eager'}"))
    return out


@pytest.mark.parametrize(("name", "jit"), _params())
def test_written_program_is_the_traced_one(name, jit):
    if xfail_reason(name, compat.JAX_VERSION, "bf16", jit):  # this test's dtype: bf16
        pytest.skip("a known failure of the corpus (tests/programs.py XFAIL)")
    ctx = CONTEXT[name]() if name in CONTEXT else contextlib.nullcontext()
    checked: list = []
    with ctx:
        try:
            want = _grads(name, jnp.bfloat16, jit, built=False)
        except Exception as e:  # noqa: BLE001 - a program hg.grad rejects: rejected alike
            with pytest.raises(type(e)):
                _grads(name, jnp.bfloat16, jit, built=True, checked=checked)
            return
        got = _grads(name, jnp.bfloat16, jit, built=True, checked=checked)
    assert checked, "the written program was not used"
    if name in TRACE_ONLY:
        assert got == want  # the same backward, traced
        return
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_corpus_is_covered():
    assert len(API) >= 100 and len(PROGRAMS) >= 150


# ------------------------------------------------------------------------------ structure

def _block(x, w1, w2):
    h = jnp.tanh(x @ w1)
    return x + h @ w2


def _lin_jaxpr(fun, *args):
    _, lin = jax.linearize(fun, *args)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return compat.linearized_jaxpr(lin, avals), len(jax.tree_util.tree_leaves(lin))


def test_unpromoted_equations_are_kept_and_residuals_upcast_once():
    x = jnp.ones((2, 4), jnp.bfloat16)
    w = jnp.full((4, 4), 0.5, jnp.bfloat16)
    jaxpr, n_res = _lin_jaxpr(lambda w1: jnp.sum(_block(x, w1, w) * _block(x, w1, w)), w)
    interp = Interpreter(hg.Policy(), PROMOTE)
    closed = build.promoted_jaxpr(interp, jaxpr, n_res, [jnp.dtype(jnp.float32)])
    out, _ = compat.jaxpr_and_consts(closed)
    jax.extend.core.check_jaxpr(out)
    # Inputs: the residuals as they are, then the tangent in float32.
    assert [v.aval.dtype for v in out.invars[:n_res]] == [v.aval.dtype
                                                          for v in jaxpr.invars[:n_res]]
    assert out.invars[-1].aval.dtype == jnp.float32
    ups = [e for e in out.eqns if e.primitive is upcast_p]
    assert ups and len({id(e.invars[0]) for e in ups}) == len(ups)  # once per residual
    for e in out.eqns:  # every float value the tangent reaches is float32
        if e.primitive is not upcast_p:
            assert all(v.aval.dtype == jnp.float32 for v in e.outvars
                       if jnp.issubdtype(v.aval.dtype, jnp.floating)), e


def test_a_jit_body_called_twice_is_inlined_with_fresh_variables():
    """One jitted function called twice holds one jaxpr object twice: inlining it twice must
    not define a variable twice (check_jaxpr would reject that)."""
    w2 = jnp.full((4, 4), 0.25, jnp.bfloat16)
    blk = jax.jit(lambda x, w: _block(x, w, w2))
    x = jnp.linspace(-1, 1, 8).reshape(2, 4).astype(jnp.bfloat16)
    w = jnp.full((4, 4), 0.5, jnp.bfloat16)

    def loss(w):
        return jnp.sum(blk(blk(x, w), w).astype(jnp.float32))

    checked: list = []
    with _mode(True, checked):
        got = jax.jit(hg.grad(loss))(w)
    with _mode(False):
        want = jax.jit(hg.grad(loss))(w)
    assert checked
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


def test_rules_without_a_writer_are_traced_and_spliced():
    """A scan (its rule re-traces through `lax.scan`) inside an otherwise written program."""
    def loss(w, xs):
        def body(c, x):
            return jnp.tanh(c * w + x), None
        c, _ = lax.scan(body, jnp.zeros(3, w.dtype), xs)
        return jnp.sum((c * w).astype(jnp.float32))

    w = jnp.asarray([0.5, -0.25, 1.0], jnp.bfloat16)
    xs = jnp.linspace(-1, 1, 12).reshape(4, 3).astype(jnp.bfloat16)
    checked: list = []
    with _mode(True, checked):
        got = jax.jit(hg.grad(loss))(w, xs)
    with _mode(False):
        want = jax.jit(hg.grad(loss))(w, xs)
    assert checked and any(e.primitive.name == "scan"
                           for e in compat.jaxpr_and_consts(checked[0])[0].eqns)
    np.testing.assert_array_equal(got, want)
    # Against float32 jax.grad: the forward differs by bf16 rounding at each of the 4 steps.
    ref = jax.grad(loss)(w.astype(jnp.float32), xs.astype(jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=16 * float(jnp.finfo(jnp.bfloat16).eps))


@pytest.mark.parametrize("unroll", [1, 4])
def test_a_recurrence_is_transposed_after_partial_evaluation(unroll):
    """A linear scan whose body multiplies the carry's tangent by a residual: its transpose rule
    wants the body split into known and linear parts (jax 0.10.2 asserts otherwise), so the
    written program goes through `jax.linear_transpose`'s partial evaluation."""
    def loss(a, u):
        def step(s, x):
            s = a.astype(jnp.bfloat16) * s + x
            return s, s
        _, s = lax.scan(step, jnp.zeros_like(u[0]), u, unroll=unroll)
        return jnp.sum(s.astype(jnp.float32) ** 2)

    a = jnp.linspace(0.5, 0.95, 8).reshape(1, 8)
    u = jnp.linspace(-1, 1, 6 * 2 * 8).reshape(6, 2, 8).astype(jnp.bfloat16)
    checked: list = []
    with _mode(True, checked):
        got = jax.jit(hg.grad(loss, argnums=(0, 1)))(a, u)
    with _mode(False):
        want = jax.jit(hg.grad(loss, argnums=(0, 1)))(a, u)
    assert checked
    written = compat.jaxpr_and_consts(checked[0])[0]
    assert not compat.transposable_as_is(checked[0], len(written.invars) - 2)  # 2 tangents
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
