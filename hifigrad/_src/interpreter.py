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
with a fixpoint over the body (`Interpreter.flags`). A promoted `add` that closes a skip connection
(`skip_connection_adds`) passes through `materialize`, which keeps XLA:CPU from re-computing the
float32 cotangent of a residual stream in every block's fusions.
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
    version: int = 0  # bumped by `register`: cached backward programs key on it

    def register(self, prims, rule: Rule, flag_rule: FlagRule | None = None) -> None:
        self.version += 1
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


_ADD_NAMES = frozenset({"add", "add_any"})
_MATMUL_NAMES = frozenset({"dot_general", "conv_general_dilated"})
_SKIP_SEARCH_LIMIT = 20_000  # equations visited per candidate add, at most


def skip_connection_adds(jaxpr) -> frozenset:
    """Indices of the equations of `jaxpr` that close a skip connection: an `add` whose one
    operand is an ancestor of the other through a path holding a matmul (``x + f(x)`` with a
    `dot_general` or convolution in ``f``: a residual block). Found from the program's
    dataflow, not from names or shapes a model chooses."""
    eqns = jaxpr.eqns
    producer: dict = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            producer[v] = i
    found = []
    for i, e in enumerate(eqns):
        if e.primitive.name not in _ADD_NAMES or len(e.invars) != 2:
            continue
        a, b = e.invars
        if compat.is_literal(a) or compat.is_literal(b) or a is b:
            continue
        if _reaches_through_matmul(eqns, producer, a, b) or \
                _reaches_through_matmul(eqns, producer, b, a):
            found.append(i)
    return frozenset(found)


def _reaches_through_matmul(eqns, producer, anc, var) -> bool:
    """Whether `anc` is an ancestor of `var` and a matmul lies between them (a backward walk
    over `var`'s producers that stops at `anc`'s definition)."""
    start = producer.get(anc, -1)
    stack, seen, hit, matmul = [var], set(), False, False
    while stack and len(seen) < _SKIP_SEARCH_LIMIT:
        v = stack.pop()
        if v is anc:
            hit = True
            continue
        i = producer.get(v)
        if i is None or i <= start or i in seen:
            continue
        seen.add(i)
        e = eqns[i]
        matmul = matmul or e.primitive.name in _MATMUL_NAMES
        stack.extend(x for x in e.invars if not compat.is_literal(x))
    return hit and matmul


# Materializing costs one activation-sized buffer per skip connection (the opaque ones), and
# buys nothing unless the cotangent chain through the residual stream is long: XLA:CPU's
# duplication grows with the number of blocks the chain crosses in one program (quadratically),
# while one block (a pre-LN transformer block has two skip connections) at most doubles it. A
# scanned stack's body, or one recomputed block of a checkpoint, holds one block.
MIN_SKIP_CHAIN = 3


def _count_skips(jaxpr, adds_of=skip_connection_adds) -> int:
    """Skip connections closed in `jaxpr` and the jaxprs its equations hold (`adds_of`: how
    each jaxpr's are found, e.g. an interpreter's cached `skip_connection_adds`)."""
    n = len(adds_of(jaxpr))
    for eqn in jaxpr.eqns:
        for sub in compat.jaxprs_in_params(eqn.params):
            n += _count_skips(compat.jaxpr_and_consts(sub)[0], adds_of)
    return n


def _opaque_identity_cpu(x):
    # `x / 1` where XLA cannot see the 1 until after its algebraic simplifier has run (the
    # barrier is removed just before fusion): exact, and a float divide is an "expensive"
    # instruction that XLA:CPU's instruction fusion never duplicates into several consumers.
    one = lax.optimization_barrier(lax.full_like(x, 1))
    return x / one


def materialize(x):
    """`x` unchanged, in a form XLA:CPU computes once (see `skip_connection_adds`).

    XLA:CPU's instruction fusion (`CpuInstructionFusion`, pass "fusion") duplicates cheap
    elementwise producers (float32 add, multiply, negate, ...) into every consumer that can
    fuse them, and only refuses to duplicate "expensive" ones (a divide, an f32 -> bf16
    convert). A float32 cotangent flowing back through a residual stream is a chain of cheap
    ops from the loss to the first block, so each block's fusions re-compute it from the top:
    code size and compile time grow as N^2 in the number of blocks. A bf16 backward escapes
    by luck, through the expensive f32 -> bf16 rounding at every block. Other platforms get
    `x` as it is (through `lax.platform_dependent`), since their fusion heuristics differ.
    """
    if not _is_float_aval(x) or not isinstance(x, jax.core.Tracer):
        return x
    return _materialize_call(x)


# Jitted so that the platform cond is traced once per aval, not at every skip connection.
_materialize_call = jax.jit(
    lambda x: lax.platform_dependent(x, cpu=_opaque_identity_cpu, default=lambda y: y))


class Interpreter:
    """Evaluates jaxprs with promotion. One instance per transform call (it caches analyses)."""

    def __init__(self, policy: Policy, table: RuleTable):
        self.policy = policy
        self.table = table
        self._flag_cache: dict = {}
        self._up: dict = {}  # dtype -> its promoted dtype
        self._frames: list = []  # (jaxpr, env) of the jaxprs being evaluated, innermost last

    def current_jaxpr(self):
        """The innermost jaxpr being evaluated."""
        return self._frames[-1][0]

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
        hit = self._up.get(dtype)
        if hit is None:
            hit = self._up[dtype] = promoted_dtype(np.dtype(dtype), self.policy.tangent_dtype)
        return hit

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
        skips = self._skip_adds(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            invals, inflags = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
            invals, inflags = list(invals), list(inflags)
            if any(inflags) or eqn.primitive in table.always:
                outs, oflags = self.eval_eqn(eqn, invals, inflags)
            else:
                outs, oflags = compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
            if i in skips and all(inflags) and all(oflags):
                outs = [materialize(o) for o in outs]
            for v, o, f in zip(eqn.outvars, outs, oflags):
                write(v, o, f)
        outs = [read(v) for v in jaxpr.outvars]
        return [o for o, _ in outs], [f for _, f in outs]

    def eval_eqn(self, eqn, invals, inflags):
        """Evaluates one equation by its rule (`inflags` mark promoted inputs). Returns
        `(outs, out_flags)`."""
        rule = self.table.rules.get(eqn.primitive, self.table.default)
        if rule is None:
            if not any(inflags):
                return compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
            return self.unsupported(eqn, invals, inflags, "no rule names it")
        # Casts a rule stages run in the equation's context (its mesh, compute type), like the
        # equation itself.
        with compat.eqn_ctx(eqn):
            return rule(self, eqn, invals, inflags)

    def _skip_adds(self, jaxpr) -> frozenset:
        """`skip_connection_adds` of `jaxpr`, cached for this interpreter; none at all when
        the whole program (the outermost jaxpr evaluated, sub-jaxprs included) closes fewer
        than `MIN_SKIP_CHAIN` skip connections."""
        if "_chain" not in self.__dict__:  # the outermost program
            self._chain = _count_skips(jaxpr, self._skip_adds_of) >= MIN_SKIP_CHAIN
        return self._skip_adds_of(jaxpr) if self._chain else frozenset()

    def _skip_adds_of(self, jaxpr) -> frozenset:
        """`skip_connection_adds(jaxpr)`, computed once per jaxpr for this interpreter."""
        cache = self.__dict__.setdefault("_skip_cache", {})
        hit = cache.get(id(jaxpr))
        if hit is None:
            hit = cache[id(jaxpr)] = (jaxpr, skip_connection_adds(jaxpr))
        return hit[1]

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
