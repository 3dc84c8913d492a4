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
from .primitives import coef_mul_p, pin

__all__ = ["precise_coefficients", "pinned_choosers", "coef_mul_p", "COEFFICIENTS"]


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


# ------------------------------------------------------------------------------ pinned choosers

# Reductions whose JVP compares the operand with the result (JAX's `_reduce_chooser_jvp_rule`:
# ``operand == max``, then a division by the number of maxima).
_CHOOSERS = frozenset(compat.primitives_named(["reduce_max", "reduce_min"]))
# Where a chooser may sit: equations whose sub-jaxprs the rewrite enters (anything else holding
# one keeps it as it is: a custom rule's own derivative does not use the chooser's JVP).
_ENTERED = ("scan_p", "while_p", "cond_p", "remat_p", "pjit_p", "shard_map_p")


def _is_float_var(v) -> bool:
    dt = getattr(v.aval, "dtype", None)
    return dt is not None and jax.numpy.issubdtype(dt, jax.numpy.inexact) and \
        not compat.dtype_is_float0(dt)


def _differentiated(jaxpr) -> frozenset:
    """The variables of `jaxpr` whose tangent can reach an output: every float output, and
    backward from there through every equation but `stop_gradient` (a softmax's max is
    differentiated no further)."""
    live = {v for v in jaxpr.outvars if not compat.is_literal(v) and _is_float_var(v)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is compat.stop_gradient_p:
            continue
        if any(v in live for v in eqn.outvars if not compat.is_dropvar(v)):
            live.update(v for v in eqn.invars
                        if not compat.is_literal(v) and _is_float_var(v))
    return frozenset(live)


class _Choosers:
    """Which jaxprs hold a differentiated chooser (their own equations or a sub-jaxpr's),
    cached by identity for one rewrite."""

    def __init__(self):
        self._live: dict = {}
        self._holds: dict = {}
        self._entered = frozenset(p for p in (getattr(compat, n) for n in _ENTERED) if p)

    def differentiated(self, jaxpr) -> frozenset:
        hit = self._live.get(id(jaxpr))
        if hit is None:
            hit = self._live[id(jaxpr)] = (jaxpr, _differentiated(jaxpr))
        return hit[1]

    def pinned(self, jaxpr, eqn) -> bool:
        """Whether `eqn` (of `jaxpr`) is a chooser whose result is differentiated."""
        return (eqn.primitive in _CHOOSERS and _is_float_var(eqn.invars[0])
                and eqn.outvars[0] in self.differentiated(jaxpr))

    def holds(self, jaxpr) -> bool:
        hit = self._holds.get(id(jaxpr))
        if hit is None:
            found = any(
                self.pinned(jaxpr, e) or (e.primitive in self._entered and any(
                    self.holds(compat.jaxpr_and_consts(j)[0])
                    for j in compat.jaxprs_in_params(e.params)))
                for e in jaxpr.eqns)
            hit = self._holds[id(jaxpr)] = (jaxpr, found)
        return hit[1]


def _chooser_rule(interp, eqn, invals, inflags):
    """A chooser: its operand pinned (`primitives.pin_p`) when its result is differentiated,
    so that its JVP's comparison reads the very values it reduced."""
    jaxpr = interp.current_jaxpr()
    x = invals[0]
    if interp.choosers.pinned(jaxpr, eqn) and isinstance(x, jax.core.Tracer):
        x = pin(x)
    return compat.bind_eqn(eqn, [x, *invals[1:]]), [False] * len(eqn.outvars)


def _entering(rule):
    """`rule` (a control-flow or call rule) where the sub-jaxprs hold a differentiated chooser;
    the equation bound as it is elsewhere (jit boundaries, remat and loops untouched)."""

    def entering(interp, eqn, invals, inflags):
        if any(interp.choosers.holds(compat.jaxpr_and_consts(j)[0])
               for j in compat.jaxprs_in_params(eqn.params)):
            return rule(interp, eqn, invals, inflags)
        return compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)

    return entering


# ------------------------------------------------------------------------------ the tables

