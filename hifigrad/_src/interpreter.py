"""A jaxpr interpreter that re-runs a program with some values *promoted*.

A value is promoted when it derives from a cotangent (or tangent): it is then held in
``promoted_dtype(original dtype, tangent dtype)`` instead of its original dtype. The interpreter
evaluates a jaxpr equation by equation on the current trace (so whoever calls it, `make_jaxpr`,
`jit`, `linear_transpose`, traces the promoted program). An equation none of whose inputs is
promoted is bound unchanged: residual and forward computations keep their own dtype. An equation
with a promoted input goes to its rule, looked up by primitive in a `RuleTable`:
``rule(interp, eqn, invals, inflags) -> (outvals, outflags)``. Control-flow rules re-trace through
JAX's public API (`lax.scan`, `lax.while_loop`, `lax.switch`, `jax.checkpoint`), which keeps
hifigrad independent of each JAX version's equation params; loops find which carries are promoted
with a fixpoint over the body (`Interpreter.flags`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from . import compat
from .dtypes import promoted_dtype
from .policy import Policy
from .primitives import upcast

__all__ = ["Interpreter", "PrecisionFallbackWarning", "RuleTable", "UnsupportedPrimitiveError"]

Rule = Callable[["Interpreter", Any, list, list], tuple[list, list]]
FlagRule = Callable[["Interpreter", Any, list], list]


class UnsupportedPrimitiveError(NotImplementedError):
    """A cotangent reaches a primitive that cannot run promoted, under
    ``Policy(unsupported='error')``.

    The message names the primitive, why it cannot run promoted, and the two ways on:
    ``Policy(unsupported='fallback')`` (run it at its own dtype) or `hifigrad.register_rule`.

    Examples:
      >>> import hifigrad as hg
      >>> strict = hg.Policy(unsupported="error")   # raise instead of falling back
      >>> issubclass(hg.UnsupportedPrimitiveError, NotImplementedError)
      True
    """


class PrecisionFallbackWarning(UserWarning):
    """A cotangent reaches a primitive that cannot run promoted: it runs at its own dtype, with
    casts at its edges, so values through it are rounded to that dtype.

    Warned once per primitive and differentiated function, naming the primitive and why (so a
    warning suppressed for one function does not hide another's).
    ``Policy(unsupported='error')`` raises `UnsupportedPrimitiveError` instead.

    Examples:
      >>> import warnings, jax.numpy as jnp, hifigrad as hg
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", hg.PrecisionFallbackWarning)   # make it an error
      ...     g = hg.grad(lambda x: jnp.sum(jnp.sin(x)))(jnp.ones(2, jnp.bfloat16))
      >>> g.dtype
      dtype('float32')
    """


@dataclasses.dataclass
class RuleTable:
    """Rules keyed by primitive. `flag_rules` say which outputs a rule promotes (default: all
    floating outputs when any input is promoted); `always` lists primitives whose rule runs even
    when no input is promoted (control flow, for passes that must reach inside); `default` is
    the rule of every primitive the table does not name (None: such a primitive is bound
    unchanged when no input is promoted, and is unsupported otherwise)."""

    rules: dict = dataclasses.field(default_factory=dict)
    flag_rules: dict = dataclasses.field(default_factory=dict)
    always: set = dataclasses.field(default_factory=set)
    default: Rule | None = None

    def register(self, prims, rule: Rule, flag_rule: FlagRule | None = None) -> None:
        for p in prims if isinstance(prims, (list, tuple, set)) else [prims]:
            if p is None:
                continue
            self.rules[p] = rule
            if flag_rule is not None:
                self.flag_rules[p] = flag_rule

    def copy(self) -> RuleTable:
        return RuleTable(dict(self.rules), dict(self.flag_rules), set(self.always), self.default)


class _WarnedSites(set):
    """The (primitive name, site) pairs already warned about: a fallback warns once per primitive
    *per differentiated function* (its site), so a warning suppressed for one function (inside
    `warnings.catch_warnings()`) cannot hide a later, different function falling back at the
    same primitive. ``discard(name)`` forgets a primitive at every site."""

    def discard(self, item):
        if isinstance(item, str):
            for key in [k for k in self if k[0] == item]:
                super().discard(key)
        else:
            super().discard(item)


_warned: set = _WarnedSites()
# The differentiated function whose backward is being traced (`fallback_site`).
_site: contextvars.ContextVar = contextvars.ContextVar("hifigrad_fallback_site", default=None)


def site_of(fun) -> Any:
    """A hashable name for the user function `fun` (unwrapping `functools.wraps` and
    `functools.partial`): its code's file, first line and name."""
    f = inspect.unwrap(fun) if callable(fun) else fun
    while isinstance(f, functools.partial):
        f = inspect.unwrap(f.func)
    code = getattr(f, "__code__", None)
    if code is None:
        return getattr(f, "__qualname__", type(f).__qualname__)
    return (code.co_filename, code.co_firstlineno, code.co_name)


@contextlib.contextmanager
def fallback_site(site):
    """Fallback warnings raised inside are deduplicated per (primitive, `site`)."""
    token = _site.set(site)
    try:
        yield
    finally:
        _site.reset(token)


def _is_float_aval(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    return dt is not None and jax.numpy.issubdtype(dt, jax.numpy.floating)


class Interpreter:
    """Evaluates jaxprs with promotion. One instance per transform call (it caches analyses)."""

    def __init__(self, policy: Policy, table: RuleTable):
        self.policy = policy
        self.table = table
        self._flag_cache: dict = {}
        self._frames: list = []  # (jaxpr, env) of the jaxprs being evaluated, innermost last

    def lookup(self, var):
        """The current value of `var` in the innermost jaxpr being evaluated."""
        return var.val if compat.is_literal(var) else self._frames[-1][1][var]

    def producer(self, var):
        """The equation of the innermost jaxpr being evaluated that defines `var` (or None)."""
        jaxpr = self._frames[-1][0]
        key = id(jaxpr)
        prod = self._producers.get(key) if hasattr(self, "_producers") else None
        if prod is None:
            self._producers = getattr(self, "_producers", {})
            prod = {v: e for e in jaxpr.eqns for v in e.outvars}
            self._producers[key] = prod
        return None if compat.is_literal(var) else prod.get(var)

    # ---------------------------------------------------------------- dtypes
    def up(self, dtype):
        return promoted_dtype(np.dtype(dtype), self.policy.tangent_dtype)

    def cast_up(self, x, flagged: bool = False):
        """`x` in its promoted dtype. Unpromoted values (residuals) use the staged `upcast`."""
        dt = np.dtype(x.dtype)
        target = self.up(dt)
        if target == dt:
            return x
        if flagged or not isinstance(x, jax.core.Tracer):
            return lax.convert_element_type(x, target)
        return upcast(x, target)

    def cast_like(self, x, aval):
        """Casts `x` (possibly promoted) back to the dtype of `aval`."""
        if np.dtype(x.dtype) == np.dtype(aval.dtype):
            return x
        return lax.convert_element_type(x, aval.dtype)

    # ---------------------------------------------------------------- evaluation
    def eval(self, jaxpr, consts: Sequence, args: Sequence, flags: Sequence[bool]):
        """Evaluates `jaxpr` on `consts + args`; `flags` mark promoted args. Returns
        `(outs, out_flags)`."""
        env: dict = {}
        fenv: dict = {}

        def read(v):
            if compat.is_literal(v):
                return v.val, False
            return env[v], fenv[v]

        def write(v, val, flag):
            if compat.is_dropvar(v):
                return
            env[v] = val
            fenv[v] = bool(flag) and _is_float_aval(v.aval)

        for v, c in zip(jaxpr.constvars, consts):
            write(v, c, False)
        assert len(jaxpr.invars) == len(args) == len(flags), (
            len(jaxpr.invars), len(args), len(flags))
        for v, a, f in zip(jaxpr.invars, args, flags):
            write(v, a, f)

        self._frames.append((jaxpr, env))
        try:
            return self._eval_eqns(jaxpr, env, fenv, read, write)
        finally:
            self._frames.pop()

    def _eval_eqns(self, jaxpr, env, fenv, read, write):
        table = self.table
        for eqn in jaxpr.eqns:
            invals, inflags = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
            invals, inflags = list(invals), list(inflags)
            prim = eqn.primitive
            if any(inflags) or prim in table.always:
                rule = table.rules.get(prim, table.default)
                if rule is None:
                    if not any(inflags):
                        outs, oflags = compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
                    else:
                        outs, oflags = self.unsupported(eqn, invals, inflags, "no rule names it")
                else:
                    # Casts a rule stages run in the equation's context (its mesh, compute
                    # type), like the equation itself.
                    with compat.eqn_ctx(eqn):
                        outs, oflags = rule(self, eqn, invals, inflags)
            else:
                outs, oflags = compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
            for v, o, f in zip(eqn.outvars, outs, oflags):
                write(v, o, f)
        outs = [read(v) for v in jaxpr.outvars]
        return [o for o, _ in outs], [f for _, f in outs]

    def eval_closed(self, closed, args, flags):
        jaxpr, consts = compat.jaxpr_and_consts(closed)
        return self.eval(jaxpr, consts, args, flags)

    # ---------------------------------------------------------------- flag analysis
    def flags(self, closed_or_jaxpr, in_flags: Sequence[bool]) -> list[bool]:
        """Which outputs of a jaxpr are promoted, given which inputs are (no tracing)."""
        jaxpr, _ = compat.jaxpr_and_consts(closed_or_jaxpr)
        key = (id(jaxpr), tuple(bool(f) for f in in_flags))
        hit = self._flag_cache.get(key)
        if hit is not None:
            return hit[1]
        fenv: dict = {}

        def read(v):
            return False if compat.is_literal(v) else fenv.get(v, False)

        for v, f in zip(jaxpr.invars, in_flags):
            fenv[v] = bool(f) and _is_float_aval(v.aval)
        for eqn in jaxpr.eqns:
            inflags = [read(v) for v in eqn.invars]
            if not any(inflags) and eqn.primitive not in self.table.always:
                continue
            frule = self.table.flag_rules.get(eqn.primitive)
            if frule is not None:
                oflags = frule(self, eqn, inflags)
            else:
                oflags = [any(inflags)] * len(eqn.outvars)
            for v, f in zip(eqn.outvars, oflags):
                if not compat.is_dropvar(v):
                    fenv[v] = bool(f) and _is_float_aval(v.aval)
        out = [read(v) for v in jaxpr.outvars]
        self._flag_cache[key] = (jaxpr, out)  # keep jaxpr alive so its id stays unique
        return out

    # ---------------------------------------------------------------- unsupported primitives
    def unsupported(self, eqn, invals, inflags, why: str):
        """A cotangent reaches `eqn`, which cannot run promoted (`why` says why): raises under
        ``Policy(unsupported='error')``, else runs it at its own dtype and warns (once per
        primitive and differentiated function). An
        effect-only equation (no outputs) just runs at its declared dtypes: no cotangent leaves
        it, so that changes no gradient."""
        name = eqn.primitive.name
        if not eqn.outvars:
            return self.fallback(eqn, invals, inflags)
        if self.policy.unsupported == "error":
            raise UnsupportedPrimitiveError(
                f"hifigrad cannot run the primitive '{name}' in {self.policy.tangent_dtype} "
                f"({why}), and a cotangent flows through it here. With the default "
                f"Policy(unsupported='fallback') it runs at its own dtype, with casts at its "
                f"edges; to run it promoted, register a rule with hifigrad.register_rule.")
        return self.fallback(eqn, invals, inflags, warn=why)

    def fallback(self, eqn, invals, inflags, warn: str | None = None):
        """Runs `eqn` at its declared dtypes: promoted inputs are cast back, outputs cast up.
        With `warn` (the reason), warns once per primitive and differentiated function."""
        name = eqn.primitive.name
        key = (name, _site.get())
        if warn and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"hifigrad: the primitive '{name}' cannot run in {self.policy.tangent_dtype} "
                f"({warn}); it runs at its own dtype with casts at its edges, so values through "
                f"it are rounded to that dtype. Register a rule with hifigrad.register_rule to "
                f"run it promoted, or pass Policy(unsupported='error') to make this an error.",
                PrecisionFallbackWarning, stacklevel=2)
        args = [self.cast_like(x, v.aval) if f else x
                for x, v, f in zip(invals, eqn.invars, inflags)]
        outs = compat.bind_eqn(eqn, args)
        flagged = any(inflags)
        outs = [self.cast_up(o, flagged=True) if flagged and _is_float_aval(v.aval) else o
                for o, v in zip(outs, eqn.outvars)]
        return outs, [flagged] * len(outs)
