"""The public transforms: `vjp`, `grad`, `value_and_grad`, `precise_backward`.

How a backward pass is run in tangent precision:

1. `jax.linearize` runs the forward exactly as written and returns the *linear* (JVP) program,
   whose leaves are the residuals the forward saved.
2. That program (read from what `jax.linearize` returns, `compat.linearized_jaxpr`; re-traced
   when it cannot be) is promoted: every tangent, and all that derives from it, is held in the
   promoted dtype; residuals keep their dtype and are up-cast (with a cast staged into the
   backward) where a tangent meets them. `build.py` writes the promoted program as a jaxpr,
   running the interpreter (`interpreter.py`, rules in `rules.py`) on the equations it does
   not write itself; with ``_BUILD = False`` the interpreter's evaluation is traced instead.
3. The transpose of the promoted program is the backward (`compat.transpose_jaxpr`, what
   `jax.linear_transpose` runs, or `jax.linear_transpose` itself when a linear loop needs its
   partial evaluation first). JAX builds every cotangent accumulator from the promoted
   avals, so accumulators (a shared weight's gradient summed over scan steps, which JAX starts
   from a literal zero) are full precision too.

A user `custom_vjp` rule appears in the linear program as an opaque `custom_lin` equation that
JAX only calls when transposing, i.e. after promotion; its rule is traced at the dtypes JAX
declares and promoted in turn. That is what makes the seed pattern (a bwd that returns an f32
cotangent for a bf16 input, inside `lax.scan`) work.
"""

from __future__ import annotations

import collections
import functools
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import Partial, tree_flatten, tree_unflatten

from . import build, compat
from .dtypes import (
    check_primal_dtypes,
    check_tangent_dtype_enabled,
    is_extended,
    is_real_float,
    promoted_dtype,
)
from .interpreter import Interpreter, RuleTable, fallback_site, site_of
from .policy import Policy, active_policy, resolve_policy
from .rules import PROMOTE, PROMOTED_REGION

__all__ = ["vjp", "grad", "value_and_grad", "precise_backward"]


def _is_diff(x) -> bool:
    return _is_inexact(_dtype_of(x))


def _is_inexact(dtype) -> bool:
    """Float and complex dtypes: the ones that carry a tangent. Integers, bool, float0 and
    extended dtypes (typed PRNG keys) are passed through as non-differentiable values."""
    return not is_extended(dtype) and jnp.issubdtype(dtype, jnp.inexact)


def _dtype_of(x):
    dt = getattr(x, "dtype", None)
    if dt is not None and is_extended(dt):
        return dt  # a typed PRNG key: no NumPy dtype
    if isinstance(x, jax.Array):  # a JAX array's (or tracer's) dtype is canonical already
        return np.dtype(dt)
    return np.dtype(jnp.result_type(x))


def _forward_transform(fun, policy: Policy, has_aux: bool, traced: bool):
    """What `fun` becomes before it is linearized: with ``coefficients='tangent'``, re-traced
    with its elementwise ops' coefficients computed in the backward; under a trace (`traced`),
    its differentiated choosers pinned (`coefficients.pinned_choosers`: there XLA compiles the
    forward and the choosers' JVPs as one program)."""
    from .coefficients import pinned_choosers, precise_coefficients

    if policy.resolved_coefficients() != "forward":
        return precise_coefficients(fun, policy, has_aux, fallback=policy.coefficients == "auto")
    return pinned_choosers(fun, policy, has_aux) if traced else fun


def _vjp_flat(fun_flat: Callable, diff_vals: list, policy: Policy, has_aux: bool,
              table: RuleTable, site=None):
    """Linearizes `fun_flat(*diff_vals) -> list of outputs` and returns
    (outs, backward Partial, aux)."""
    traced = any(isinstance(x, jax.core.Tracer) for x in diff_vals)
    fun_flat = _forward_transform(fun_flat, policy, has_aux, traced)
    # Checkpoints made without a policy of their own take this one (`policy.INHERIT`).
    with active_policy(policy):
        if has_aux:
            outs, lin, aux = jax.linearize(fun_flat, *diff_vals, has_aux=True)
        else:
            (outs, lin), aux = jax.linearize(fun_flat, *diff_vals), None
    res, lin_tree = tree_flatten(lin)

    def lin_call(res, ts):
        return tree_unflatten(lin_tree, res)(*ts)

    tangent_avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)) for x in diff_vals]
    # The program `jax.linearize` built, read as it is; re-traced when it cannot be (refs the
    # program creates are then discharged: they cannot be transposed).
    lin_jaxpr, lin_consts = compat.linearized_jaxpr(lin, tangent_avals), []
    if lin_jaxpr is None:
        lin_jaxpr, lin_consts, _ = compat.make_jaxpr_closed(lin_call, res, tangent_avals,
                                                            discharge_refs=True)
    static = _Static(lin_jaxpr=lin_jaxpr, n_res=len(res), n_consts=len(lin_consts),
                     tangent_avals=tangent_avals,
                     out_avals=[jax.ShapeDtypeStruct(np.shape(o), _dtype_of(o)) for o in outs],
                     policy=policy, table=table, site=site)
    backward = Partial(functools.partial(_backward, static), [*lin_consts, *res])
    return outs, backward, aux


