"""The compat module: one interface over every tested JAX release's internals, and the error a
changed internal produces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hifigrad._src import compat


def _eqn(fun, *args, prim):
    jaxpr = jax.make_jaxpr(fun)(*args)
    return next(e for e in jaxpr.jaxpr.eqns if e.primitive is prim)


def test_scan_split():
    def f(c, xs, k):
        return lax.scan(lambda c, x: (c * k + x, c), c, xs)

    e = _eqn(f, jnp.ones(3), jnp.ones((4, 3)), jnp.ones(3), prim=compat.scan_p)
    assert compat.scan_split(e) == (1, 1)
    assert compat.scan_num_ys(e) == 1


def test_jaxpr_and_consts_and_bind():
    e = _eqn(lambda x: jax.jit(lambda y: y * 2)(x), jnp.ones(2), prim=compat.pjit_p)
    jaxpr, consts = compat.jaxpr_and_consts(e.params["jaxpr"])
    assert len(jaxpr.invars) == 1 and consts == []
    outs = compat.bind_eqn(e, [jnp.arange(2.0)])
    assert list(outs[0]) == [0.0, 2.0]


def test_primitives_found():
    for p in (compat.scan_p, compat.while_p, compat.cond_p, compat.pjit_p, compat.remat_p,
              compat.custom_jvp_call_p, compat.custom_lin_p, compat.shard_map_p,
              compat.linear_solve_p, compat.pure_callback_p):
        assert p is not None
    assert {p.name for p in compat.primitives_named(["tanh", "dot_general", "psum"])} == {
        "tanh", "dot_general", "psum"}


def test_make_jaxpr_closed():
    jaxpr, consts, tree = compat.make_jaxpr_closed(lambda x: [x + jnp.arange(3.0)], jnp.ones(3))
    assert tree.num_leaves == 1 and len(jaxpr.invars) == 1


# ---- one test per named JAX difference (see the compat module's docstring)

def test_closed_jaxprs_read_either_form():
    """Closed jaxprs (jax 0.11 merged ClosedJaxpr into Jaxpr): consts are found either way."""
    c = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x + c)(jnp.ones(3))
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    assert len(consts) == 1 and (consts[0] == c).all()
    open_jaxpr, no_consts = compat.jaxpr_and_consts(jaxpr)
    assert no_consts == [] or len(no_consts) == 1  # an open jaxpr (0.10) or one with consts


def test_scan_flat_tree_params():
    """Scan's params (num_consts/num_carry, or ft_in on jax >= 0.11) give the same split."""
    def f(c, xs, k, k2):
        return lax.scan(lambda c, x: ((c[0] * k + x, c[1] * k2), c[0]), c, xs)

    e = _eqn(f, (jnp.ones(3), jnp.ones(3)), jnp.ones((4, 3)), jnp.ones(3), jnp.ones(3),
             prim=compat.scan_p)
    assert compat.scan_split(e) == (2, 2)
    assert compat.scan_num_ys(e) == 1
    assert ("num_consts" in e.params) != ("ft_in" in e.params)


def test_backward_pass_logs_probe_matches_public_feature():
    """Backward-pass logs (jax 0.11.1): the probe of the custom_lin bwd protocol agrees with the
    public feature that introduced it, `jax.custom_vjp.defvjp_with_logs`."""
    assert compat.bwd_returns_logs() == hasattr(jax.custom_vjp, "defvjp_with_logs")


def test_custom_lin_call_bwd_and_wrap_bwd_round_trip():
    """A bwd wrapped by `wrap_bwd` is read back by `custom_lin_call_bwd` in either protocol."""
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))
    jaxpr = jax.make_jaxpr(lambda t: jax.linearize(f, 1.0)[1](t))(1.0)
    eqn = next(e for e in _all_eqns(jaxpr) if e.primitive is compat.custom_lin_p)
    assert compat.custom_lin_call_bwd(eqn.params["bwd"], [], [jnp.float32(3.0)]) == [6.0]
    wrapped = compat.wrap_bwd(lambda ct: [ct * 5], eqn.params["bwd"])
    assert compat.custom_lin_call_bwd(wrapped, [], [jnp.float32(1.0)]) == [5.0]


def _all_eqns(closed):
    jaxpr, _ = compat.jaxpr_and_consts(closed)
    for e in jaxpr.eqns:
        yield e
        for sub in compat.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


