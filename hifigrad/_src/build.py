"""Writes the promoted linear program as a jaxpr, equation by equation, without tracing it.

The interpreter (`interpreter.py`) evaluates a program's rules on tracers, so every equation of
the linear program is bound again through JAX's tracing machinery (abstract evaluation, tracer
and equation construction, source-info and context managers). For an unrolled model that was
most of what `hg.grad` adds to `jax.grad`'s trace time. The promoted program is a function of
the linear program and the policy alone, so this module writes it directly, reusing what the
interpreter's rules would have produced:

- an equation no promoted value reaches is kept as it is (the same equation object);
- an equation whose rule is the default (`rules.default_rule` / `promote_rule`) is re-emitted
  with its float inputs promoted, its float dtype params promoted and the output avals of its
  abstract evaluation at those inputs (`rules.promotion`, cached: the evidence the interpreter
  checks before binding it); residual inputs get the same staged `upcast` the interpreter stages;
- `convert_element_type` and matmuls follow `convert_rule` and `matmul_rule`;
- a call (jit, custom_jvp_call, custom_vjp_call) is inlined, as `inline_rule` inlines it;
- a skip-connection `add` gets `interpreter.materialize`, as in the interpreter.

Every other equation (loops, conds, checkpoints, custom_lin, callbacks, fallbacks, ...) runs
through the interpreter's own rule, traced on its own into a small jaxpr that is spliced in. The
result is the program the interpreter traces, equation for equation up to the order of
independent casts and names; tests check the gradients are bitwise equal.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from . import compat
from .dtypes import is_real_float
from .interpreter import Interpreter, materialize
from .primitives import upcast_p
from .rules import (
    _call_jaxpr_param,
    _floating_aval,
    _promote_params,
    _promoted_aval,
    convert_rule,
    default_rule,
    inline_rule,
    matmul_rule,
    promote_rule,
    promotion,
)

__all__ = ["promoted_jaxpr"]

_Literal = jax.extend.core.Literal


def promoted_jaxpr(interp: Interpreter, jaxpr, n_known: int, out_dtypes):
    """The promoted program of the open jaxpr `jaxpr` (its constvars and first `n_known` invars
    are residuals; the rest are tangents, promoted), as a closed jaxpr over ``[*constvars,
    *invars]`` whose float outputs are cast to `out_dtypes` (None: an output left out). What
    ``jax.make_jaxpr`` of the interpreter's evaluation of `jaxpr` gives, without tracing it."""
    b = _Builder(interp)
    known = [*jaxpr.constvars, *jaxpr.invars[:n_known]]
    tangents = [compat.new_var(_promoted_aval(interp, v.aval)) for v in jaxpr.invars[n_known:]]
    outs, flags = b.run(jaxpr, [*jaxpr.invars[:n_known], *tangents],
                        [False] * n_known + [True] * len(tangents),
                        consts=list(jaxpr.constvars), fresh=False)
    final = []
    for o, d in zip(outs, out_dtypes):
        if d is None:
            continue
        final.append(o if not is_real_float(d) or np.dtype(o.aval.dtype) == np.dtype(d) else
                     b.traced(lambda x, d=d: lax.convert_element_type(x, d), [o])[0])
    return compat.closed_jaxpr_from(jaxpr, b.constvars, b.consts, [*known, *tangents], final,
                                    b.eqns)