class _Static:
    """What the backward needs besides the residuals (held by identity in the vjp pytree)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _backward(static: _Static, res_and_consts: list, cts: list) -> list:
    policy = static.policy
    consts, res = res_and_consts[:static.n_consts], res_and_consts[static.n_consts:]
    out_up = [promoted_dtype(a.dtype, policy.tangent_dtype) for a in static.out_avals]
    # Integer and bool outputs have float0 tangents: no cotangent flows back from them, and
    # `linear_transpose` only takes float -> float functions, so they are left out.
    keep = [_is_inexact(a.dtype) for a in static.out_avals]
    cts = [lax.convert_element_type(c, d) if is_real_float(d) else c
           for c, d, k in zip(cts, out_up, keep) if k]
    # Fallback warnings name a primitive once per differentiated function (`static.site`);
    # a checkpoint first traced in the backward (inside a user's bwd) takes its policy.
    with fallback_site(getattr(static, "site", None)), active_policy(policy):
        if not any(isinstance(x, jax.core.Tracer) for x in [*res_and_consts, *cts]):
            # Eager: the backward program depends only on the linear program, the inputs'
            # avals and the policy, so it is traced once and replayed (`_backward_program`).
            closed = _backward_program(static, consts, res, cts)
            if closed is not None:
                return list(compat.eval_closed_jaxpr(closed, [*consts, *res, *cts]))
        return list(_transposed(static, consts, res)(list(cts)))


def _transposed(static: _Static, consts: list, res: list):
    """The backward: the transpose of the promoted linear program, as a function of the
    kept (float) output cotangents."""
    policy = static.policy
    out_up = [promoted_dtype(a.dtype, policy.tangent_dtype) for a in static.out_avals]
    in_up = [promoted_dtype(a.dtype, policy.tangent_dtype) for a in static.tangent_avals]
    keep = [_is_inexact(a.dtype) for a in static.out_avals]

    def promoted(consts, res, ts):
        interp = Interpreter(policy, static.table)
        outs, flags = interp.eval(static.lin_jaxpr, consts, [*res, *ts],
                                  [False] * static.n_res + [True] * len(ts))
        return [lax.convert_element_type(o, d) if is_real_float(d) and
                np.dtype(o.dtype) != d else o for o, d, k in zip(outs, out_up, keep) if k]

    in_avals = [jax.ShapeDtypeStruct(a.shape, d) for a, d in zip(static.tangent_avals, in_up)]
    known = [*consts, *res]
    if not _BUILD:  # the interpreter's evaluation, traced by `jax.linear_transpose`
        transposed = jax.linear_transpose(lambda *ts: promoted(consts, res, ts), *in_avals)
    else:
        # The promoted program, written as a jaxpr over (consts, residuals, tangents), is
        # transposed by JAX's backward pass directly: what `jax.linear_transpose` of it does,
        # less tracing it again. A linear loop, conditional or checkpoint in it needs the
        # partial evaluation that trace does first (their transpose rules take a body split
        # into its known and linear parts), so such a program goes through it.
        closed = build.promoted_jaxpr(Interpreter(policy, static.table), static.lin_jaxpr,
                                      static.n_res,
                                      [d if k else None for d, k in zip(out_up, keep)])
        if compat.transposable_as_is(closed, len(known)):
            def transposed(cts):
                return compat.transpose_jaxpr(closed, known, cts)
        else:
            transposed = jax.linear_transpose(
                lambda *ts: compat.eval_closed_jaxpr(closed, [*known, *ts]), *in_avals)
    if policy.resolved_matmul() == "fast":
        from .fast import fast_matmul

        return fast_matmul(transposed, policy)
    return transposed


# Whether `_transposed` writes the promoted program directly (`build.py`) and transposes it as
# a jaxpr, instead of tracing the interpreter's evaluation of it under `jax.linear_transpose`:
# the two give the same gradients (tests compare them).
_BUILD = True


# ------------------------------------------------------------------------------ program cache

class _Ident:
    """Compares by identity and holds its object alive, so that its id is never reused while a
    cache key holds it."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Ident) and other.obj is self.obj