def test_seed_minimal_case_gives_float32():
    """The seed's own custom_vjp pattern, on whatever JAX is installed."""
    import hifigrad as hg

    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))

    def model(x):
        x = identity(x)
        x = lax.scan(lambda c, _: (identity(c), None), x, None, length=2)[0]
        return identity(x)

    for wrap in (lambda f: f, jax.jit):
        g = wrap(hg.grad(model))(jnp.asarray(8, jnp.bfloat16))
        assert g.dtype == jnp.float32 and float(g) == 1.0


# ---- a JAX internal that changes shape gives an error naming hifigrad, JAX and the tested range

def _assert_compat_message(err):
    msg = str(err)
    assert "hifigrad" in msg and jax.__version__ in msg
    assert compat.TESTED_JAX[0] in msg and compat.TESTED_JAX[-1] in msg


def _flip_protocol(monkeypatch):
    flipped = not compat.bwd_returns_logs()
    monkeypatch.setattr(compat, "bwd_returns_logs", lambda: flipped)


def test_changed_custom_vjp_protocol_is_reported(monkeypatch):
    """Simulates a JAX whose custom_vjp backward protocol differs from what hifigrad probed."""
    import hifigrad as hg

    @jax.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (f(x), None), lambda _, g: (2 * g,))
    _flip_protocol(monkeypatch)
    with pytest.raises(hg.JaxCompatibilityError, match="custom_vjp backward rule") as e:
        hg.grad(lambda x: f(x).sum())(jnp.ones(3, jnp.bfloat16))
    _assert_compat_message(e.value)


def test_renamed_scan_params_are_reported():
    """Simulates a JAX release whose scan equations carry neither num_consts nor ft_in."""
    import hifigrad as hg

    e = _eqn(lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs), jnp.ones(3),
             jnp.ones((4, 3)), prim=compat.scan_p)
    params = {k: v for k, v in e.params.items() if k not in ("num_consts", "num_carry", "ft_in")}
    with pytest.raises(hg.JaxCompatibilityError, match="scan equation") as err:
        compat.scan_split(e.replace(params=params))
    _assert_compat_message(err.value)


def test_user_errors_are_not_relabelled():
    """An error raised by the user's own backward reaches the user as it is."""
    import hifigrad as hg

    @jax.custom_vjp
    def f(x):
        return x

    def bwd(_, g):
        raise ValueError("my bwd is broken")

    f.defvjp(lambda x: (x, None), bwd)
    with pytest.raises(ValueError, match="my bwd is broken"):
        hg.grad(lambda x: f(x).sum())(jnp.ones(3, jnp.bfloat16))


def test_untested_jax_warns(monkeypatch):
    import hifigrad as hg

    assert compat.check_jax_version(warn=False)  # CI only runs tested releases
    monkeypatch.setattr(compat, "JAX_VERSION", (0, 99, 0))
    with pytest.warns(hg.UntestedJaxWarning, match="tested with jax"):
        assert not compat.check_jax_version()
    monkeypatch.setattr(compat, "JAX_VERSION", (0, 9, 4))
    with pytest.warns(hg.UntestedJaxWarning):
        assert not compat.check_jax_version()


@pytest.mark.parametrize("text,parsed", [("0.10.2", (0, 10, 2)), ("0.12.0.1", (0, 12, 0, 1)),
                                         ("0.13.0rc1", (0, 13, 0)),
                                         ("0.12.1.dev20261201", (0, 12, 1))])
def test_parse_version(text, parsed):
    assert compat._parse_version(text) == parsed


