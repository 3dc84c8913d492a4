"""Promotion rules, keyed by primitive: the one registry of hifigrad's transform.

`PROMOTE` is the table the backward transform uses. What happens to a primitive that a cotangent
reaches, in order:

1. **A rule names it.** Only primitives that need special handling are named: control flow
   (`scan`, `while`, `cond`, `remat`, `jit`, `shard_map`), custom rules (`custom_jvp_call`,
   `custom_vjp_call`, a user's `custom_vjp` backward as `custom_lin`, `custom_linear_solve`),
   `convert_element_type`, scatters (typed update jaxprs), `fft`, callbacks (run at their declared
   dtypes), JAX 0.12's hi-primitives (`call_hi_primitive`: `jnp.ldexp`, `jnp.frexp`), and
   `dot_general` / `conv_general_dilated` (the default rule plus `Policy.matmul_precision`).
2. **Otherwise `default_rule` decides by evidence, not by name:**
   - a call-like primitive (one sub-jaxpr whose inputs and outputs are the equation's, aval for
     aval: `closed_call`, 0.12's `eval_jaxpr` from `lax.custom_root`, ...) is inlined;
   - a primitive with any other typed sub-program in its params, or a PRNG-key operand, cannot
     be re-bound blindly: it gets the fallback below;
   - every other primitive is re-bound at promoted input dtypes (float dtype-valued params
     promoted too) when its abstract evaluation at the promoted avals succeeds and gives each
     float output the promoted dtype of the original output. That covers `lax`'s elementwise,
     structural, reduction, linear-algebra and collective primitives, new ones a JAX release
     adds (`stack`, `unstack`, `tile`, `polynomial`), sparse ones (`bcoo_dot_general`, ...)
     and library-defined ones (equinox's `maybe_set`, ...);
   - when that evidence is missing, the **fallback** runs the primitive at its own dtype with
     casts at its edges and warns once (`PrecisionFallbackWarning`); with
     ``Policy(unsupported='error')`` it raises `UnsupportedPrimitiveError` instead.
   A primitive with no outputs (an effect such as `debug_callback`) is re-bound promoted when
   the evidence allows (a `jax.debug.print` of a cotangent prints its f32 value), else at its
   declared dtypes, with no warning: no cotangent leaves it.

GPU library kernels whose abstract evaluation accepts float32 although the kernel does not
(cuDNN's fused attention, `LOW_PRECISION_KERNELS` at the end of this module) are named: they get
the fallback, with a warning that names the kernel.

Mutable refs a program creates (`jax.new_ref`) are discharged into pure values before the
program reaches this table (`api.py`). Every rule runs in its equation's context (mesh, compute
type), so the casts it stages run where the equation runs.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import jax
import numpy as np
from jax import lax

from . import compat
from .dtypes import is_real_float
from .interpreter import Interpreter, RuleTable
from .primitives import PRIMITIVES

PROMOTED_REGION = "hifigrad_promoted_backward"  # `api.promoted_region`'s call

__all__ = ["PROMOTE", "promote_rule", "register_rule"]

def _float_dtype_param(v):
    """`v` as a real float dtype when it is one (a dtype-valued param), else None."""
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        dt = np.dtype(v)
        return dt if is_real_float(dt) else None
    return None


def _promote_params(interp: Interpreter, params: dict) -> dict:
    """`params` with every float dtype-valued param (``preferred_element_type``, ``out_dtype``,
    ...) promoted."""
    new = None
    for k, v in params.items():
        dt = _float_dtype_param(v)
        if dt is None:
            continue
        up = interp.up(dt)
        if up != dt:
            new = dict(params) if new is None else new
            new[k] = up
    return params if new is None else new


def promote_rule(interp: Interpreter, eqn, invals, inflags, params: dict | None = None):
    """The rule for a dtype-polymorphic primitive: binds it with every float input promoted.

    Every float input (promoted or residual) is brought to its promoted dtype, float
    dtype-valued params (``preferred_element_type``, ...) likewise, and the primitive is bound;
    all its outputs are promoted. Pass it to `register_rule`; it is not called directly.

    Args:
      interp: the interpreter evaluating the equation (it knows the policy's tangent dtype).
      eqn: the jaxpr equation.
      invals: its input values.
      inflags: which inputs are promoted.
      params: the params to bind with (default: ``eqn.params`` with float dtypes promoted).

    Returns:
      ``(outvals, outflags)``: the outputs, all flagged promoted.

    Examples:
      >>> import jax, hifigrad as hg
      >>> from jax.extend.core import Primitive
      >>> from jax.interpreters import ad
      >>> scale2_p = Primitive("scale2")              # linear in x, any float dtype
      >>> _ = scale2_p.def_abstract_eval(lambda x: x)
      >>> ad.deflinear2(scale2_p, lambda ct, x: [scale2_p.bind(ct)])
      >>> hg.register_rule(scale2_p, hg.promote_rule)   # its cotangents run in float32
    """
    args = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(invals, inflags)]
    params = _promote_params(interp, eqn.params) if params is None else params
    outs = compat.bind_eqn(eqn, args, params)
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
    if eqn.primitive is compat.pjit_p and name == PROMOTED_REGION:
        # A backward hifigrad built in the tangent dtype (`api.promoted_region`): bound as it
        # is, its cotangents (promoted already) at the dtypes it was traced with.
        args = [interp.cast_like(x, v.aval) if f else x
                for x, v, f in zip(invals, eqn.invars, inflags)]
        outs = compat.bind_eqn(eqn, args)
        return outs, [_floating(o) and any(inflags) for o in outs]
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
        r = list(args[:num_res])
        # A zero cotangent stays a symbolic zero, as JAX's own custom_lin transpose hands it to
        # the rule. A dense zero looks nonzero to JAX: on jax >= 0.12, under vmap, the batched
        # bwd of an output that is shared across the batch then raises "shared across the
        # batch" (diffrax's adjoints have such outputs).
        zero = [compat.is_symbolic_zero(c) for c in args[num_res:]]
        cts = [c for c, z in zip(args[num_res:], zero) if not z]
        # Residuals that are traced stay inputs of the traced rule; concrete ones (a Python
        # bool or scalar the user's fwd returned, seen here as a literal's value) reach the
        # user's bwd as they are, exactly as under jax.grad, so it may branch on them.
        dyn = [i for i, x in enumerate(r) if isinstance(x, jax.core.Tracer)]

        def traced(r_dyn, cts_nz, up=False):
            full = list(r)
            for i, x in zip(dyn, r_dyn):
                full[i] = x
            if up:  # (`_retrace_promoted`) low-precision float residuals, up-cast exactly
                full = [lax.convert_element_type(x, interp.up(x.dtype))
                        if isinstance(x, (jax.Array, np.ndarray)) and _floating(x) else x
                        for x in full]
            it = iter(cts_nz)
            # (inside a shard_map, each cotangent varies along the mesh axes its output does)
            cts_lo = [compat.symbolic_zero(a) if z else compat.match_varying(next(it), a)
                      for a, z in zip(out_avals, zero)]
            return compat.custom_lin_call_bwd(old_bwd, full, cts_lo)

        ct_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                    for a, z in zip(out_avals, zero) if not z]
        r_dyn = [r[i] for i in dyn]
        jaxpr, consts, _ = compat.make_jaxpr_closed(traced, r_dyn, ct_avals)
        outs = None
        if _holds_opaque_kernel(interp, jaxpr):
            outs = _retrace_promoted(interp, functools.partial(traced, up=True), r_dyn, cts,
                                     ct_avals)
        if outs is None:
            outs, _ = interp.eval(jaxpr, consts, [*r_dyn, *cts],
                                  [False] * len(r_dyn) + [True] * len(cts))
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


def _typed_kernel(eqn) -> bool:
    """An equation whose params hold a typed sub-program that is not a call (`pallas_call`: a
    Pallas kernel is typed at the dtypes it was built for): no promotion can re-type it."""
    return bool(compat.jaxprs_in_params(eqn.params)) and _call_like_jaxpr(eqn) is None


def _holds_opaque_kernel(interp: Interpreter, jaxpr) -> bool:
    """Whether `jaxpr` (a custom_vjp backward traced at its declared dtypes), or a program
    nested in it, holds a `_typed_kernel` that no rule names: one the interpreter cannot
    promote."""
    for eqn in jaxpr.eqns:
        if eqn.primitive not in interp.table.rules and _typed_kernel(eqn):
            return True
        if any(_holds_opaque_kernel(interp, compat.jaxpr_and_consts(sub)[0])
               for sub in compat.jaxprs_in_params(eqn.params)):
            return True
    return False


def _retrace_promoted(interp: Interpreter, traced, r_dyn, cts, ct_avals):
    """A custom_vjp backward that holds a kernel the interpreter cannot promote (a Pallas
    kernel: `_holds_opaque_kernel`), re-traced from the user's Python rule at the promoted
    dtype: the cotangents in it, its low-precision float residuals up-cast (exactly) to it, so
    that the kernel is built for float32 operands (Pallas kernels are written in jnp, generic
    in dtype; e.g. `jax.experimental.pallas.ops.tpu.flash_attention`'s backward kernels). JAX
    accepts a rule's inexact cotangents in another dtype than the primal's. The program is the
    rule's own at those dtypes (a cast it writes, to its residual's dtype say, stays). Returns
    the rule's input cotangents, or None when the re-trace fails (a rule that is not generic in
    dtype): then the declared-dtype trace runs as before (the kernel's fallback, with its
    `PrecisionFallbackWarning`)."""

    up_avals = [jax.ShapeDtypeStruct(a.shape, interp.up(a.dtype)) if _floating_aval(a) else a
                for a in ct_avals]
    # The kernel's matmuls take `Policy.matmul_precision` as every backward matmul does
    # (`matmul_rule`), through the default precision the kernel's `dot`s read when traced
    # (Mosaic has DEFAULT, one bf16 pass on a TPU, and HIGHEST, float32; 'high' is taken as
    # HIGHEST there). Without one, the ambient `jax.default_matmul_precision` applies.
    prec = interp.policy.matmul_precision
    ctx = (contextlib.nullcontext() if prec is None else
           jax.default_matmul_precision("highest" if prec in ("high", "highest") else "default"))
    try:
        with ctx:
            jaxpr, consts, _ = compat.make_jaxpr_closed(traced, r_dyn, up_avals)
    except Exception:  # noqa: BLE001 (any failure of the user's rule at other dtypes)
        return None
    cts = [lax.convert_element_type(c, a.dtype) if _floating(c) else c
           for c, a in zip(cts, up_avals)]
    # Every value is at its final dtype already: evaluated as traced (no input flagged, so no
    # rule promotes or falls back).
    outs, _ = interp.eval(jaxpr, consts, [*r_dyn, *cts], [False] * (len(r_dyn) + len(cts)))
    return outs


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


_FLOAT_DTYPES: dict = {}  # dtype -> whether it is a floating dtype (`_floating_aval`)


def _floating_aval(a) -> bool:
    dt = getattr(a, "dtype", np.int32)
    hit = _FLOAT_DTYPES.get(dt)
    if hit is None:
        hit = _FLOAT_DTYPES[dt] = bool(jax.numpy.issubdtype(dt, jax.numpy.floating))
    return hit


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


# ------------------------------------------------------------------------------ the default

def _promoted_aval(interp, aval):
    if _floating_aval(aval):
        return aval.update(dtype=interp.up(aval.dtype), weak_type=False)
    return aval


# Promotion's evidence (`promotion`), keyed by everything it depends on (primitive, input avals
# with their weak types and shardings, output avals, params, tangent dtype), least recently used
# first. An equation whose params cannot be hashed is never cached.
_PROMOTABLE_CACHE: collections.OrderedDict = collections.OrderedDict()
_PROMOTABLE_CACHE_SIZE = 4096


def _promotable_key(interp: Interpreter, eqn, avals, params):
    try:
        key = (eqn.primitive, np.dtype(interp.policy.tangent_dtype), tuple(avals),
               tuple(v.aval for v in eqn.outvars), tuple(params.items()))
        hash(key)
    except TypeError:  # unhashable params (arrays, lists): decided every time
        return None
    return key


def promotion(interp: Interpreter, eqn, avals, params):
    """Whether binding `eqn` with every float input promoted (its inputs' avals are `avals`,
    promoted or not) and with `params` is shown exact by its abstract evaluation: it succeeds
    and gives every float output the promoted dtype of the original output (and every other
    output its original dtype). Returns ``(None, out_avals, effects)`` when it is, else
    ``(why not, None, None)``. Answers are cached (`_PROMOTABLE_CACHE`): they depend only on
    the primitive, the avals and the params."""
    key = _promotable_key(interp, eqn, avals, params)
    if key is not None:
        try:
            hit = _PROMOTABLE_CACHE[key]
        except (KeyError, TypeError, ValueError):  # a param whose == is not a bool: no hit
            hit = None
        else:
            _PROMOTABLE_CACHE.move_to_end(key)
            return hit
    hit = _promotion_uncached(interp, eqn, [_promoted_aval(interp, a) for a in avals], params)
    if key is not None:
        _PROMOTABLE_CACHE[key] = hit
        if len(_PROMOTABLE_CACHE) > _PROMOTABLE_CACHE_SIZE:
            _PROMOTABLE_CACHE.popitem(last=False)
    return hit


def _why_not_promotable(interp: Interpreter, eqn, invals, params) -> str | None:
    """None when `eqn` can run promoted on `invals` with `params` (see `promotion`), else
    why not."""
    return promotion(interp, eqn, [compat.aval_of(x) for x in invals], params)[0]


def _promotion_uncached(interp: Interpreter, eqn, avals, params):
    try:
        out_avals, effects = compat.abstract_eval_effects(eqn, avals, params)
    except Exception as e:  # noqa: BLE001 - any failure is evidence against promotion
        return f"its abstract evaluation at promoted dtypes raises {type(e).__name__}", None, None
    for v, a in zip(eqn.outvars, out_avals):
        want = _promoted_aval(interp, v.aval)
        if np.dtype(a.dtype) != np.dtype(want.dtype) or tuple(a.shape) != tuple(want.shape):
            return (f"at promoted inputs it returns {a.dtype}{list(a.shape)} where "
                    f"{want.dtype}{list(want.shape)} is needed"), None, None
    return None, tuple(out_avals), effects


def _call_like_jaxpr(eqn):
    """The sub-jaxpr of a call-like equation (one sub-jaxpr whose inputs are the equation's
    trailing inputs and whose outputs are its outputs, aval for aval), else None."""
    jaxprs = compat.jaxprs_in_params(eqn.params)
    if len(jaxprs) != 1:
        return None
    j, _ = compat.jaxpr_and_consts(jaxprs[0])
    n = len(j.invars)
    if n > len(eqn.invars) or len(j.outvars) != len(eqn.outvars):
        return None
    pairs = [*zip(j.invars, eqn.invars[len(eqn.invars) - n:]), *zip(j.outvars, eqn.outvars)]
    for a, b in pairs:
        if (tuple(a.aval.shape), a.aval.dtype) != (tuple(b.aval.shape), b.aval.dtype):
            return None
    return jaxprs[0]


def default_rule(interp: Interpreter, eqn, invals, inflags):
    """The rule of every primitive the table does not name (see the module docstring)."""
    if compat.jaxprs_in_params(eqn.params):
        if _typed_kernel(eqn):
            return interp.unsupported(eqn, invals, inflags, "its params hold typed sub-programs")
        j = _call_like_jaxpr(eqn)
        n = len(compat.jaxpr_and_consts(j)[0].invars)
        with jax.named_scope(str(eqn.params.get("name", eqn.primitive.name))):
            return interp.eval_closed(j, invals[len(invals) - n:], inflags[len(inflags) - n:])
    if any(compat.is_ref_or_extended(v.aval) for v in eqn.invars):
        return interp.unsupported(eqn, invals, inflags, "it takes a mutable ref or a PRNG key")
    params = _promote_params(interp, eqn.params)
    why = _why_not_promotable(interp, eqn, invals, params)
    if why is not None:
        return interp.unsupported(eqn, invals, inflags, why)
    return promote_rule(interp, eqn, invals, inflags, params)


def matmul_rule(interp: Interpreter, eqn, invals, inflags):
    """`dot_general` / `conv_general_dilated`: the default rule, with the op's ``precision`` set
    to `Policy.matmul_precision` when one is given (the transposed backward matmuls inherit it).
    Without one, each op keeps its own precision, and `jax.default_matmul_precision` applies to
    the backward as it does under `jax.grad`."""
    prec = interp.policy.lax_precision()
    if prec is not None and "precision" in eqn.params and any(inflags):
        eqn = eqn.replace(params=dict(eqn.params, precision=(prec, prec)))
    return default_rule(interp, eqn, invals, inflags)


def hi_primitive_rule(interp: Interpreter, eqn, invals, inflags):
    """`call_hi_primitive` (jax >= 0.12: `jnp.ldexp`, `jnp.frexp`, ...): its `HiPrim` object
    holds the input avals it was built for, so it is rebuilt at the promoted avals and used when
    its declared outputs are then the promoted ones."""
    prim = compat.hi_primitive_at(eqn, lambda a: _promoted_aval(interp, a))
    if prim is None:
        return interp.unsupported(eqn, invals, inflags, "its HiPrim cannot be rebuilt")
    outs = compat.hi_primitive_out_avals(prim)
    want = [_promoted_aval(interp, v.aval) for v in eqn.outvars]
    if [(tuple(a.shape), a.dtype) for a in outs] != [(tuple(a.shape), a.dtype) for a in want]:
        return interp.unsupported(eqn, invals, inflags, "its rebuilt HiPrim is not promoted")
    args = [interp.cast_up(x, f) if _floating(x) else x for x, f in zip(invals, inflags)]
    outs = compat.bind_eqn(eqn, args, dict(eqn.params, _prim=prim))
    return outs, [True] * len(outs)


def pvary_rule(interp: Interpreter, eqn, invals, inflags):
    """`pvary` (a value made to vary along manual mesh axes inside a `shard_map`), promoted,
    along only the axes its promoted operand does not vary along yet: a backward traced
    from cotangent types that did not say they vary (`make_jaxpr` takes no varying type)
    then meets cotangents that do."""
    axes = tuple(eqn.params["axes"])
    outs = []
    for x, f in zip(invals, inflags):
        x = interp.cast_up(x, f) if _floating(x) else x
        missing = tuple(a for a in axes if a not in compat.varying_axes(compat.aval_of(x)))
        if missing:
            with compat.eqn_context(eqn):
                x = compat.pvary_p.bind(x, **dict(eqn.params, axes=missing))
        outs.append(x)
    return outs, [True] * len(outs)


# ------------------------------------------------------------------------------ the table

PROMOTE = RuleTable(default=default_rule)
PROMOTE.register(lax.convert_element_type_p, convert_rule)
PROMOTE.register(compat.pvary_p, pvary_rule)
# hifigrad's own primitives, by what each declares where it is defined (`primitives.py`).
PROMOTE.register([p for p, d in PRIMITIVES.items() if d.promote == "rebind"], promote_rule)
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
PROMOTE.register(compat.call_hi_primitive_p, hi_primitive_rule)
PROMOTE.register([lax.dot_general_p, lax.conv_general_dilated_p], matmul_rule)


def register_rule(primitive, rule, flag_rule=None, table: RuleTable | None = None) -> None:
    """Registers a promotion rule for `primitive` (in `PROMOTE` unless `table` is given).

    ``rule(interp, eqn, invals, inflags) -> (outvals, outflags)`` receives the equation, its
    input values (promoted ones already in their promoted dtype) and which inputs are promoted.
    Most primitives that are polymorphic in dtype can use `promote_rule`. A primitive no rule
    names is decided by evidence (see the Extending guide): most need no rule.

    Args:
      primitive: a JAX primitive, or a list / tuple / set of them (None entries are skipped).
      rule: ``rule(interp, eqn, invals, inflags) -> (outvals, outflags)``.
      flag_rule: optional, ``flag_rule(interp, eqn, inflags) -> outflags``: which outputs the
        rule promotes (default: every float output when any input is promoted).
      table: the rule table to register in (default: the one `hifigrad.grad` uses).

    Returns:
      None.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> from jax.extend.core import Primitive
      >>> from jax.interpreters import ad, mlir
      >>> double_p = Primitive("double")
      >>> _ = double_p.def_impl(lambda x: 2 * x)
      >>> _ = double_p.def_abstract_eval(lambda x: x)
      >>> mlir.register_lowering(double_p, mlir.lower_fun(lambda x: 2 * x, False))
      >>> ad.deflinear2(double_p, lambda ct, x: [double_p.bind(ct)])
      >>> hg.register_rule(double_p, hg.promote_rule)
      >>> hg.grad(lambda x: double_p.bind(x).sum())(jnp.ones(2, jnp.bfloat16))
      Array([2., 2.], dtype=float32)
    """
    (PROMOTE if table is None else table).register(primitive, rule, flag_rule)



# ------------------------------------------------------------------------------ vendor kernels

# Primitives of GPU library kernels whose abstract evaluation accepts float32 operands although
# the kernel does not, so the default rule's evidence would be wrong: {primitive name: the
# kernel, in words a user recognizes}. cuDNN's fused attention
# (`jax.nn.dot_product_attention(implementation='cudnn')`, jax/_src/cudnn/
# fused_attention_stablehlo.py) is a `custom_vjp` whose bwd binds `dot_product_attention_bwd_
# wrapper`; that abstract evaluation returns each gradient in its input's dtype, whatever the
# dtype, and only the CUDA lowering knows BF16/F16 (an f32 operand fails XLA compilation with
# "KeyError: F32Type(f32)", reproduced on CPU by lowering for 'cuda'). So they run at their own
# dtype: the cotangent is rounded to the kernel's dtype at its input, its gradients are up-cast
# at its outputs, everything around it stays float32, and `PrecisionFallbackWarning` names the
# kernel once (under ``Policy(unsupported='error')``: `UnsupportedPrimitiveError`).
_CUDNN_ATTENTION = "cuDNN fused attention (jax.nn.dot_product_attention(implementation='cudnn'))"
LOW_PRECISION_KERNELS = {
    "dot_product_attention_bwd_wrapper": f"the backward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_bwd": f"the backward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fwd_wrapper": f"the forward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fwd": f"the forward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fp8_bwd_wrapper": f"the fp8 backward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fp8_bwd": f"the fp8 backward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fp8_fwd_wrapper": f"the fp8 forward kernel of {_CUDNN_ATTENTION}",
    "dot_product_attention_fp8_fwd": f"the fp8 forward kernel of {_CUDNN_ATTENTION}",
}


def low_precision_kernel_rule(interp: Interpreter, eqn, invals, inflags):
    """A kernel of `LOW_PRECISION_KERNELS`: the fallback, with a reason that names it."""
    what = LOW_PRECISION_KERNELS.get(eqn.primitive.name, "a GPU library kernel")
    return interp.unsupported(
        eqn, invals, inflags,
        f"it is {what}, which accepts only its declared bf16/fp16/fp8 operands although its "
        f"abstract evaluation accepts float32")


def _kernel_primitives():
    import importlib

    try:
        mod = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError:  # pragma: no cover - a JAX without cuDNN attention
        return []
    prims = [getattr(mod, a) for a in dir(mod) if a.endswith(("_p", "_p_wrapper"))]
    return [p for p in prims if getattr(p, "name", None) in LOW_PRECISION_KERNELS]


PROMOTE.register(_kernel_primitives(), low_precision_kernel_rule)