def _param_key(v):
    """A hashable key equal for equal params: sub-jaxprs by structure, arrays by value, other
    unhashable or unknown objects by identity (a miss, never a wrong hit)."""
    if compat.is_jaxpr_like(v):
        return ("jaxpr", _jaxpr_key(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_param_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _param_key(x)) for k, x in v.items())))
    if isinstance(v, np.ndarray):
        return ("array", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (str, int, float, bool, complex, type(None), np.dtype, np.generic)):
        return (type(v).__name__, v)
    try:
        hash(v)
    except TypeError:
        return _Ident(v)
    # Hashable objects JAX puts in params (enums, named tuples of ints, GatherDimensionNumbers,
    # avals): by value when their type is one JAX defines, else by identity.
    mod = getattr(type(v), "__module__", "") or ""
    return (type(v), v) if mod.startswith(("jax", "numpy", "enum")) else _Ident(v)


def _jaxpr_key(j):
    jaxpr, consts = compat.jaxpr_and_consts(j)
    ids: dict = {}

    def var(v):
        if compat.is_literal(v):
            val = np.asarray(v.val)
            return ("lit", v.aval, val.dtype.str, val.tobytes())
        n = ids.get(v)
        if n is None:
            n = ids[v] = len(ids)
        return n

    parts = [tuple(_Ident(c) for c in consts),
             tuple((var(v), v.aval) for v in jaxpr.constvars),
             tuple((var(v), v.aval) for v in jaxpr.invars)]
    for e in jaxpr.eqns:
        parts.append((e.primitive, tuple(var(v) for v in e.invars),
                      tuple((var(v), v.aval) for v in e.outvars), _param_key(dict(e.params))))
    parts.append(tuple(var(v) for v in jaxpr.outvars))
    return tuple(parts)


def _aval_key(x):
    return (np.shape(x), _dtype_of(x), bool(getattr(getattr(x, "aval", None), "weak_type", False)),
            getattr(x, "sharding", None) if isinstance(x, jax.Array) else None)


# Traced eager backward programs, least recently used first; bounded.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_PROGRAMS_SIZE = 64


def _backward_program(static, consts, res, cts):
    """The backward of `static`'s linear program as a closed jaxpr over (consts, residuals,
    cotangents), from `_PROGRAMS` or traced now. Keyed by the linear program's structure (its
    equations, avals with weak types, literal values, params), the inputs' avals and
    shardings, the policy, the rule table and its version, and the differentiated function
    (`static.site`); None when the program cannot be keyed."""
    key = getattr(static, "_program_key", None)
    try:
        if key is None:
            key = static._program_key = (
                _jaxpr_key(static.lin_jaxpr), static.policy, _Ident(static.table),
                static.table.version, getattr(static, "site", None))
        full = (key, tuple(_aval_key(x) for x in [*consts, *res, *cts]))
        hash(full)
        closed = _PROGRAMS.get(full)
    except (TypeError, ValueError):  # a param whose == or hash is unusable: not cached
        return None
    if closed is not None:
        _PROGRAMS.move_to_end(full)
        return closed
    nc, nr = len(consts), len(res)

    def program(*args):
        c, r, k = args[:nc], args[nc:nc + nr], args[nc + nr:]
        return list(_transposed(static, list(c), list(r))(list(k)))

    closed = jax.make_jaxpr(program)(*consts, *res, *cts)
    _PROGRAMS[full] = closed
    if len(_PROGRAMS) > _PROGRAMS_SIZE:
        _PROGRAMS.popitem(last=False)
    return closed


