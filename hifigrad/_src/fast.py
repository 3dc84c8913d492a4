"""``Policy(matmul='fast')``: backward matmuls on low-precision operands, float32 accumulation.

In 'exact' mode a backward `dot_general` or `conv_general_dilated` multiplies the float32
cotangent by the residual up-cast to float32. This pass rewrites each such op whose operand is an
up-cast residual (a `hifigrad_upcast` of a bf16/fp16/fp8 value) to take that residual in its own
dtype, round the other operand to it, and accumulate in float32 through
``preferred_element_type``: the tensor-core path on GPUs. Everything else in the backward,
including all accumulation across ops, stays float32.

XLA's CPU backend cannot run every such mixed-precision dot (a batched bf16 x bf16 -> f32
`dot_general` fails at run time with "Unsupported element type for DotThunk::Execute"), and has
no low-precision matmul units to gain from. So the rewrite is staged with
`lax.platform_dependent`: on CPU the two rounded operands are up-cast and multiplied in float32,
which gives the same products (a product of two bf16 or fp16 values is exact in float32) and
float32 accumulation; every other platform gets the low-precision operands.

``Policy(matmul='auto')`` (the default) runs this pass on every platform but CPU, and there
rewrites only the matmuls whose low-precision operand has float32's exponent range (bfloat16):
rounding a cotangent to bf16 keeps its magnitude, while rounding it to fp16 or fp8 would flush
small cotangents to zero, so those matmuls stay exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat
from .interpreter import Interpreter, RuleTable
from .policy import Policy
from .primitives import upcast_p

__all__ = ["fast_matmul"]


def _low_source(interp: Interpreter, var):
    """The low-precision value `var` was up-cast from, or None."""
    if compat.is_literal(var):
        return None
    eqn = interp.producer(var)
    if eqn is None or eqn.primitive is not upcast_p:
        return None
    return interp.lookup(eqn.invars[0])


def _keeps_exponent_range(low, wide) -> bool:
    """Whether `low` has `wide`'s exponent range (bfloat16 has float32's; fp16 and fp8 do not)."""
    lo, hi = jnp.finfo(low), jnp.finfo(wide)
    return int(lo.minexp) <= int(hi.minexp) and int(lo.maxexp) >= int(hi.maxexp)


def _fast_rule(interp: Interpreter, eqn, invals, inflags):
    lhs, rhs = invals[:2]
    lo_l, lo_r = _low_source(interp, eqn.invars[0]), _low_source(interp, eqn.invars[1])
    if lo_l is None and lo_r is None:
        return compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
    low = np.dtype((lo_l if lo_l is not None else lo_r).dtype)
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    if interp.policy.matmul == "auto" and not _keeps_exponent_range(low, out_dtype):
        # fp16 / fp8: rounding the cotangent to them would flush small cotangents to zero
        # (fp16's smallest normal is 6e-5), the loss of range hifigrad exists to avoid.
        return compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
    a = lo_l if lo_l is not None else lax.convert_element_type(lhs, low)
    b = lo_r if lo_r is not None else lax.convert_element_type(rhs, low)
    params = dict(eqn.params, preferred_element_type=out_dtype)
    rest = invals[2:]

    def low_operands(a, b, *rest):
        return compat.bind_eqn(eqn, [a, b, *rest], params)

    def wide_operands(a, b, *rest):  # same products, float32 multiply (CPU)
        a, b = (lax.convert_element_type(v, out_dtype) for v in (a, b))
        return compat.bind_eqn(eqn, [a, b, *rest], params)

    outs = lax.platform_dependent(a, b, *rest, cpu=wide_operands, default=low_operands)
    return list(outs), [False] * len(eqn.outvars)


@functools.lru_cache(maxsize=1)
def _table() -> RuleTable:
    from .rules import PROMOTE, cond_rule, inline_rule, remat_rule, scan_rule, while_rule

    table = RuleTable()
    for p in (lax.dot_general_p, lax.conv_general_dilated_p):
        table.register(p, _fast_rule)
        table.always.add(p)
    for prim, rule in ((compat.scan_p, scan_rule), (compat.while_p, while_rule),
                       (compat.cond_p, cond_rule), (compat.remat_p, remat_rule),
                       (compat.pjit_p, inline_rule)):
        table.register(prim, rule, PROMOTE.flag_rules.get(prim))
        table.always.add(prim)
    return table


def fast_matmul(transposed, policy: Policy):
    """Wraps a backward function `transposed(cts) -> cts_in` with the fast-matmul rewrite."""

    def run(cts):
        jaxpr, consts, out_tree = compat.make_jaxpr_closed(transposed, cts)
        flat = jax.tree_util.tree_leaves(cts)
        outs, _ = Interpreter(policy, _table()).eval(jaxpr, consts, flat, [False] * len(flat))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return run
