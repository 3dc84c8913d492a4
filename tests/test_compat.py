"""The compat module: one interface over JAX 0.10 and 0.11+ internals."""

import jax
import jax.numpy as jnp
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