def _check_ct(ct_flat, out_avals, policy):
    for i, (c, a) in enumerate(zip(ct_flat, out_avals)):
        if np.shape(c) != tuple(a.shape):
            raise ValueError(
                f"cotangent {i} has shape {np.shape(c)}, but the output it pairs with has shape "
                f"{tuple(a.shape)}.")
        d = _dtype_of(c)
        allowed = {a.dtype, promoted_dtype(a.dtype, policy.tangent_dtype)}
        if not is_real_float(a.dtype):
            allowed.add(np.dtype(jax.dtypes.float0))
        if d not in allowed and not (is_real_float(d) and is_real_float(a.dtype)):
            raise TypeError(
                f"cotangent {i} has dtype {d}, but the output it pairs with has dtype {a.dtype}; "
                f"pass a cotangent of dtype {a.dtype} or "
                f"{promoted_dtype(a.dtype, policy.tangent_dtype)}.")


def vjp(fun: Callable, *primals, has_aux: bool = False, tangent_dtype=None,
        policy: Policy | None = None):
    """Like `jax.vjp`, but the backward pass runs in ``tangent_dtype`` (default float32).

    The forward is `fun` exactly as written (its outputs are bitwise those of ``fun``). The
    returned ``vjp_fn`` accepts cotangents in each output's dtype or in its promoted dtype, and
    returns, for each float input, a cotangent of dtype ``promote_types(input, tangent_dtype)``;
    integer and bool inputs get float0 zeros, as with `jax.vjp`.

    Args:
      fun: the function to differentiate.
      *primals: its arguments (pytrees of arrays).
      has_aux: whether ``fun`` returns ``(output, aux)``.
      tangent_dtype: the dtype cotangents are held in (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.

    Returns:
      ``(out, vjp_fn)`` or ``(out, vjp_fn, aux)``. ``vjp_fn`` is a pytree of residuals (it can
      be returned from `jax.jit`).

    Raises:
      ValueError: ``tangent_dtype`` is less precise than a float primal, or conflicts with
        ``policy.tangent_dtype``.
      TypeError: ``has_aux=True`` but ``fun`` does not return a pair; ``vjp_fn`` gets a
        cotangent whose tree structure or dtype does not match the output's.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> y, f_vjp = hg.vjp(lambda x: (x * x).sum(), jnp.ones(3, jnp.bfloat16))
      >>> y.dtype, f_vjp(jnp.float32(1.0))[0].dtype
      (dtype(bfloat16), dtype('float32'))
    """
    policy = resolve_policy(policy, tangent_dtype)
    return _vjp(fun, primals, has_aux, policy, PROMOTE)


def _vjp(fun, primals, has_aux, policy, table, site=None):
    flat, in_tree = tree_flatten(primals)
    for x in flat:
        _check_arg(x)
    check_tangent_dtype_enabled(policy.tangent_dtype)
    check_primal_dtypes([_dtype_of(x) for x in flat], policy.tangent_dtype)
    diff = [_is_diff(x) for x in flat]
    diff_vals = [jnp.asarray(x) for x, d in zip(flat, diff) if d]
    out_tree_box: list = []

    def fun_flat(*dvals):
        it = iter(dvals)
        full = [next(it) if d else x for x, d in zip(flat, diff)]
        out = fun(*tree_unflatten(in_tree, full))
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"expected function with aux output to return a two-element tuple, but got "
                    f"type {type(out)}: has_aux=True requires fun to return a pair "
                    f"(output, aux).")
            out, aux = out
        out_flat, out_tree = tree_flatten(out)
        out_tree_box.append(out_tree)
        out_flat = [jnp.asarray(o) for o in out_flat]
        return (out_flat, aux) if has_aux else out_flat

    outs, backward, aux = _vjp_flat(fun_flat, diff_vals, policy, has_aux, table,
                                    site_of(fun) if site is None else site)
    out_tree = out_tree_box[-1]
    in_avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)) for x in flat]
    out_avals = [jax.ShapeDtypeStruct(np.shape(o), _dtype_of(o)) for o in outs]
    vjp_fn = Partial(functools.partial(_vjp_apply, _VjpInfo(
        in_tree=in_tree, out_tree=out_tree, diff=diff, in_avals=in_avals, out_avals=out_avals,
        policy=policy)), backward)
    out = tree_unflatten(out_tree, outs)
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


class _VjpInfo(_Static):
    pass


