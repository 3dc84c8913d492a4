"""``Policy(matmul='fast')``: backward matmuls on low-precision operands, float32 accumulation.

In 'exact' mode a backward `dot_general` or `conv_general_dilated` multiplies the float32
cotangent by the residual up-cast to float32. This pass rewrites each such op whose operand is an
up-cast residual (a `hifigrad_upcast` of a bf16/fp16/fp8 value) to take that residual in its own
dtype, round the other operand to it, and accumulate in float32 through
``preferred_element_type``: the tensor-core path on GPUs. Everything else in the backward,
including all accumulation across ops, stays float32.
"""

from __future__ import annotations

import functools

import jax
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


def _fast_rule(interp: Interpreter, eqn, invals, inflags):
    lhs, rhs = invals[:2]
    lo_l, lo_r = _low_source(interp, eqn.invars[0]), _low_source(interp, eqn.invars[1])
    if lo_l is None and lo_r is None:
        return compat.bind_eqn(eqn, invals), [False] * len(eqn.outvars)
    low = np.dtype((lo_l if lo_l is not None else lo_r).dtype)
    a = lo_l if lo_l is not None else lax.convert_element_type(lhs, low)
    b = lo_r if lo_r is not None else lax.convert_element_type(rhs, low)
    params = dict(eqn.params, preferred_element_type=np.dtype(eqn.outvars[0].aval.dtype))
    outs = compat.bind_eqn(eqn, [a, b, *invals[2:]], params)
    return outs, [False] * len(outs)


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