def test_tested_range_matches_package_metadata():
    """pyproject's jax requirement admits every tested release and no other minor series."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text()
    spec = re.search(r'"jax(>=[^"]+)"', text).group(1)
    lo = re.search(r">=([\d.]+)", spec).group(1)
    hi = re.search(r"<([\d.]+)", spec).group(1)
    assert lo == compat.TESTED_JAX[0]
    assert compat._parse_version(compat.TESTED_JAX[-1]) < compat._parse_version(hi)
    assert compat._parse_version(hi)[:2] == (0, compat._parse_version(compat.TESTED_JAX[-1])[1] + 1)


# ------------------------------------------------------------------------------ linear programs

def _mixed(w, x, s):
    h = jnp.tanh(x @ w) * s
    return jnp.sum(h * h), h.mean(0)


def _linearized(dtype):
    w = jnp.linspace(-1, 1, 12).reshape(3, 4).astype(dtype)
    x = jnp.linspace(0, 2, 6).reshape(2, 3).astype(dtype)
    s = jnp.asarray(0.5, dtype)
    args = (w, x, s)
    outs, lin = jax.linearize(_mixed, *args)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return args, outs, lin, avals


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linearized_jaxpr_is_read_on_this_release_and_computes_the_linear_map(dtype):
    """The program `jax.linearize` built is read without tracing (None would silently fall back
    to re-tracing it: slower, not wrong), and evaluates to what calling `lin` gives."""
    args, _, lin, avals = _linearized(dtype)
    jaxpr = compat.linearized_jaxpr(lin, avals)
    assert jaxpr is not None, "jax.linearize's result changed form: update compat"
    assert not jaxpr.constvars
    res = jax.tree_util.tree_leaves(lin)
    ts = [jnp.full(a.shape, 0.25, a.dtype) for a in args]
    closed = compat.closed_jaxpr_from(jaxpr, [], [], jaxpr.invars, jaxpr.outvars, jaxpr.eqns)
    got = compat.eval_closed_jaxpr(closed, [*res, *ts])
    want = jax.tree_util.tree_leaves(lin(*ts))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_linearized_jaxpr_declines_what_it_cannot_read():
    _, _, lin, avals = _linearized(jnp.float32)
    assert compat.linearized_jaxpr(lin, avals[:2]) is None  # tangents that do not match
    assert compat.linearized_jaxpr(lambda *t: t, avals) is None  # not jax.linearize's
    # An output whose tangent is a known zero (it does not depend on the inputs).
    _, lin0 = jax.linearize(lambda x: (x * 2, jnp.zeros(3)), jnp.ones(3))
    assert compat.linearized_jaxpr(lin0, [jax.ShapeDtypeStruct((3,), jnp.float32)]) is None


@pytest.mark.parametrize("jit", [False, True])
def test_transpose_jaxpr_is_linear_transpose(jit):
    w = jnp.linspace(-1, 1, 12).reshape(3, 4)

    def lin(r, t):  # linear in t; r is a known (non-linear) input
        return [jnp.sin(r) @ (t * 2.0), jnp.sum(t)]

    r = jnp.linspace(0, 1, 6).reshape(2, 3)
    t_aval = jax.ShapeDtypeStruct(w.shape, w.dtype)
    closed = jax.make_jaxpr(lin)(r, t_aval)
    cts = [jnp.linspace(-2, 2, 8).reshape(2, 4), jnp.float32(3.0)]

    def ours(r, cts):
        return compat.transpose_jaxpr(closed, [r], cts)

    def theirs(r, cts):
        return list(jax.linear_transpose(lambda t: lin(r, t), t_aval)(cts))

    f, g = (jax.jit(ours), jax.jit(theirs)) if jit else (ours, theirs)
    (a,), (b,) = f(r, cts), g(r, cts)
    np.testing.assert_array_equal(a, b)


def test_transposable_as_is_only_without_linear_control_flow():
    def straight(r, t):
        return [jnp.sin(r) * jax.jit(lambda v: v * 2.0)(t)]

    def looped(r, t):
        return [lax.scan(lambda c, x: (c * r + x, None), t, jnp.ones((3,) + t.shape))[0]]

    r, t = jnp.ones(3), jax.ShapeDtypeStruct((3,), jnp.float32)
    assert compat.transposable_as_is(jax.make_jaxpr(straight)(r, t), 1)
    assert not compat.transposable_as_is(jax.make_jaxpr(looped)(r, t), 1)

    def known_loop(r, t):  # a loop over known values only is evaluated, not transposed
        s = lax.scan(lambda c, x: (c * 2.0 + x, None), r, jnp.ones((3, 3)))[0]
        return [s * t]

    assert compat.transposable_as_is(jax.make_jaxpr(known_loop)(r, t), 1)


def test_clear_tracing_caches_retraces_a_scan_body():
    """A scan body's trace is cached by function (its Python does not run again); after
    `clear_tracing_caches` it does."""
    calls = []

    def body(c, x):
        calls.append(1)
        return c + x, None

    xs = jnp.ones((3, 2))
    jax.eval_shape(lambda xs: lax.scan(body, jnp.zeros(2), xs), xs)
    jax.eval_shape(lambda xs: lax.scan(body, jnp.zeros(2), xs), xs)
    assert len(calls) == 1
    compat.clear_tracing_caches()
    jax.eval_shape(lambda xs: lax.scan(body, jnp.zeros(2), xs), xs)
    assert len(calls) == 2