def _vjp_apply(info: _VjpInfo, backward, ct):
    ct_flat, ct_tree = tree_flatten(ct)
    if ct_tree != info.out_tree:
        raise TypeError(
            f"The cotangent's tree structure {ct_tree} does not match the output's "
            f"{info.out_tree}.")
    _check_ct(ct_flat, info.out_avals, info.policy)
    cts_in = backward(ct_flat)
    it = iter(cts_in)
    full = [next(it) if d else np.zeros(a.shape, jax.dtypes.float0)
            for d, a in zip(info.diff, info.in_avals)]
    return tree_unflatten(info.in_tree, full)


# ------------------------------------------------------------------------------ grad

def _argnums_tuple(argnums) -> tuple[int, ...]:
    """``argnums`` as `jax.grad` accepts it: an int (Python, NumPy or bool, as
    `operator.index` takes it) or a sequence of them. Positions are checked at call time."""
    try:
        return (operator.index(argnums),)
    except TypeError:
        pass
    if isinstance(argnums, (tuple, list)):
        try:
            return tuple(operator.index(a) for a in argnums)
        except TypeError:
            pass
    raise TypeError(
        f"argnums must be an int or a sequence of ints (which positional arguments to "
        f"differentiate); got {argnums!r} of type {type(argnums).__name__}.")


def _resolve_argnums(argnums, nums: tuple[int, ...], n_args: int) -> tuple[int, ...]:
    """The positions ``nums`` names among ``n_args`` positional arguments, negative ones counted
    from the end; raises what `jax.grad` raises for an empty, out-of-range or repeated one."""
    if not nums:
        raise ValueError(
            f"argnums={argnums!r} selects no argument to differentiate: pass at least one "
            f"position, for example argnums=0.")
    # Checked in jax.grad's order: too few positional arguments first, then negative range.
    if max(nums) >= n_args:
        raise TypeError(
            f"differentiating with respect to argnums={argnums!r} requires at least "
            f"{max(nums) + 1} positional arguments to be passed by the caller, but got only "
            f"{n_args} positional arguments.")
    for i in nums:
        if i < -n_args:
            raise ValueError(
                f"argnums={argnums!r}: position {i} is out of range for {n_args} positional "
                f"arguments; positions must be >= -{n_args} (counting from the end) and < "
                f"{n_args}.")
    pos = tuple(i % n_args for i in nums)
    for j, p in enumerate(pos):
        if p in pos[:j]:
            raise TypeError(
                f"argnums={argnums!r} names positional argument {p} more than once: each "
                f"argument can be differentiated once (jax.grad rejects this too). To get its "
                f"gradient twice, differentiate it once and reuse the result.")
    return pos


def _check_arg(x) -> None:
    """Raises `jax.grad`'s TypeError for a leaf that is not an array or a scalar."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) or hasattr(
            x, "__jax_array__"):
        return
    raise TypeError(
        f"Argument {x!r} of type {type(x)} is not a valid JAX type: every leaf of a "
        f"differentiated argument must be an array or a scalar. Pass other values outside the "
        f"differentiated arguments (close over them, or put them in an argument not in "
        f"argnums), or make them static pytree metadata.")


def _check_grad_input(x, allow_int, holomorphic=False):
    """`jax.grad`'s check of one differentiated input leaf (same types and messages)."""
    _check_arg(x)
    dt = _dtype_of(x)
    if holomorphic and not (not is_extended(dt) and jnp.issubdtype(dt, jnp.complexfloating)):
        raise TypeError(
            f"grad with holomorphic=True requires inputs with complex dtype, but got {dt.name}.")
    if is_extended(dt) or jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.bool_):
        if not allow_int:
            raise TypeError(
                f"grad requires real- or complex-valued inputs (input dtype that is a sub-dtype "
                f"of np.inexact), but got {dt.name}. If you want to use Boolean- or "
                f"integer-valued inputs, use vjp or set allow_int to True.")
    elif not jnp.issubdtype(dt, jnp.inexact):
        raise TypeError(
            f"grad requires numerical-valued inputs (input dtype that is a sub-dtype of np.bool_ "
            f"or np.number), but got {dt.name}: float0 values (the tangents of integers) cannot "
            f"be differentiated; pass them outside argnums.")


