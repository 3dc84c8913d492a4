"""The rule table against `jax.grad`, over a table of programs covering every construct.

With float32 primals and tangent dtype float32 nothing is promoted, so `hg.grad` must equal
`jax.grad` (rtol 1e-6: the same operations, at most reassociated by a different jaxpr). With bf16
primals every rule runs in promotion; the gradient must be float32 and match the float32 model's
gradient to within the forward's bf16 rounding (cosine similarity >= 0.99: each forward op rounds
to 2^-9 relative, and these programs have at most a few dozen ops on any path).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import ALL, PROGRAMS

import hifigrad as hg
from hifigrad._src.rules import PROMOTE


def _argnums(args):
    def floating(a):
        return all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree_util.tree_leaves(a))
    return tuple(i for i, a in enumerate(args) if floating(a))


def _leaves(t):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]


def test_table_is_large_enough():
    assert len(ALL) >= 40


# Programs whose f32 version contains an explicit bf16 section: there hg is *meant* to differ
# from jax.grad (it runs that section's backward in f32); checked in test_api instead.
_INTERNAL_LOW_PRECISION = {"mixed_precision_casts"}


@pytest.mark.parametrize("name", [n for n in ALL if n not in _INTERNAL_LOW_PRECISION])
def test_f32_equals_jax_grad(name, maybe_jit):
    fun, make = PROGRAMS[name]
    args = make(jnp.float32)
    nums = _argnums(args)
    got = maybe_jit(hg.grad(fun, argnums=nums))(*args)
    want = maybe_jit(jax.grad(fun, argnums=nums))(*args)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * float(
            np.max(np.abs(np.asarray(w))) + 1e-30))


def test_report_bitwise_equal_count(capsys):
    """Reports how many of the table's programs give bitwise-equal gradients (jit)."""
    equal = 0
    names = [n for n in ALL if n not in _INTERNAL_LOW_PRECISION]
    for name in names:
        fun, make = PROGRAMS[name]
        args = make(jnp.float32)
        nums = _argnums(args)
        got = jax.jit(hg.grad(fun, argnums=nums))(*args)
        want = jax.jit(jax.grad(fun, argnums=nums))(*args)
        equal += all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                     zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    with capsys.disabled():
        print(f"\n[hifigrad] bitwise-equal gradients: {equal}/{len(names)} programs (jit, f32)")
    assert equal >= len(names) // 2


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision_runs_every_rule(name, dtype, maybe_jit):
    fun, make = PROGRAMS[name]
    args = make(dtype)
    nums = _argnums(args)
    got = maybe_jit(hg.grad(fun, argnums=nums))(*args)
    ref_args = make(jnp.float32)
    want = jax.grad(fun, argnums=nums)(*ref_args)
    for g in jax.tree_util.tree_leaves(got):
        assert g.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(g)))
    g, w = np.concatenate([x.ravel() for x in _leaves(got)]), np.concatenate(
        [x.ravel() for x in _leaves(want)])
    cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30)
    assert cos >= 0.99, cos


# --------------------------------------------------------------------------- unsupported


def _opaque_p():
    from hifigrad._src import compat

    p = compat.new_primitive("test_opaque_double")
    compat.register_impl_and_lowering(p, lambda x: x * 2, lambda x: x)
    compat.register_jvp(p, lambda primals, tangents: (p.bind(primals[0]), p.bind(tangents[0])))

    def transpose(ct, x):
        return [p.bind(ct)]
    compat.register_transpose(p, transpose)
    return p


_OPAQUE = _opaque_p()


def _opaque_fun(x):
    return jnp.sum(_OPAQUE.bind(jnp.sin(x)).astype(jnp.float32))


def test_unsupported_primitive_error_names_it_and_the_switch():
    x = jnp.ones(3, jnp.bfloat16)
    with pytest.raises(hg.UnsupportedPrimitiveError) as e:
        hg.grad(_opaque_fun)(x)
    msg = str(e.value)
    assert "test_opaque_double" in msg and "unsupported='fallback'" in msg


def test_unsupported_primitive_fallback_warns_once_and_is_correct(maybe_jit):
    x = jnp.linspace(0, 1, 3).astype(jnp.bfloat16)
    pol = hg.Policy(unsupported="fallback")
    from hifigrad._src import interpreter

    interpreter._warned.discard("test_opaque_double")
    with pytest.warns(UserWarning, match="test_opaque_double"):
        g = maybe_jit(hg.grad(_opaque_fun, policy=pol))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x, np.float64)), rtol=2 ** -7)


def test_register_rule_into_a_copy_of_the_table():
    table = PROMOTE.copy()
    from hifigrad._src.rules import promote_rule

    table.register(_OPAQUE, promote_rule)
    assert _OPAQUE in table.rules and _OPAQUE not in PROMOTE.rules
