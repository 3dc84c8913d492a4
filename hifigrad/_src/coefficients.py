"""``Policy(coefficients='tangent')``: derivative coefficients in tangent precision.

JAX computes the coefficient of an elementwise op's derivative in the forward (``1 - tanh(x)^2``
is a bf16 residual of a bf16 model), so a backward-only rewrite leaves its rounding in place. Under
this policy the function is re-traced with those ops replaced by twins whose JVP multiplies the
tangent by `coef_mul_p(t, saved)`: a primitive, linear in ``t``, that computes the coefficient
from the saved primal value *at the tangent's dtype*. In the promoted backward that is float32.
The forward computes exactly the same primal values with the same primitives; it saves the primal
(``tanh(x)``) instead of the coefficient, the same number of bytes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from . import compat
from .interpreter import Interpreter, RuleTable
from .policy import Policy

__all__ = ["precise_coefficients", "coef_mul_p", "COEFFICIENTS"]


# coefficient(kind)(*saved) -> d(primal op)/dx, evaluated at the tangent's dtype.
_COEF = {
    "tanh": lambda y: 1 - y * y,
    "logistic": lambda y: y * (1 - y),
    "exp": lambda y: y,
    "expm1": lambda y: y + 1,
    "log": lambda x: 1 / x,
    "log2": lambda x: 1 / (x * np.log(2)),  # a primitive of its own on jax >= 0.12
    "exp2": lambda y: y * np.log(2),
    "log1p": lambda x: 1 / (1 + x),
    "sin": lambda x: lax.cos(x),
    "cos": lambda x: -lax.sin(x),
    "sqrt": lambda y: 0.5 / y,
    "rsqrt": lambda x: -0.5 * lax.rsqrt(x) / x,
    "erf": lambda x: (2 / np.sqrt(np.pi)) * lax.exp(-x * x),
}


def _coef(kind, *saved):
    if kind.startswith("integer_pow:"):
        n = int(kind.split(":")[1])
        (x,) = saved
        # As JAX's own rule: x**0 is constant, so its derivative is 0 everywhere (not
        # 0 * x**-1, which is 0 * inf = NaN at x = 0).
        if n == 0:
            return lax.full_like(x, 0)
        return n * lax.integer_pow(x, n - 1) if n != 1 else lax.full_like(x, 1)
    if kind == "div_rhs":
        x, y = saved
        return -x / (y * y)
    return _COEF[kind](*saved)


coef_mul_p = compat.new_primitive("hifigrad_coef_mul")


def _coef_mul_impl(t, *saved, kind):
    saved = [lax.convert_element_type(s, t.dtype) for s in saved]
    c = _coef(kind, *saved)
    return t * lax.convert_element_type(c, t.dtype)


def _coef_mul_abstract(t, *saved, kind):
    del saved, kind
    return t.update(weak_type=False)


compat.register_impl_and_lowering(coef_mul_p, _coef_mul_impl, _coef_mul_abstract)


def _coef_mul_jvp(primals, tangents, *, kind):
    # jax.jvp wants primals and tangents as the same container type (JAX passes a tuple
    # and a list here).
    tangents = tuple(compat.instantiate_zeros(t) for t in tangents)
    return jax.jvp(functools.partial(_coef_mul_impl, kind=kind), tuple(primals), tangents)


def _coef_mul_transpose(ct, t, *saved, kind):
    if type(ct).__name__ == "Zero":
        return [None] * (1 + len(saved))
    assert compat.is_undefined_primal(t) and not any(
        compat.is_undefined_primal(s) for s in saved)
    return [coef_mul_p.bind(ct, *saved, kind=kind)] + [None] * len(saved)


def _coef_mul_batch(args, dims, *, kind):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jax.numpy.moveaxis(a, d, 0) if d is not None else
             jax.numpy.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)]
    return coef_mul_p.bind(*moved, kind=kind), 0


compat.register_jvp(coef_mul_p, _coef_mul_jvp)
compat.register_transpose(coef_mul_p, _coef_mul_transpose)
compat.register_batching(coef_mul_p, _coef_mul_batch)


# ------------------------------------------------------------------------------ precise twins

def _twin(prim_fn, kind, save):
    """A custom_jvp twin of an elementwise op: same primal, coefficient from saved values."""

    @jax.custom_jvp
    def f(*xs):
        return prim_fn(*xs)

    @f.defjvp
    def f_jvp(primals, tangents):
        y = prim_fn(*primals)
        saved = save(primals, y)
        t = tangents[0]
        return y, coef_mul_p.bind(t, *saved, kind=kind)

    return f


def _unary_rule(kind, save_output: bool):
    def rule(interp, eqn, invals, inflags):
        prim_fn = functools.partial(_bind_same, eqn)
        save = (lambda p, y: (y,)) if save_output else (lambda p, y: (p[0],))
        return [_twin(prim_fn, kind, save)(*invals)], [False]
    return rule


def _bind_same(eqn, *args):
    (out,) = compat.bind_eqn(eqn, list(args))
    return out


def _integer_pow_rule(interp, eqn, invals, inflags):
    prim_fn = functools.partial(_bind_same, eqn)
    kind = f"integer_pow:{eqn.params['y']}"
    return [_twin(prim_fn, kind, lambda p, y: (p[0],))(*invals)], [False]


def _div_rule(interp, eqn, invals, inflags):
    shape = tuple(eqn.outvars[0].aval.shape)
    x, y = (lax.broadcast_in_dim(v, shape, ()) if np.shape(v) == () and shape != () else v
            for v in invals)
    if np.shape(x) != np.shape(y):
        return compat.bind_eqn(eqn, invals), [False]

    @jax.custom_jvp
    def div(x, y):
        return _bind_same(eqn, x, y)

    @div.defjvp
    def div_jvp(primals, tangents):
        x, y = primals
        tx, ty = (compat.instantiate_zeros(t) for t in tangents)
        out = _bind_same(eqn, x, y)
        return out, lax.div(tx, y) + coef_mul_p.bind(ty, x, y, kind="div_rhs")

    return [div(x, y)], [False]


def _make_table() -> RuleTable:
    from .rules import PROMOTE, cond_rule, inline_rule, remat_rule, scan_rule, while_rule

    table = RuleTable()
    for name, save_out in (("tanh", True), ("logistic", True), ("exp", True), ("expm1", True),
                           ("exp2", True), ("log", False), ("log2", False), ("log1p", False),
                           ("sin", False), ("cos", False), ("sqrt", True), ("rsqrt", False),
                           ("erf", False)):
        for p in compat.primitives_named([name]):
            table.register(p, _unary_rule(name, save_out))
            table.always.add(p)
    for p in compat.primitives_named(["integer_pow"]):
        table.register(p, _integer_pow_rule)
        table.always.add(p)
    table.register(lax.div_p, _div_rule)
    table.always.add(lax.div_p)
    # Control flow and calls: recurse, so ops inside loops, remat and jit are reached too.
    for prim, rule in ((compat.scan_p, scan_rule), (compat.while_p, while_rule),
                       (compat.cond_p, cond_rule), (compat.remat_p, remat_rule),
                       (compat.pjit_p, inline_rule)):
        table.register(prim, rule, PROMOTE.flag_rules.get(prim))
        table.always.add(prim)
    return table


@functools.lru_cache(maxsize=1)
def _table() -> RuleTable:
    return _make_table()


COEFFICIENTS = _table


_TRACED_MESSAGE = (
    "Policy(coefficients='tangent') traces the function once to a jaxpr, abstractly (as "
    "jax.jit does), to find the elementwise ops whose derivative coefficients it recomputes in "
    "the backward; on that trace array values are not known, so Python control flow on them (an "
    "`if` or `while` on a value, float(x), x.item(), np.asarray(x)) is not possible. Write it "
    "with jnp.where / lax.cond / lax.while_loop, or use Policy(coefficients='forward') (the "
    "default), which runs the function as jax.grad does.")


def precise_coefficients(fun_flat, policy: Policy, has_aux: bool = False,
                         fallback: bool = False):
    """Returns `fun_flat` re-traced with elementwise ops whose JVP coefficients are computed in
    the backward, at the tangent's dtype. `fun_flat(*arrays)` returns a list (or (list, aux)
    with ``has_aux``: aux leaves that are not JAX arrays -- strings, Python numbers -- are
    returned as they are, as `jax.linearize` does, not traced). With `fallback` (the 'auto'
    policy), a function that cannot be traced abstractly (Python control flow on values) runs
    as it is, its coefficients the forward's, instead of raising."""

    def wrapped(*args):
        static_aux: list = []

        def traced(*xs):
            if not has_aux:
                return fun_flat(*xs)
            outs, aux = fun_flat(*xs)
            leaves, aux_tree = jax.tree_util.tree_flatten(aux)
            dyn = [isinstance(leaf, jax.Array) for leaf in leaves]
            static_aux.append((aux_tree, leaves, dyn))
            return outs, [leaf for leaf, d in zip(leaves, dyn) if d]

        try:
            jaxpr, consts, out_tree = compat.make_jaxpr_closed(traced, *args)
        except jax.errors.ConcretizationTypeError as e:
            if fallback:
                return fun_flat(*args)
            raise TypeError(f"{_TRACED_MESSAGE} JAX said: {str(e).splitlines()[0]}") from e
        interp = Interpreter(policy, _table())
        outs, _ = interp.eval(jaxpr, consts, list(args), [False] * len(args))
        outs = jax.tree_util.tree_unflatten(out_tree, outs)
        if not has_aux:
            return outs
        outs, aux_dyn = outs
        aux_tree, leaves, dyn = static_aux[-1]
        it = iter(aux_dyn)
        aux = [next(it) if d else leaf for leaf, d in zip(leaves, dyn)]
        return outs, jax.tree_util.tree_unflatten(aux_tree, aux)

    return wrapped


def _register_promotion_rule():
    from .rules import PROMOTE, promote_rule

    PROMOTE.register(coef_mul_p, promote_rule)


_register_promotion_rule()