def value_and_grad(fun: Callable, argnums=0, has_aux: bool = False, *, tangent_dtype=None,
                   policy: Policy | None = None, allow_int: bool = False,
                   holomorphic: bool = False):
    """Like `jax.value_and_grad`, with the backward pass in ``tangent_dtype`` (default f32).

    The gradient of a float input has dtype ``promote_types(input dtype, tangent_dtype)``: float32
    gradients for bf16/fp16 parameters. The value is ``fun``'s own output, bitwise.

    Args:
      fun: the function to differentiate; it returns a real scalar (or ``(scalar, aux)``).
      argnums: an int or a tuple of ints: which positional arguments to differentiate.
      has_aux: whether ``fun`` returns ``(output, aux)``.
      tangent_dtype: the dtype cotangents are held in (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.
      allow_int: accept integer, bool and typed PRNG key inputs at ``argnums`` (their
        gradients are float0 zeros), as in `jax.grad`.
      holomorphic: ``fun`` is holomorphic: complex inputs and a complex output, as in
        `jax.grad` (complex values are not promoted).

    Returns:
      A function with ``fun``'s signature that returns ``(value, grads)``, or
      ``((value, aux), grads)`` with ``has_aux=True``; ``grads`` has the structure of the
      argument at ``argnums`` (a tuple of them for a tuple ``argnums``).

    Raises:
      TypeError: ``fun`` is not callable; ``argnums`` is not an int or a sequence of ints;
        (when called) an input at ``argnums`` is not floating point (without ``allow_int``),
        ``fun``'s output is not a real scalar, or ``argnums`` names a missing or repeated
        position — the errors `jax.grad` raises.
      ValueError: ``tangent_dtype`` is less precise than a float input, conflicts with
        ``policy.tangent_dtype``, or is float64 with JAX's 64-bit mode off; (when called)
        ``argnums`` is empty or a negative position is out of range.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> v, g = hg.value_and_grad(lambda w: jnp.sum(w * w))(jnp.ones(2, jnp.bfloat16))
      >>> v.dtype, g.dtype
      (dtype(bfloat16), dtype('float32'))
    """
    if not callable(fun):
        raise TypeError(f"Expected a callable value, got {fun!r}")
    policy = resolve_policy(policy, tangent_dtype)
    nums_given = _argnums_tuple(argnums)

    @functools.wraps(fun)
    def value_and_grad_f(*args, **kwargs):
        nums = _resolve_argnums(argnums, nums_given, len(args))
        dyn = [args[i] for i in nums]
        for leaf in jax.tree_util.tree_leaves(dyn):
            _check_grad_input(leaf, allow_int, holomorphic)

        def f_dyn(*dyn_args):
            full = list(args)
            for i, a in zip(nums, dyn_args):
                full[i] = a
            return fun(*full, **kwargs)

        res = _vjp(f_dyn, dyn, has_aux, policy, PROMOTE, site=site_of(fun))
        out, vjp_fn = res[0], res[1]
        _check_scalar(out, holomorphic)
        # full_like, as jax.grad: the seed takes the output's varying manual axes (inside
        # shard_map) and sharding, which `linear_transpose` checks against.
        g = vjp_fn(lax.full_like(out, 1, promoted_dtype(_dtype_of(out), policy.tangent_dtype)))
        g = tuple(g) if isinstance(argnums, (tuple, list)) else g[0]
        return ((out, res[2]), g) if has_aux else (out, g)

    return value_and_grad_f


def _check_scalar(out, holomorphic=False):
    if not isinstance(out, (jax.Array, np.ndarray, np.generic, float, int)):
        raise TypeError(
            f"Gradient only defined for scalar-output functions. Output was {out!r}.")
    if np.shape(out) != ():
        raise TypeError(
            f"Gradient only defined for scalar-output functions. Output had shape: "
            f"{np.shape(out)}.")
    dt = _dtype_of(out)
    if is_extended(dt):
        raise TypeError(f"grad with output element type {dt.name}")
    if holomorphic:
        if not jnp.issubdtype(dt, jnp.complexfloating):
            raise TypeError(
                f"grad with holomorphic=True requires outputs with complex dtype, but got "
                f"{dt.name}.")
    elif jnp.issubdtype(dt, jnp.complexfloating):
        raise TypeError(
            f"grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {dt.name}. For holomorphic differentiation, pass "
            f"holomorphic=True. For differentiation of non-holomorphic functions involving "
            f"complex outputs, use jax.vjp directly.")
    elif not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {dt.name}. For differentiation of functions with integer "
            f"outputs, use jax.vjp directly.")


