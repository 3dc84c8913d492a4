"""Whether a function is separable along its inputs' leading (batch) axis, read from its program.

A recomputed block's backward may run in slices along the batch axis (`checkpoint`'s
``backward_slices``) only when the block computes each row of its outputs from the same row of
its batched inputs and from nothing that varies along that axis. That is never assumed: this
module proves it from the block's jaxpr, or says why it cannot.

`batch_axes` propagates, equation by equation, which axis of each value is the batch axis (or
None: the value does not depend on a batched input). Each primitive has a rule that accepts
only what keeps rows apart: elementwise ops; broadcasts, transposes, squeezes; reshapes that
keep the batch axis major over what it merges with; reductions, cumulative ops and slices
along other axes; `dot_general` with the batch axis free or a batch dimension, never
contracted. A value that depends on no batched input but meets a batched one (a broadcast
parameter, an iota mask) must be provably constant along the batch axis. Call-like equations
(jit, custom_jvp/custom_vjp calls, remat) are looked into. Anything else (gathers, scatters,
random bits, loops, effects, an unknown primitive) makes the function not separable.

`same_program` then checks that the function traced at the slice's batch size is the same
program as the one analysed, up to the batch size in shapes and params: a Python branch on
the batch size would otherwise make the analysed program and the sliced one differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import compat


class NotSeparable(Exception):
    """The program mixes rows along the batch axis, or this analysis cannot show it does not."""


ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not
    one_minus_square or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt
    square sub tan tanh xor hifigrad_upcast stop_gradient optimization_barrier
    """.split())
REDUCTIONS = frozenset("""
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
    reduce_precision
    """.split()) - {"reduce_precision"}
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def call_jaxpr(eqn):
    """The sub-jaxpr of a call-like equation with the equation's arity, or None."""
    from .rules import CALL_PRIMITIVES, _call_jaxpr_param

    if eqn.primitive not in CALL_PRIMITIVES:
        return None
    jaxpr = compat.jaxpr_and_consts(_call_jaxpr_param(eqn))[0]
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr


def _shape(v):
    return tuple(v.aval.shape)