def _make_table(coefficients: bool) -> RuleTable:
    from .rules import (
        PROMOTE,
        cond_rule,
        inline_rule,
        remat_rule,
        scan_rule,
        shard_map_rule,
        while_rule,
    )

    table = RuleTable()
    if coefficients:
        for name, save_out in (("tanh", True), ("logistic", True), ("exp", True),
                               ("expm1", True), ("exp2", True), ("log", False),
                               ("log2", False), ("log1p", False), ("sin", False),
                               ("cos", False), ("sqrt", True), ("rsqrt", False),
                               ("erf", False)):
            for p in compat.primitives_named([name]):
                table.register(p, _unary_rule(name, save_out))
                table.always.add(p)
        for p in compat.primitives_named(["integer_pow"]):
            table.register(p, _integer_pow_rule)
            table.always.add(p)
        table.register(lax.div_p, _div_rule)
        table.always.add(lax.div_p)
    for p in _CHOOSERS:
        table.register(p, _chooser_rule)
        table.always.add(p)
    # Control flow and calls: recurse, so ops inside loops, remat and jit are reached too
    # (for the choosers alone, only where one is inside).
    for prim, rule in ((compat.scan_p, scan_rule), (compat.while_p, while_rule),
                       (compat.cond_p, cond_rule), (compat.remat_p, remat_rule),
                       (compat.pjit_p, inline_rule), (compat.shard_map_p, shard_map_rule)):
        if prim is None or (coefficients and prim is compat.shard_map_p):
            continue
        table.register(prim, rule if coefficients else _entering(rule),
                       PROMOTE.flag_rules.get(prim))
        table.always.add(prim)
    return table


@functools.lru_cache(maxsize=2)
def _table(coefficients: bool = True) -> RuleTable:
    return _make_table(coefficients)


COEFFICIENTS = _table


_TRACED_MESSAGE = (
    "Policy(coefficients='tangent') traces the function once to a jaxpr, abstractly (as "
    "jax.jit does), to find the elementwise ops whose derivative coefficients it recomputes in "
    "the backward; on that trace array values are not known, so Python control flow on them (an "
    "`if` or `while` on a value, float(x), x.item(), np.asarray(x)) is not possible. Write it "
    "with jnp.where / lax.cond / lax.while_loop, or use Policy(coefficients='forward') (the "
    "default), which runs the function as jax.grad does.")


def _rewritten(fun_flat, policy: Policy, has_aux: bool, table: RuleTable, on_traced_error):
    """`fun_flat` traced once to a jaxpr and re-evaluated by `table` (`Interpreter`, no value
    promoted; an equation no rule names is bound as it is). `fun_flat(*arrays)` returns a list
    (or (list, aux) with ``has_aux``: aux leaves that are not JAX arrays -- strings, Python
    numbers -- are returned as they are, as `jax.linearize` does, not traced).
    `on_traced_error(args, error)` answers for a function that cannot be traced abstractly."""

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
            return on_traced_error(args, e)
        interp = Interpreter(policy, table)
        interp.choosers = _Choosers()
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


def precise_coefficients(fun_flat, policy: Policy, has_aux: bool = False,
                         fallback: bool = False):
    """Returns `fun_flat` re-traced with elementwise ops whose JVP coefficients are computed in
    the backward, at the tangent's dtype, and its differentiated choosers pinned
    (`pinned_choosers`). With `fallback` (the 'auto' policy), a function that cannot be traced
    abstractly (Python control flow on values) runs as it is, its coefficients the forward's,
    instead of raising."""

    def on_error(args, e):
        if fallback:
            return fun_flat(*args)
        raise TypeError(f"{_TRACED_MESSAGE} JAX said: {str(e).splitlines()[0]}") from e

    return _rewritten(fun_flat, policy, has_aux, _table(True), on_error)


def pinned_choosers(fun_flat, policy: Policy, has_aux: bool = False):
    """Returns `fun_flat` with the operand of every `reduce_max` / `reduce_min` whose result is
    differentiated pinned (`primitives.pin_p`): computed once, so that the chooser's JVP
    compares the values it reduced, whatever XLA fuses (see `primitives`). Used where the
    function is linearized under a trace (jit, a scan body, a checkpoint's recomputation), and
    only then: eagerly each operation runs on its own. The function is traced once, and its
    program evaluated: equations that hold no such chooser are bound as they are (jit
    boundaries, remat, loops and custom rules kept). One that cannot be traced abstractly runs
    as it is."""
    return _rewritten(fun_flat, policy, has_aux, _table(False),
                      lambda args, e: fun_flat(*args))