def grad(fun: Callable, argnums=0, has_aux: bool = False, *, tangent_dtype=None,
         policy: Policy | None = None, allow_int: bool = False, holomorphic: bool = False):
    """Like `jax.grad`, with the backward pass in ``tangent_dtype`` (default float32).

    The forward is ``fun`` exactly as written; the gradient of a bf16 / fp16 / fp8 input is
    float32. Composes with `jax.jit`, `jax.vmap` and shardings like `jax.grad`.

    Args:
      fun: the function to differentiate; it returns a real scalar (or ``(scalar, aux)``).
      argnums: an int or a tuple of ints: which positional arguments to differentiate.
      has_aux: whether ``fun`` returns ``(output, aux)``.
      tangent_dtype: the dtype cotangents are held in (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.
      allow_int: accept integer, bool and typed PRNG key inputs at ``argnums``, as in
        `jax.grad`.
      holomorphic: ``fun`` is holomorphic (complex inputs and output), as in `jax.grad`.

    Returns:
      A function with ``fun``'s signature that returns the gradient (``(grads, aux)`` with
      ``has_aux=True``), as `jax.grad` does.

    Raises:
      TypeError: ``fun`` is not callable, or ``argnums`` is invalid (as in `jax.grad`:
        see `value_and_grad`); (when called) an input at ``argnums`` is not floating point
        (without ``allow_int``) or ``fun``'s output is not a real scalar.
      ValueError: ``tangent_dtype`` is less precise than a float input, conflicts with
        ``policy.tangent_dtype``, or is float64 with JAX's 64-bit mode off; (when called)
        ``argnums`` is empty or out of range.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> hg.grad(lambda w: jnp.sum(jnp.tanh(w)))(jnp.zeros(2, jnp.bfloat16))
      Array([1., 1.], dtype=float32)
      >>> jax.jit(hg.grad(lambda w, x: jnp.sum(x @ w), argnums=(0, 1)))(
      ...     jnp.ones((2, 2), jnp.bfloat16), jnp.ones((1, 2), jnp.bfloat16))[1].dtype
      dtype('float32')
    """
    vg = value_and_grad(fun, argnums, has_aux, tangent_dtype=tangent_dtype, policy=policy,
                        allow_int=allow_int, holomorphic=holomorphic)

    @functools.wraps(fun)
    def grad_f(*args, **kwargs):
        (_, aux), g = vg(*args, **kwargs) if has_aux else ((None, None), vg(*args, **kwargs)[1])
        return (g, aux) if has_aux else g

    return grad_f


# ------------------------------------------------------------------------------ precise_backward

def precise_backward(fun: Callable, *, tangent_dtype=None, policy: Policy | None = None):
    """Wraps `fun` so that, under any outer `jax.grad`/`jax.vjp`, its backward runs in
    ``tangent_dtype``.

    The forward is `fun` unchanged. At the wrapper's boundary each input cotangent is cast to its
    input's dtype, as JAX requires; inside, everything is full precision. To make the boundary
    lossless, keep master parameters in float32 and cast them to bf16 *inside* the wrapped
    function: the parameters' cotangents then leave in float32.

    Values ``fun`` closes over (a caller's traced parameters) are differentiated too. The
    wrapper is a `jax.custom_vjp`: forward-mode differentiation (`jax.jvp`) through it is not
    supported.

    Args:
      fun: the function whose backward runs in ``tangent_dtype``; it takes and returns pytrees
        of arrays.
      tangent_dtype: the dtype cotangents are held in inside (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.

    Returns:
      A function with ``fun``'s signature and outputs.

    Raises:
      ValueError: (when called) ``tangent_dtype`` is less precise than a float input, or
        conflicts with ``policy.tangent_dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> def layer(w32, x):          # f32 master weights, bf16 compute
      ...     return jnp.tanh(x @ w32.astype(jnp.bfloat16)).sum()
      >>> f = hg.precise_backward(layer)
      >>> jax.grad(f)(jnp.ones((2, 2)), jnp.ones((1, 2), jnp.bfloat16)).dtype
      dtype('float32')
    """
    policy = resolve_policy(policy, tangent_dtype)

    @functools.wraps(fun)
    def wrapped(*args):
        flat, in_tree = tree_flatten(args)
        for x in flat:
            _check_arg(x)
        check_tangent_dtype_enabled(policy.tangent_dtype)
        check_primal_dtypes([_dtype_of(x) for x in flat], policy.tangent_dtype)
        flat = [jnp.asarray(x) for x in flat]
        out_tree_box: list = []

        def fun_flat(*xs):
            out = fun(*tree_unflatten(in_tree, list(xs)))
            out_flat, out_tree = tree_flatten(out)
            out_tree_box.append(out_tree)
            return [jnp.asarray(o) for o in out_flat]

        # Eagerly (under differentiation only), `fun` itself runs, unless it closes over a
        # value an enclosing transformation is differentiating: that value meets the eager
        # forward as a tracer of another trace, and JAX raises UnexpectedTracerError (or
        # `_precise_fwd` finds it among its outputs and residuals). Then, and whenever
        # anything is staged or batched, the values `fun` closes
        # over (a caller's traced parameters) become explicit inputs (`jax.closure_convert`),
        # so that the outer transformation differentiates them too. (Converting every eager
        # call would replay `fun`'s traced program op by op, at about twice the cost.)
        site = site_of(fun)
        out = None
        if compat.eager_under_differentiation():
            try:
                out = _precise_call(fun_flat, (policy, site, True), tuple(flat), ())
            except (jax.errors.UnexpectedTracerError, _NeedsConversion):
                out = None
        if out is None:
            converted, consts = jax.closure_convert(fun_flat, *flat)
            out = _precise_call(converted, (policy, site, False), tuple(flat), tuple(consts))
        return tree_unflatten(out_tree_box[-1], out)

    return wrapped