def batch_axes(jaxpr, in_axes: Sequence[int | None], batch: int) -> list[int | None]:
    """The batch axis of each of `jaxpr`'s outputs (None: independent of the batched inputs),
    given each input's (`in_axes`), a batch axis being `batch` rows long (or a multiple of it,
    once merged with minor axes). Raises `NotSeparable` naming the first equation that mixes
    rows, or that this analysis does not know."""
    env: dict = {v: a for v, a in zip(jaxpr.invars, in_axes)}
    producer = {v: e for e in jaxpr.eqns for v in e.outvars if not compat.is_dropvar(v)}

    def axis(v):
        return None if compat.is_literal(v) else env.get(v)

    def constant_along(v, a) -> bool:
        """Whether `v` (independent of the batched inputs) is constant along its axis `a`."""
        if compat.is_literal(v) or not _shape(v) or _shape(v)[a] == 1:
            return True
        eqn = producer.get(v)
        if eqn is None:
            return False  # an input or a const: it may vary along the axis
        name = eqn.primitive.name
        if name == "broadcast_in_dim":
            dims = tuple(eqn.params["broadcast_dimensions"])
            if a not in dims:
                return True
            return constant_along(eqn.invars[0], dims.index(a))
        if name == "iota":
            return eqn.params["dimension"] != a
        if name in ELEMENTWISE:
            return all(constant_along(u, a) for u in eqn.invars
                       if compat.is_literal(u) or _shape(u) == _shape(v))
        return False

    def fail(eqn, why):
        raise NotSeparable(f"{eqn.primitive.name}: {why}")

    for eqn in jaxpr.eqns:
        axes = [axis(v) for v in eqn.invars]
        outs = eqn.outvars
        if all(a is None for a in axes):
            for v in outs:
                env[v] = None
            continue
        if eqn.effects:
            fail(eqn, "has effects")
        name = eqn.primitive.name
        sub = call_jaxpr(eqn)
        if sub is not None:
            out_axes = batch_axes(sub, axes, batch)
        elif name in ELEMENTWISE:
            marked = {a for a in axes if a is not None}
            if len(marked) != 1:
                fail(eqn, "operands batched along different axes")
            (a,) = marked
            for v, ax in zip(eqn.invars, axes):
                if ax is None and not constant_along(v, a):
                    fail(eqn, "an operand that does not depend on the batch varies along it")
            out_axes = [a] * len(outs)
        elif name == "broadcast_in_dim":
            out_axes = [tuple(eqn.params["broadcast_dimensions"])[axes[0]]]
            if any(a is not None for a in axes[1:]):
                fail(eqn, "a batched dynamic shape")
        elif name == "transpose":
            out_axes = [tuple(eqn.params["permutation"]).index(axes[0])]
        elif name == "squeeze":
            dims = tuple(eqn.params["dimensions"])
            if axes[0] in dims:
                fail(eqn, "squeezes the batch axis")
            out_axes = [axes[0] - sum(d < axes[0] for d in dims)]
        elif name == "reshape":
            if any(a is not None for a in axes[1:]):
                fail(eqn, "a batched dynamic shape")
            a, shape = axes[0], _shape(eqn.invars[0])
            new = tuple(eqn.params["new_sizes"])
            pre = math.prod(shape[:a])
            js = [j for j in range(len(new)) if math.prod(new[:j]) == pre
                  and new[j] % batch == 0 and math.prod(new[j:]) == math.prod(shape[a:])]
            if not js:
                fail(eqn, "splits the batch axis or moves it under another axis")
            out_axes = [js[0]]
        elif name in REDUCTIONS:
            red = tuple(eqn.params["axes"])
            if len(eqn.invars) != 1 and any(a != axes[0] for a in axes):
                fail(eqn, "operands batched along different axes")
            if axes[0] in red:
                fail(eqn, "reduces over the batch axis")
            out_axes = [axes[0] - sum(d < axes[0] for d in red)] * len(outs)
        elif name in CUMULATIVE:
            if eqn.params["axis"] == axes[0]:
                fail(eqn, "accumulates along the batch axis")
            out_axes = [axes[0]]
        elif name == "dot_general":
            out_axes = [dot_axis(eqn, axes, constant_along, fail)]
        elif name == "concatenate":
            marked = {a for a in axes if a is not None}
            if len(marked) != 1 or eqn.params["dimension"] in marked:
                fail(eqn, "concatenates along the batch axis")
            (a,) = marked
            if any(ax is None and not constant_along(v, a) for v, ax in zip(eqn.invars, axes)):
                fail(eqn, "an operand that does not depend on the batch varies along it")
            out_axes = [a]
        elif name == "split":
            if eqn.params["axis"] == axes[0]:
                fail(eqn, "splits along the batch axis")
            out_axes = [axes[0]] * len(outs)
        elif name == "pad":
            if axes[1] is not None or tuple(eqn.params["padding_config"][axes[0]]) != (0, 0, 0):
                fail(eqn, "pads along the batch axis")
            out_axes = [axes[0]]
        elif name == "slice":
            a, n = axes[0], _shape(eqn.invars[0])[axes[0]]
            strides = eqn.params.get("strides") or (1,) * len(_shape(eqn.invars[0]))
            if (eqn.params["start_indices"][a], eqn.params["limit_indices"][a], strides[a]) \
                    != (0, n, 1):
                fail(eqn, "slices the batch axis")
            out_axes = [a]
        else:
            fail(eqn, "no separability rule for this primitive")
        for v, a in zip(outs, out_axes):
            if not compat.is_dropvar(v):
                if a is not None and _shape(v)[a] % batch:
                    fail(eqn, "the batch axis changed length")
                env[v] = a
    return [axis(v) for v in jaxpr.outvars]


