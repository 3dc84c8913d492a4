"""The public transforms: `vjp`, `grad`, `value_and_grad`, `precise_backward`.

How a backward pass is run in tangent precision:

1. `jax.linearize` runs the forward exactly as written and returns the *linear* (JVP) program,
   whose leaves are the residuals the forward saved.
2. That program is re-traced to a jaxpr (residuals and tangents as explicit inputs) and evaluated
   by the promoting interpreter (`interpreter.py`, rules in `rules.py`): every tangent, and all
   that derives from it, is held in the promoted dtype; residuals keep their dtype and are
   up-cast (with a cast staged into the backward) where a tangent meets them.
3. `jax.linear_transpose` of the promoted program is the backward. JAX builds every cotangent
   accumulator from the promoted avals, so accumulators (a shared weight's gradient summed over
   scan steps, which JAX starts from a literal zero) are full precision too.

A user `custom_vjp` rule appears in the linear program as an opaque `custom_lin` equation that
JAX only calls when transposing, i.e. after promotion; its rule is traced at the dtypes JAX
declares and promoted in turn. That is what makes the seed pattern (a bwd that returns an f32
cotangent for a bf16 input, inside `lax.scan`) work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import Partial, tree_flatten, tree_unflatten

from . import compat
from .dtypes import check_primal_dtypes, is_real_float, promoted_dtype
from .interpreter import Interpreter, RuleTable
from .policy import Policy, resolve_policy
from .rules import PROMOTE

__all__ = ["vjp", "grad", "value_and_grad", "precise_backward"]


def _is_diff(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _dtype_of(x):
    return np.dtype(jnp.result_type(x))


def _coefficients_transform(fun, policy: Policy):
    if policy.coefficients == "forward":
        return fun
    from .coefficients import precise_coefficients

    return precise_coefficients(fun, policy)


def _vjp_flat(fun_flat: Callable, diff_vals: list, policy: Policy, has_aux: bool,
              table: RuleTable):
    """Linearizes `fun_flat(*diff_vals) -> list of outputs` and returns
    (outs, backward Partial, aux)."""
    fun_flat = _coefficients_transform(fun_flat, policy)
    if has_aux:
        outs, lin, aux = jax.linearize(fun_flat, *diff_vals, has_aux=True)
    else:
        (outs, lin), aux = jax.linearize(fun_flat, *diff_vals), None
    res, lin_tree = tree_flatten(lin)

    def lin_call(res, ts):
        return tree_unflatten(lin_tree, res)(*ts)

    tangent_avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)) for x in diff_vals]
    # Refs the program creates are discharged: `linear_transpose` cannot transpose them.
    lin_jaxpr, lin_consts, _ = compat.make_jaxpr_closed(lin_call, res, tangent_avals,
                                                        discharge_refs=True)
    static = _Static(lin_jaxpr=lin_jaxpr, n_res=len(res), n_consts=len(lin_consts),
                     tangent_avals=tangent_avals,
                     out_avals=[jax.ShapeDtypeStruct(np.shape(o), _dtype_of(o)) for o in outs],
                     policy=policy, table=table)
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
    in_up = [promoted_dtype(a.dtype, policy.tangent_dtype) for a in static.tangent_avals]
    # Integer and bool outputs have float0 tangents: no cotangent flows back from them, and
    # `linear_transpose` only takes float -> float functions, so they are left out.
    keep = [_is_diff(np.zeros((), a.dtype)) for a in static.out_avals]
    cts = [lax.convert_element_type(c, d) if is_real_float(d) else c
           for c, d, k in zip(cts, out_up, keep) if k]

    def lin_promoted(*ts):
        interp = Interpreter(policy, static.table)
        outs, flags = interp.eval(static.lin_jaxpr, consts, [*res, *ts],
                                  [False] * static.n_res + [True] * len(ts))
        return [lax.convert_element_type(o, d) if is_real_float(d) and
                np.dtype(o.dtype) != d else o for o, d, k in zip(outs, out_up, keep) if k]

    in_avals = [jax.ShapeDtypeStruct(a.shape, d) for a, d in zip(static.tangent_avals, in_up)]
    transposed = jax.linear_transpose(lin_promoted, *in_avals)
    if policy.resolved_matmul() == "fast":
        from .fast import fast_matmul

        transposed = fast_matmul(transposed, policy)
    out = transposed(list(cts))
    return list(out)


def _check_ct(ct_flat, out_avals, policy):
    for i, (c, a) in enumerate(zip(ct_flat, out_avals)):
        if np.shape(c) != tuple(a.shape):
            raise ValueError(
                f"cotangent {i} has shape {np.shape(c)}, but the output it pairs with has shape "
                f"{tuple(a.shape)}.")
        d = _dtype_of(c)
        allowed = {np.dtype(a.dtype), promoted_dtype(a.dtype, policy.tangent_dtype)}
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


def _vjp(fun, primals, has_aux, policy, table):
    flat, in_tree = tree_flatten(primals)
    check_primal_dtypes([_dtype_of(x) for x in flat], policy.tangent_dtype)
    diff = [_is_diff(x) for x in flat]
    diff_vals = [jnp.asarray(x) for x, d in zip(flat, diff) if d]
    out_tree_box: list = []

    def fun_flat(*dvals):
        it = iter(dvals)
        full = [next(it) if d else x for x, d in zip(flat, diff)]
        out = fun(*tree_unflatten(in_tree, full))
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("has_aux=True requires fun to return a pair (output, aux).")
            out, aux = out
        out_flat, out_tree = tree_flatten(out)
        out_tree_box.append(out_tree)
        out_flat = [jnp.asarray(o) for o in out_flat]
        return (out_flat, aux) if has_aux else out_flat

    outs, backward, aux = _vjp_flat(fun_flat, diff_vals, policy, has_aux, table)
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
    if isinstance(argnums, int):
        return (argnums,)
    if isinstance(argnums, (tuple, list)) and all(isinstance(a, int) for a in argnums):
        return tuple(argnums)
    raise TypeError(f"argnums must be an int or a tuple of ints; got {argnums!r}.")


def _check_grad_input(x, allow_int):
    dt = _dtype_of(x)
    if jnp.issubdtype(dt, jnp.inexact):
        return
    if allow_int and (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.bool_)):
        return
    raise TypeError(
        f"grad requires real- or complex-valued inputs (input dtype that is a sub-dtype of "
        f"np.inexact), but got {dt.name}. If you want to use Boolean- or integer-valued inputs, "
        f"use vjp or set allow_int to True.")


def value_and_grad(fun: Callable, argnums=0, has_aux: bool = False, *, tangent_dtype=None,
                   policy: Policy | None = None, allow_int: bool = False):
    """Like `jax.value_and_grad`, with the backward pass in ``tangent_dtype`` (default f32).

    The gradient of a float input has dtype ``promote_types(input dtype, tangent_dtype)``: float32
    gradients for bf16/fp16 parameters. The value is ``fun``'s own output, bitwise.

    Args:
      fun: the function to differentiate; it returns a real scalar (or ``(scalar, aux)``).
      argnums: an int or a tuple of ints: which positional arguments to differentiate.
      has_aux: whether ``fun`` returns ``(output, aux)``.
      tangent_dtype: the dtype cotangents are held in (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.
      allow_int: accept integer and bool inputs at ``argnums`` (their gradients are float0
        zeros), as in `jax.grad`.

    Returns:
      A function with ``fun``'s signature that returns ``(value, grads)``, or
      ``((value, aux), grads)`` with ``has_aux=True``; ``grads`` has the structure of the
      argument at ``argnums`` (a tuple of them for a tuple ``argnums``).

    Raises:
      TypeError: (when called) an input at ``argnums`` is not floating point (without
        ``allow_int``), ``fun``'s output is not a real scalar, or ``argnums`` is invalid.
      ValueError: ``tangent_dtype`` is less precise than a float input, or conflicts with
        ``policy.tangent_dtype``.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> v, g = hg.value_and_grad(lambda w: jnp.sum(w * w))(jnp.ones(2, jnp.bfloat16))
      >>> v.dtype, g.dtype
      (dtype(bfloat16), dtype('float32'))
    """
    policy = resolve_policy(policy, tangent_dtype)
    nums = _argnums_tuple(argnums)

    @functools.wraps(fun)
    def value_and_grad_f(*args, **kwargs):
        if max(nums) >= len(args):
            raise TypeError(
                f"differentiating with respect to argnums={argnums} requires at least "
                f"{max(nums) + 1} positional arguments to be passed by the caller, but got only "
                f"{len(args)} positional arguments.")
        dyn = [args[i] for i in nums]
        for leaf in jax.tree_util.tree_leaves(dyn):
            _check_grad_input(leaf, allow_int)

        def f_dyn(*dyn_args):
            full = list(args)
            for i, a in zip(nums, dyn_args):
                full[i] = a
            return fun(*full, **kwargs)

        res = _vjp(f_dyn, dyn, has_aux, policy, PROMOTE)
        out, vjp_fn = res[0], res[1]
        _check_scalar(out)
        # full_like, as jax.grad: the seed takes the output's varying manual axes (inside
        # shard_map) and sharding, which `linear_transpose` checks against.
        g = vjp_fn(lax.full_like(out, 1, promoted_dtype(_dtype_of(out), policy.tangent_dtype)))
        g = g[0] if isinstance(argnums, int) else tuple(g)
        return ((out, res[2]), g) if has_aux else (out, g)

    return value_and_grad_f


def _check_scalar(out):
    if not isinstance(out, (jax.Array, np.ndarray, np.generic, float, int)):
        raise TypeError(
            f"Gradient only defined for scalar-output functions. Output was {out!r}.")
    if np.shape(out) != ():
        raise TypeError(
            f"Gradient only defined for scalar-output functions. Output had shape: "
            f"{np.shape(out)}.")
    dt = _dtype_of(out)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {dt.name}.")


def grad(fun: Callable, argnums=0, has_aux: bool = False, *, tangent_dtype=None,
         policy: Policy | None = None, allow_int: bool = False):
    """Like `jax.grad`, with the backward pass in ``tangent_dtype`` (default float32).

    The forward is ``fun`` exactly as written; the gradient of a bf16 / fp16 / fp8 input is
    float32. Composes with `jax.jit`, `jax.vmap` and shardings like `jax.grad`.

    Args:
      fun: the function to differentiate; it returns a real scalar (or ``(scalar, aux)``).
      argnums: an int or a tuple of ints: which positional arguments to differentiate.
      has_aux: whether ``fun`` returns ``(output, aux)``.
      tangent_dtype: the dtype cotangents are held in (default float32).
      policy: a `hifigrad.Policy`; ``tangent_dtype`` may be given here instead.
      allow_int: accept integer and bool inputs at ``argnums``, as in `jax.grad`.

    Returns:
      A function with ``fun``'s signature that returns the gradient (``(grads, aux)`` with
      ``has_aux=True``), as `jax.grad` does.

    Raises:
      TypeError: (when called) an input at ``argnums`` is not floating point (without
        ``allow_int``), ``fun``'s output is not a real scalar, or ``argnums`` is invalid.
      ValueError: ``tangent_dtype`` is less precise than a float input, or conflicts with
        ``policy.tangent_dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> hg.grad(lambda w: jnp.sum(jnp.tanh(w)))(jnp.zeros(2, jnp.bfloat16))
      Array([1., 1.], dtype=float32)
      >>> jax.jit(hg.grad(lambda w, x: jnp.sum(x @ w), argnums=(0, 1)))(
      ...     jnp.ones((2, 2), jnp.bfloat16), jnp.ones((1, 2), jnp.bfloat16))[1].dtype
      dtype('float32')
    """
    vg = value_and_grad(fun, argnums, has_aux, tangent_dtype=tangent_dtype, policy=policy,
                        allow_int=allow_int)

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
        check_primal_dtypes([_dtype_of(x) for x in flat], policy.tangent_dtype)
        flat = [jnp.asarray(x) for x in flat]
        out_tree_box: list = []

        def fun_flat(*xs):
            out = fun(*tree_unflatten(in_tree, list(xs)))
            out_flat, out_tree = tree_flatten(out)
            out_tree_box.append(out_tree)
            return [jnp.asarray(o) for o in out_flat]

        # Values `fun` closes over (a caller's traced parameters) become explicit inputs, so
        # that an outer jax.grad differentiates with respect to them too.
        converted, consts = jax.closure_convert(fun_flat, *flat)
        out = _precise_call(converted, policy, tuple(flat), tuple(consts))
        return tree_unflatten(out_tree_box[-1], out)

    return wrapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _precise_call(fun_flat, policy, args, consts):
    return fun_flat(*args, *consts)


def _precise_fwd(fun_flat, policy, args, consts):
    return _vjp(lambda a, c: fun_flat(*a, *c), (args, consts), False, policy, PROMOTE)


def _precise_bwd(fun_flat, policy, vjp_fn, cts):
    del fun_flat, policy
    info: _VjpInfo = vjp_fn.func.args[0]
    cts_in = tree_flatten(vjp_fn(list(cts)))[0]
    # JAX requires each cotangent in its input's dtype at this boundary.
    cast = [lax.convert_element_type(c, a.dtype) if _is_diff(c) else c
            for c, a in zip(cts_in, info.in_avals)]
    args_ct, consts_ct = tree_unflatten(info.in_tree, cast)
    return tuple(args_ct), tuple(consts_ct)


_precise_call.defvjp(_precise_fwd, _precise_bwd)