# ------------------------------------------------------------------------------ own backwards

def promoted_region(backward: Callable, cts, policy: Policy):
    """``backward(cts)``, for a backward hifigrad built itself in ``policy``'s tangent dtype (a
    compressed checkpoint's, a `precise_backward`'s), with each float cotangent up-cast first.

    Under a trace it is staged as a call named `PROMOTED_REGION`: an enclosing hifigrad
    transform, which traces this custom rule at its declared (low-precision) dtypes and then
    promotes what it traced (`rules.custom_lin_rule`), re-binds such a call as it is
    (`rules.inline_rule`). Promoting it again would undo what the backward chose on purpose
    (``Policy(matmul='fast')`` rounds a cotangent to bf16 for a bf16 x bf16 matmul: promoted,
    that is a float32 matmul again)."""
    flat, tree = tree_flatten(cts)
    up = [lax.convert_element_type(c, promoted_dtype(c.dtype, policy.tangent_dtype))
          if is_real_float(_dtype_of(c)) else c for c in flat]
    if not any(isinstance(c, jax.core.Tracer) for c in up):
        return backward(tree_unflatten(tree, up))

    def hifigrad_promoted_backward(up):
        return backward(tree_unflatten(tree, up))

    assert hifigrad_promoted_backward.__name__ == PROMOTED_REGION
    return jax.jit(hifigrad_promoted_backward)(up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _precise_call(fun_flat, policy_site, args, consts):
    return fun_flat(*args, *consts)


class _NeedsConversion(Exception):
    """`precise_backward`'s unconverted forward cannot show that its function closes over no
    differentiated value: the wrapper converts the function's closure and runs again."""


def _precise_fwd(fun_flat, policy_site, args, consts):
    policy, site, verify = policy_site
    # Only an eager forward shows a closed-over tracer (as an error or an escaped value); a
    # traced one could capture it as a constant.
    if verify and not compat.tracing_eagerly():
        raise _NeedsConversion
    out, vjp_fn = _vjp(lambda a, c: fun_flat(*a, *c), (args, consts), False, policy, PROMOTE,
                       site=site)
    if verify and compat.foreign_tracer(jax.tree_util.tree_leaves((out, vjp_fn))) is not None:
        raise _NeedsConversion
    return out, vjp_fn


def _precise_bwd(fun_flat, policy_site, vjp_fn, cts):
    del fun_flat
    info: _VjpInfo = vjp_fn.func.args[0]
    cts_in = tree_flatten(promoted_region(lambda c: vjp_fn(list(c)), list(cts),
                                          policy_site[0]))[0]
    # JAX requires each cotangent in its input's dtype at this boundary.
    cast = [lax.convert_element_type(c, a.dtype) if _is_diff(c) else c
            for c, a in zip(cts_in, info.in_avals)]
    args_ct, consts_ct = tree_unflatten(info.in_tree, cast)
    return tuple(args_ct), tuple(consts_ct)


_precise_call.defvjp(_precise_fwd, _precise_bwd)