class _Builder:
    def __init__(self, interp: Interpreter):
        self.interp = interp
        self.eqns: list = []
        self.constvars: list = []  # constants that spliced programs close over
        self.consts: list = []
        self._upcasts: dict = {}  # (residual var, dtype) -> its staged upcast
        self._spliced: dict = {}  # aval -> closed jaxpr of `materialize`

    # ------------------------------------------------------------------ the walk
    def run(self, jaxpr, args, flags, *, consts=(), fresh: bool):
        """Emits `jaxpr` on the atoms `consts + args` (`flags`: which args are promoted).
        `fresh`: give every output a new variable (a jaxpr emitted more than once, like a
        shared jit body); else the jaxpr's own variables are reused. Returns (atoms, flags)."""
        interp, table = self.interp, self.interp.table
        rules, default, always = table.rules, table.default, table.always
        env: dict = {}

        def read(v):
            return (v, False) if type(v) is _Literal else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = (c, False)
        for v, a, f in zip(jaxpr.invars, args, flags):
            env[v] = (a, bool(f) and _floating_aval(v.aval))
        skips = interp._skip_adds(jaxpr)  # noqa: SLF001
        for i, eqn in enumerate(jaxpr.eqns):
            atoms, inflags, promoted = [], [], False
            for v in eqn.invars:
                if type(v) is _Literal:
                    atoms.append(v)
                    inflags.append(False)
                else:
                    a, f = env[v]
                    atoms.append(a)
                    inflags.append(f)
                    promoted = promoted or f
            if not promoted and eqn.primitive not in always:
                for v, o in zip(eqn.outvars, self._emit_as_is(eqn, atoms, fresh)):
                    env[v] = (o, False)
                continue
            rule = rules.get(eqn.primitive, default)
            handler = _HANDLERS.get(rule)
            res = None
            if handler is not None:
                # Abstract evaluation sees the equation's context (its mesh, ...), as the
                # interpreter's rules do.
                with compat.eqn_ctx(eqn):
                    res = handler(self, eqn, atoms, inflags)
            if res is None:  # the interpreter's rule, traced on its own
                res = self._traced_eqn(eqn, atoms, inflags)
            outs, oflags = res
            if i in skips and all(inflags) and all(oflags):
                outs = [self._materialize(o) for o in outs]
            for v, o, f in zip(eqn.outvars, outs, oflags):
                env[v] = (o, bool(f) and _floating_aval(v.aval))
        got = [read(v) for v in jaxpr.outvars]
        return [a for a, _ in got], [f for _, f in got]

    def _emit_as_is(self, eqn, atoms, fresh):
        if not fresh and all(a is v for a, v in zip(atoms, eqn.invars)):
            self.eqns.append(eqn)
            return list(eqn.outvars)
        outs = [compat.new_var(v.aval) for v in eqn.outvars] if fresh else list(eqn.outvars)
        self.eqns.append(eqn.replace(invars=list(atoms), outvars=outs))
        return outs

    # ------------------------------------------------------------------ emitting
    def emit(self, eqn, atoms, params, out_avals, effects):
        outs = [compat.new_var(a) for a in out_avals]
        self.eqns.append(eqn.replace(invars=list(atoms), outvars=outs, params=params,
                                     effects=effects))
        return outs

    def cast_up(self, atom, eqn, flagged: bool):
        """`atom` (float) in its promoted dtype, as `Interpreter.cast_up` gives it: a literal
        is converted now, a residual through a staged `upcast` (once per residual), a promoted
        value of another dtype through a convert."""
        aval = atom.aval
        target = self.interp.up(aval.dtype)
        if target == np.dtype(aval.dtype):
            return atom
        if flagged:
            return self.traced(lambda x: lax.convert_element_type(x, target), [atom])[0]
        if compat.is_literal(atom):
            return compat.new_literal(np.asarray(atom.val).astype(target))
        key = (atom, target)
        hit = self._upcasts.get(key)
        if hit is None:
            params = dict(new_dtype=target)
            out, effects = upcast_p.abstract_eval(aval, **params)
            hit = self._upcasts[key] = self.emit(
                eqn.replace(primitive=upcast_p), [atom], params, [out], effects)[0]
        return hit

    # ------------------------------------------------------------------ tracing a piece
    def traced(self, fn, atoms):
        """Emits ``fn(*atoms)`` (a function of values), traced on its own and spliced in."""
        var_pos = [i for i, a in enumerate(atoms) if not compat.is_literal(a)]

        def f(*xs):
            vals = [a.val if compat.is_literal(a) else None for a in atoms]
            for i, x in zip(var_pos, xs):
                vals[i] = x
            return fn(*vals)

        closed = jax.make_jaxpr(f)(*[atoms[i].aval for i in var_pos])
        return self.splice(closed, [atoms[i] for i in var_pos], fresh=False)

    def _traced_eqn(self, eqn, atoms, inflags):
        box: list = []

        def fn(*vals):
            outs, oflags = self.interp.eval_eqn(eqn, list(vals), list(inflags))
            box.append(oflags)
            return list(outs)

        outs = self.traced(fn, atoms)
        return outs, box[0]

    def splice(self, closed, args, *, fresh: bool):
        """Emits the equations of `closed` on the atoms `args`; its constants become the
        built program's. `fresh`: new variables for its outputs (a jaxpr spliced repeatedly)."""
        jaxpr, consts = compat.jaxpr_and_consts(closed)
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            nv = compat.new_var(v.aval)
            self.constvars.append(nv)
            self.consts.append(c)
            env[v] = nv
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v if compat.is_literal(v) else env[v]

        for e in jaxpr.eqns:
            outs = [compat.new_var(v.aval) for v in e.outvars] if fresh else list(e.outvars)
            self.eqns.append(e.replace(invars=[read(v) for v in e.invars], outvars=outs))
            env.update(zip(e.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def _materialize(self, atom):
        if compat.is_literal(atom) or not _floating_aval(atom.aval):
            return atom
        closed = self._spliced.get(atom.aval)
        if closed is None:
            closed = self._spliced[atom.aval] = jax.make_jaxpr(materialize)(atom.aval)
        return self.splice(closed, [atom], fresh=True)[0]


# ---------------------------------------------------------------------- the rules written here
# Each takes (builder, eqn, input atoms, input flags) and returns (output atoms, output flags),
# or None to run the interpreter's rule instead.

def _promote(b: _Builder, eqn, atoms, inflags, params):
    """`promote_rule`: every float input promoted, params promoted, outputs promoted."""
    interp = b.interp
    avals = [compat.aval_of(a.val) if type(a) is _Literal else a.aval for a in atoms]
    why, out_avals, effects = promotion(interp, eqn, avals, params)
    if why is not None or effects:
        return None
    args = [b.cast_up(a, eqn, f) if _floating_aval(av) else a
            for a, f, av in zip(atoms, inflags, avals)]
    return b.emit(eqn, args, params, out_avals, effects), [True] * len(out_avals)


def _default(b: _Builder, eqn, atoms, inflags):
    if compat.jaxprs_in_params(eqn.params) or any(
            not _floating_aval(v.aval) and compat.is_ref_or_extended(v.aval) for v in eqn.invars):
        return None
    return _promote(b, eqn, atoms, inflags, _promote_params(b.interp, eqn.params))


def _promote_as_rule(b: _Builder, eqn, atoms, inflags):
    if compat.jaxprs_in_params(eqn.params):
        return None
    return _promote(b, eqn, atoms, inflags, _promote_params(b.interp, eqn.params))


def _matmul(b: _Builder, eqn, atoms, inflags):
    prec = b.interp.policy.lax_precision()
    if prec is not None and "precision" in eqn.params:
        eqn = eqn.replace(params=dict(eqn.params, precision=(prec, prec)))
    return _default(b, eqn, atoms, inflags)


def _convert(b: _Builder, eqn, atoms, inflags):
    (x,), new_dtype = atoms, np.dtype(eqn.params["new_dtype"])
    if compat.is_literal(x) or not _floating_aval(eqn.outvars[0].aval):
        return None
    target = b.interp.up(new_dtype)
    if np.dtype(x.aval.dtype) == target:
        return [x], [True]
    params = dict(eqn.params, new_dtype=target, weak_type=False)
    out_avals, effects = compat.abstract_eval_effects(eqn, [x.aval], params)
    return b.emit(eqn, [x], params, out_avals, effects), [True]


def _inline(b: _Builder, eqn, atoms, inflags):
    j = _call_jaxpr_param(eqn)
    jaxpr, consts = compat.jaxpr_and_consts(j)
    if any(isinstance(c, jax.core.Tracer) for c in consts):
        return None
    n = len(jaxpr.invars)
    cvars = []
    for c in consts:
        v = compat.new_var(compat.aval_of(c))
        b.constvars.append(v)
        b.consts.append(c)
        cvars.append(v)
    return b.run(jaxpr, atoms[len(atoms) - n:], inflags[len(inflags) - n:], consts=cvars,
                 fresh=True)


_HANDLERS = {default_rule: _default, promote_rule: _promote_as_rule, matmul_rule: _matmul,
             convert_rule: _convert, inline_rule: _inline}