def dot_axis(eqn, axes, constant_along, fail):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    la, ra = axes
    lhs, rhs = eqn.invars
    if (la is not None and la in lc) or (ra is not None and ra in rc):
        fail(eqn, "contracts over the batch axis")
    if la is not None and la in lb:
        i = lb.index(la)
        if ra is not None and ra != rb[i]:
            fail(eqn, "operands batched along different axes")
        if ra is None and not constant_along(rhs, rb[i]):
            fail(eqn, "an operand that does not depend on the batch varies along it")
        return i
    if ra is not None and ra in rb:
        i = rb.index(ra)
        if la is not None:
            fail(eqn, "operands batched along different axes")
        if not constant_along(lhs, lb[i]):
            fail(eqn, "an operand that does not depend on the batch varies along it")
        return i
    if la is not None and ra is not None:
        fail(eqn, "an outer product of two batched operands")
    n_lhs = len(lhs.aval.shape)
    if la is not None:
        free = [d for d in range(n_lhs) if d not in lc and d not in lb]
        return len(lb) + free.index(la)
    free_l = n_lhs - len(lc) - len(lb)
    free = [d for d in range(len(rhs.aval.shape)) if d not in rc and d not in rb]
    return len(lb) + free_l + free.index(ra)


def _same_rule(a, b) -> bool:
    """Whether `a` and `b`, callables in two traces' equation params, are the same custom rule
    traced twice. JAX holds a `custom_jvp`'s JVP (and a `custom_vjp`'s fwd thunk and bwd) as
    objects it makes afresh in every trace, which never compare equal: the same rule is the
    same traced function (its debug info: name and source) or the same code."""
    if type(a) is not type(b):
        return False
    if type(a).__name__ == "WrappedFun":
        return getattr(a, "debug_info", None) == getattr(b, "debug_info", None) is not None
    code = getattr(a, "__code__", None) if callable(a) else None
    return code is not None and code is getattr(b, "__code__", None)


def same_program(full, sliced, k: int) -> bool:
    """Whether `sliced` (a jaxpr traced at 1/`k` of the batch) is `full` (the one analysed)
    with its batch-sized lengths divided by `k`: the same equations, wired the same way, with
    the same dtypes, and shapes and integer params equal or `k` times smaller."""
    def same_value(a, b) -> bool:
        if isinstance(a, compat._JAXPR_TYPES) or isinstance(b, compat._JAXPR_TYPES):
            if type(a) is not type(b):
                return False
            return same_jaxpr(compat.jaxpr_and_consts(a)[0], compat.jaxpr_and_consts(b)[0])
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if isinstance(a, int) and isinstance(b, int):
            return a == b or a == k * b
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same_value(a[x], b[x]) for x in a)
        try:
            if bool(a == b):
                return True
        except Exception:  # noqa: BLE001 - values that do not compare: not provably the same
            return False
        return _same_rule(a, b)

    def same_aval(u, v) -> bool:
        au, av = u.aval, v.aval
        if getattr(au, "dtype", None) != getattr(av, "dtype", None):
            return False
        return same_value(tuple(getattr(au, "shape", ())), tuple(getattr(av, "shape", ())))

    def same_jaxpr(j1, j2) -> bool:
        if (len(j1.eqns), len(j1.invars), len(j1.outvars), len(j1.constvars)) != \
                (len(j2.eqns), len(j2.invars), len(j2.outvars), len(j2.constvars)):
            return False
        m = {}
        for u, v in zip([*j1.constvars, *j1.invars], [*j2.constvars, *j2.invars]):
            if not same_aval(u, v):
                return False
            m[u] = v

        def same_atom(u, v):
            if compat.is_literal(u) or compat.is_literal(v):
                return (compat.is_literal(u) and compat.is_literal(v)
                        and same_value(u.val, v.val))
            return m.get(u) is v

        for e1, e2 in zip(j1.eqns, j2.eqns):
            if e1.primitive is not e2.primitive or len(e1.invars) != len(e2.invars) \
                    or len(e1.outvars) != len(e2.outvars):
                return False
            if not all(same_atom(u, v) for u, v in zip(e1.invars, e2.invars)):
                return False
            if e1.params.keys() != e2.params.keys() or not all(
                    same_value(e1.params[x], e2.params[x]) for x in e1.params):
                return False
            for u, v in zip(e1.outvars, e2.outvars):
                if compat.is_dropvar(u) != compat.is_dropvar(v):
                    return False
                if not compat.is_dropvar(u):
                    if not same_aval(u, v):
                        return False
                    m[u] = v
        return all(same_atom(u, v) for u, v in zip(j1.outvars, j2.outvars))

    return same_jaxpr(full, sliced)
