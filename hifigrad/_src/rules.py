"""Promotion rules, keyed by primitive: the one registry of hifigrad's transform.

`PROMOTE` is the table the backward transform uses. Families of dtype-polymorphic primitives share
`promote_rule` (promoted inputs, residual operands up-cast, float dtype params such as
`preferred_element_type` promoted too); control flow, custom rules and callbacks have rules of
their own. A primitive absent from the table that a cotangent reaches raises
`UnsupportedPrimitiveError` (or, with ``Policy(unsupported='fallback')``, runs at its own dtype).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from . import compat
from .dtypes import is_real_float
from .interpreter import Interpreter, RuleTable
from .primitives import upcast_p

__all__ = ["PROMOTE", "promote_rule", "register_rule"]

_DTYPE_PARAMS = ("preferred_element_type", "out_dtype", "new_dtype", "dtype")


def _promote_params(interp: Interpreter, params: dict) -> dict:
    new = None
    for k in _DTYPE_PARAMS:
        v = params.get(k)
        if v is None:
            continue
        try:
            dt = np.dtype(v)
        except TypeError:
            continue
        up = interp.up(dt)
        if up != dt:
            new = dict(params) if new is None else new
            new[k] = up
    return params if new is None else new


def promote_rule(interp: Interpreter, eqn, invals, inflags):
    """For dtype-polymorphic primitives: every float input (promoted or residual) is brought to
    its promoted dtype, float dtype params likewise, and the primitive is bound."""
    args = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(invals, inflags)]
    outs = compat.bind_eqn(eqn, args, _promote_params(interp, eqn.params))
    return outs, [True] * len(outs)


def _floating(x) -> bool:
    dt = getattr(x, "dtype", None)
    if dt is None:
        dt = np.result_type(x)
    return jax.numpy.issubdtype(dt, jax.numpy.floating)


def convert_rule(interp: Interpreter, eqn, invals, inflags):
    (x,), new_dtype = invals, np.dtype(eqn.params["new_dtype"])
    if not jax.numpy.issubdtype(new_dtype, jax.numpy.floating):
        return compat.bind_eqn(eqn, [x]), [False]
    target = interp.up(new_dtype)
    if np.dtype(x.dtype) == target:
        return [x], [True]  # a down-cast (or round trip) of a cotangent: kept in full precision
    params = dict(eqn.params, new_dtype=target, weak_type=False)
    return compat.bind_eqn(eqn, [x], params), [True]


# ------------------------------------------------------------------------------ control flow

def _cast_to_flags(interp, vals, have, want):
    """Casts values that must be promoted (want) but are not (have) up to the promoted dtype."""
    return [interp.cast_up(v, True) if w and not h and _floating(v) else v
            for v, h, w in zip(vals, have, want)]


def _loop_fixpoint(interp, body, const_flags, carry_flags, xs_flags, num_carry):
    carry = list(carry_flags)
    while True:
        out = interp.flags(body, [*const_flags, *carry, *xs_flags])
        new = [a or b for a, b in zip(carry, out[:num_carry])]
        if new == carry:
            return carry, out[num_carry:]
        carry = new


def scan_flags(interp, eqn, inflags):
    nc, nk = compat.scan_split(eqn)
    carry, ys = _loop_fixpoint(interp, eqn.params["jaxpr"], inflags[:nc], inflags[nc:nc + nk],
                               inflags[nc + nk:], nk)
    return carry + ys


def scan_rule(interp: Interpreter, eqn, invals, inflags):
    nc, nk = compat.scan_split(eqn)
    body = eqn.params["jaxpr"]
    const_f, init_f, xs_f = inflags[:nc], inflags[nc:nc + nk], inflags[nc + nk:]
    carry_f, ys_f = _loop_fixpoint(interp, body, const_f, init_f, xs_f, nk)
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    init = _cast_to_flags(interp, init, init_f, carry_f)

    def step(carry, x):
        outs, oflags = interp.eval_closed(body, [*consts, *carry, *(x or ())],
                                          [*const_f, *carry_f, *xs_f])
        new_carry = _cast_to_flags(interp, outs[:nk], oflags[:nk], carry_f)
        ys = _cast_to_flags(interp, outs[nk:], oflags[nk:], ys_f)
        return new_carry, ys

    with compat.eqn_context(eqn):
        carry, ys = lax.scan(step, init, xs if xs else None, length=eqn.params["length"],
                             reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
    return [*carry, *ys], [*carry_f, *ys_f]


def while_flags(interp, eqn, inflags):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body_cf, init_f = inflags[cn:cn + bn], inflags[cn + bn:]
    carry, _ = _loop_fixpoint(interp, eqn.params["body_jaxpr"], body_cf, init_f, [], len(init_f))
    return carry


def while_rule(interp: Interpreter, eqn, invals, inflags):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    ccf, bcf, init_f = inflags[:cn], inflags[cn:cn + bn], inflags[cn + bn:]
    carry_f = while_flags(interp, eqn, inflags)
    init = _cast_to_flags(interp, init, init_f, carry_f)

    def cond_fun(carry):
        (pred,), _ = interp.eval_closed(eqn.params["cond_jaxpr"], [*cconsts, *carry],
                                        [*ccf, *carry_f])
        return pred

    def body_fun(carry):
        outs, oflags = interp.eval_closed(eqn.params["body_jaxpr"], [*bconsts, *carry],
                                          [*bcf, *carry_f])
        return _cast_to_flags(interp, outs, oflags, carry_f)

    with compat.eqn_context(eqn):
        out = lax.while_loop(cond_fun, body_fun, list(init))
    return list(out), carry_f


def cond_flags(interp, eqn, inflags):
    outs = [interp.flags(br, inflags[1:]) for br in eqn.params["branches"]]
    return [any(fs) for fs in zip(*outs)]


def cond_rule(interp: Interpreter, eqn, invals, inflags):
    index, ops, op_f = invals[0], invals[1:], inflags[1:]
    out_f = cond_flags(interp, eqn, inflags)

    def make_branch(br):
        def branch(*args):
            outs, oflags = interp.eval_closed(br, list(args), op_f)
            return _cast_to_flags(interp, outs, oflags, out_f)
        return branch

    with compat.eqn_context(eqn):
        outs = lax.switch(index, [make_branch(b) for b in eqn.params["branches"]], *ops)
    return list(outs), out_f


def _call_jaxpr_param(eqn):
    for k in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if k in eqn.params:
            return eqn.params[k]
    raise KeyError(eqn.primitive.name)


def call_flags(interp, eqn, inflags):
    j = _call_jaxpr_param(eqn)
    n = len(compat.jaxpr_and_consts(j)[0].invars)
    return interp.flags(j, inflags[len(inflags) - n:])


def inline_rule(interp: Interpreter, eqn, invals, inflags):
    """Call-like primitives (jit, custom_jvp_call, custom_vjp_call in a backward): inlined. A
    custom rule is not needed inside a backward program, which is differentiated no further by
    hifigrad; jit boundaries are kept as a named scope."""
    j = _call_jaxpr_param(eqn)
    n = len(compat.jaxpr_and_consts(j)[0].invars)
    name = eqn.params.get("name", eqn.primitive.name)
    with compat.eqn_context(eqn), jax.named_scope(str(name)):
        return interp.eval_closed(j, invals[len(invals) - n:], inflags[len(inflags) - n:])


def remat_rule(interp: Interpreter, eqn, invals, inflags):
    j = eqn.params["jaxpr"]
    out_f = interp.flags(j, inflags)

    def body(*args):
        outs, oflags = interp.eval_closed(j, list(args), inflags)
        return _cast_to_flags(interp, outs, oflags, out_f)

    fn = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                        policy=eqn.params.get("policy"))
    with compat.eqn_context(eqn):
        outs = fn(*invals)
    return list(outs), out_f


def shard_map_rule(interp: Interpreter, eqn, invals, inflags):
    j = eqn.params["jaxpr"]
    out_f = interp.flags(j, inflags)

    def body(*args):
        outs, oflags = interp.eval_closed(j, list(args), inflags)
        return tuple(_cast_to_flags(interp, outs, oflags, out_f))

    with compat.eqn_context(eqn):
        outs = compat.shard_map_call(body, eqn.params, invals)
    return outs, out_f


def _up_float(interp: Interpreter):
    """dtype -> its promoted dtype for real floats, itself otherwise (float0, ints)."""
    return lambda d: interp.up(d) if is_real_float(d) else np.dtype(d)


def custom_lin_rule(interp: Interpreter, eqn, invals, inflags):
    """A user `custom_vjp` backward. Its rule is traced at the dtypes JAX declares (cotangent in
    the primal's dtype), which keeps the user's code type-correct, then promoted: the cotangent
    and all that derives from it, including an up-cast the user returns, run in full precision."""
    params = eqn.params
    num_res = params["num_res"]
    res, lin = invals[:num_res], invals[num_res:]
    old_bwd, out_avals = params["bwd"], list(params["out_avals"])
    new_out_avals = [a.update(dtype=interp.up(a.dtype), weak_type=False)
                     if _floating_aval(a) else a for a in out_avals]

    def new_bwd(*args):
        r = args[:num_res]
        cts = [compat.dense_cotangent(c, _up_float(interp)) for c in args[num_res:]]

        def traced(r, cts_lo):
            return compat.custom_lin_call_bwd(old_bwd, r, cts_lo)

        ct_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
        jaxpr, consts, _ = compat.make_jaxpr_closed(traced, list(r), ct_avals)
        outs, oflags = interp.eval(jaxpr, consts, [*r, *cts],
                                   [False] * num_res + [True] * len(cts))
        # Each input cotangent in the promoted dtype of its (linear) input.
        lin_avals = [v.aval for v in eqn.invars[num_res:]]
        nz = [not z for z in params["in_zeros"]]
        lin_iter = iter(lin_avals)
        result = []
        for o, nonzero in zip(outs, nz):
            if nonzero:
                a = next(lin_iter)
                o = lax.convert_element_type(o, interp.up(a.dtype)) if _floating(o) else o
            result.append(o)
        return result

    new_params = dict(params, bwd=compat.wrap_bwd(new_bwd, old_bwd), out_avals=new_out_avals,
                      symbolic_zeros=False)
    lin = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(lin, inflags[num_res:])]
    with compat.eqn_context(eqn):
        outs = compat.custom_lin_bind([*res, *lin], new_params)
    return outs, [True] * len(outs)


def linear_solve_rule(interp: Interpreter, eqn, invals, inflags):
    """`custom_linear_solve`: re-traced through `lax.custom_linear_solve` with each of its
    functions (matvec, solve, transpose_solve) evaluated by the interpreter."""
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    names = ("matvec", "vecmat", "solve", "transpose_solve")
    groups, flag_groups, i = {}, {}, 0
    for n in names:
        k = getattr(lengths, n)
        groups[n], flag_groups[n] = invals[i:i + k], inflags[i:i + k]
        i += k
    b, b_f = invals[i:], inflags[i:]
    b = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(b, b_f)]

    def as_fun(name):
        j = getattr(jaxprs, name)

        def fun(x):
            x = list(x)
            outs, oflags = interp.eval_closed(
                j, [*groups[name], *x], [*flag_groups[name], *([True] * len(x))])
            return [interp.cast_up(o, True) if _floating(o) else o for o in outs]
        return fun

    matvec = as_fun("matvec")
    solve = as_fun("solve")
    symmetric = jaxprs.vecmat is jaxprs.matvec
    tr = None if jaxprs.transpose_solve is None else as_fun("transpose_solve")
    with compat.eqn_context(eqn):
        out = lax.custom_linear_solve(
            matvec, list(b), lambda _mv, x: solve(x),
            None if tr is None else (lambda _vm, x: tr(x)), symmetric=symmetric)
    return list(out), [True] * len(out)


def _floating_aval(a) -> bool:
    return jax.numpy.issubdtype(getattr(a, "dtype", np.int32), jax.numpy.floating)


def callback_rule(interp: Interpreter, eqn, invals, inflags):
    """Callbacks run at their declared dtypes."""
    return interp.fallback(eqn, invals, inflags)


def fft_rule(interp: Interpreter, eqn, invals, inflags):
    """`fft`: a real input (rfft) is promoted like any float; complex values keep their dtype,
    as everywhere in hifigrad (complex64 already holds float32 parts)."""
    args = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(invals, inflags)]
    outs = compat.bind_eqn(eqn, args)
    outs = [interp.cast_like(o, v.aval) if not _floating_aval(v.aval) else o
            for o, v in zip(outs, eqn.outvars)]
    return outs, [True] * len(outs)


def scatter_rule(interp: Interpreter, eqn, invals, inflags):
    """Scatters carry a typed update jaxpr: re-traced through `lax` at the promoted dtype."""
    operand, indices, updates = invals
    operand = interp.cast_up(operand, inflags[0])
    updates = interp.cast_up(updates, inflags[2])
    p = eqn.params
    fn = {"scatter-add": lax.scatter_add, "scatter_add": lax.scatter_add,
          "scatter-mul": lax.scatter_mul, "scatter_mul": lax.scatter_mul,
          "scatter-min": lax.scatter_min, "scatter_min": lax.scatter_min,
          "scatter-max": lax.scatter_max, "scatter_max": lax.scatter_max,
          "scatter": lax.scatter, "scatter-sub": getattr(lax, "scatter_sub", None),
          "scatter_sub": getattr(lax, "scatter_sub", None)}[eqn.primitive.name]
    with compat.eqn_context(eqn):
        out = fn(operand, indices, updates, p["dimension_numbers"],
                 indices_are_sorted=p["indices_are_sorted"], unique_indices=p["unique_indices"],
                 mode=p["mode"])
    return [out], [True]


# ------------------------------------------------------------------------------ the table

ELEMENTWISE = [
    "neg", "add", "sub", "mul", "div", "rem", "max", "min", "abs", "sign", "floor", "ceil",
    "round", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan",
    "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt",
    "cbrt", "pow", "integer_pow", "square", "one_minus_square", "erf", "erfc", "erf_inv",
    "lgamma", "digamma",
    "is_finite", "nextafter", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp",
    "reduce_precision", "real", "imag", "conj", "complex", "copy", "copy_p", "stop_gradient",
]
STRUCTURAL = [
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "rev", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "split", "iota",
    "convert_element_type", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
    "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_gather_add",
    "select_and_scatter_add", "dot_general", "conv_general_dilated", "ragged_dot",
    "ragged_dot_general", "reduce_and", "reduce_or", "reduce_xor",
]
LINALG = ["triangular_solve", "cholesky", "lu", "qr", "householder_product", "eigh", "svd",
          "tridiagonal_solve", "schur", "eig"]
COLLECTIVES = [
    "psum", "pmax", "pmin", "all_gather", "ppermute", "psum_scatter", "reduce_scatter",
    "all_to_all", "pbroadcast", "pvary", "pcast", "psum_invariant", "axis_index",
    "psum2", "unreduced_psum", "vary_unreduced_cast", "reduced_vary_cast",
]

PROMOTE = RuleTable()
PROMOTE.register(compat.primitives_named(ELEMENTWISE + STRUCTURAL + LINALG + COLLECTIVES),
                 promote_rule)
PROMOTE.register([compat.add_jaxvals_p, compat.sharding_constraint_p, compat.mesh_cast_p,
                  compat.reshard_p, compat.device_put_p, compat.optimization_barrier_p,
                  compat.debug_callback_p, compat.debug_print_p, compat.copy_p,
                  compat.select_and_gather_add_p, compat.select_and_scatter_add_p,
                  compat.reduce_window_sum_p, compat.cumsum_p,
                  compat.psum_p, compat.pvary_p, compat.pcast_p, compat.pbroadcast_p],
                 promote_rule)
PROMOTE.register(lax.convert_element_type_p, convert_rule)
PROMOTE.register(upcast_p, promote_rule)  # a backward that is itself differentiated
PROMOTE.register(compat.primitives_named(["scatter", "scatter-add", "scatter_add", "scatter_mul",
                                          "scatter_min", "scatter_max", "scatter_sub"]),
                 scatter_rule)
PROMOTE.register(compat.primitives_named(["fft"]), fft_rule)
PROMOTE.register(compat.scan_p, scan_rule, scan_flags)
PROMOTE.register(compat.while_p, while_rule, while_flags)
PROMOTE.register(compat.cond_p, cond_rule, cond_flags)
# Call-like primitives: one sub-jaxpr (`_call_jaxpr_param`) whose trailing inputs are the
# equation's.
CALL_PRIMITIVES = frozenset(p for p in (compat.pjit_p, compat.custom_jvp_call_p,
                                        compat.custom_vjp_call_p, compat.remat_p) if p)
PROMOTE.register([compat.pjit_p, compat.custom_jvp_call_p, compat.custom_vjp_call_p],
                 inline_rule, call_flags)
PROMOTE.register(compat.remat_p, remat_rule, call_flags)
PROMOTE.register(compat.custom_lin_p, custom_lin_rule)
PROMOTE.register(compat.linear_solve_p, linear_solve_rule)
PROMOTE.register(compat.shard_map_p, shard_map_rule, call_flags)
PROMOTE.register([compat.pure_callback_p, compat.io_callback_p], callback_rule)


def register_rule(primitive, rule, flag_rule=None, table: RuleTable | None = None) -> None:
    """Registers a promotion rule for `primitive` (in `PROMOTE` unless `table` is given).

    ``rule(interp, eqn, invals, inflags) -> (outvals, outflags)`` receives the equation, its
    input values (promoted ones already in their promoted dtype) and which inputs are promoted.
    Most primitives that are polymorphic in dtype can use `promote_rule`.
    """
    (PROMOTE if table is None else table).register(primitive, rule, flag_rule)

