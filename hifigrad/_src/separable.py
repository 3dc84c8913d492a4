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

`check_backward` applies the same analysis to the block's *backward* program, the one the
sliced backward runs (its forward recomputation, the JVP rules of its custom_jvp functions
and the bwd functions of its custom_vjp functions, all traced in): a custom rule is analysed
as it is, never assumed to follow its forward. A backward sums over the batch (a parameter's
cotangent), so here a value may also be a *sum over the batch* (`SUM`): made by a reduction
or contraction over the batch axis, then only transformed additively (sums of sums,
products with batch-independent values, reshapes, ...). The sliced backward adds up its
slices' parameter cotangents, which equals the whole backward's exactly when each is such a
sum; a normalisation by a global norm, a clip of the sum, or a sum meeting batched rows is
not, and makes the block not separable.

`same_program` then checks that the function traced at the slice's batch size is the same
program as the one analysed: the same equations, wired the same way, with equal constants
and literals, and shapes and shape params `k` times smaller only at the positions the
analysis found to be the batch axis (`Axes`). A Python branch on the batch size, a constant
computed from it or drawn at trace time, or a length that scales with it along another axis
would otherwise make the analysed program and the sliced one differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from . import compat

_FLOAT0 = np.dtype(jax.dtypes.float0)


class NotSeparable(Exception):
    """The program mixes rows along the batch axis, or this analysis cannot show it does not."""


class _Sum:
    """The axis marker of a value that is a sum over the batch's rows of per-row terms."""

    def __repr__(self):
        return "SUM"


SUM = _Sum()
_CONFLICT = object()


class Axes:
    """What an analysis found, per variable (nested jaxprs' included): ``of[v]``, the batch
    axis of `v` (an int, or `SUM`); ``meets[v]``, the axis at which `v`, which depends on no
    batched input, meets the batch axis (a broadcast mask). `same_program` lets a shape
    differ from the analysed one only there."""

    def __init__(self):
        self.of: dict = {}
        self.meets: dict = {}

    @staticmethod
    def _put(d, v, a):
        if d.get(v, a) is not a and d.get(v, a) != a:
            d[v] = _CONFLICT  # a jaxpr called at two sites with different axes
        else:
            d[v] = a

    def batch_axis(self, v):
        """The axis along which `v`'s length may be `k` times smaller at a slice, or None."""
        for d in (self.of, self.meets):
            a = d.get(v)
            if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
                return int(a)
        return None


ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not
    one_minus_square or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt
    square sub tan tanh xor hifigrad_upcast stop_gradient optimization_barrier add_any
    name sharding_constraint
    """.split())
# Elementwise ops through which a sum over the batch stays one (`SUM`): f(a + b) = f(a) + f(b).
_LINEAR_UNARY = frozenset("""
    neg convert_element_type copy copy_p reduce_precision hifigrad_upcast real imag
    stop_gradient name sharding_constraint
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


def _producers(jaxpr) -> dict:
    """The equation that makes each variable of `jaxpr`."""
    return {v: e for e in jaxpr.eqns for v in e.outvars if not compat.is_dropvar(v)}


def batch_axes(jaxpr, in_axes: Sequence, batch: int, *, sums: bool = False,
               record: Axes | None = None, outer: dict | None = None) -> list:
    """The batch axis of each of `jaxpr`'s outputs (None: independent of the batched inputs),
    given each input's (`in_axes`), a batch axis being `batch` rows long (or a multiple of it,
    once merged with minor axes). Raises `NotSeparable` naming the first equation that mixes
    rows, or that this analysis does not know.

    With `sums` (a backward program), a reduction or contraction over the batch axis makes a
    sum over the batch (`SUM`), which may then only be transformed additively. `record`
    collects every variable's axis (see `Axes`). `outer` maps a call body's inputs to the
    caller's operands (see `_constant_along`)."""
    record = Axes() if record is None else record
    env: dict = {v: a for v, a in zip(jaxpr.invars, in_axes)}
    for v, a in env.items():
        record._put(record.of, v, a)
    producer = _producers(jaxpr)
    outer = {} if outer is None else outer

    def axis(v):
        return None if compat.is_literal(v) else env.get(v)

    def constant_along(v, a) -> bool:
        """Whether `v` (independent of the batched inputs) is constant along its axis `a`."""
        return _constant_along(v, a, producer, outer, record)

    def fail(eqn, why):
        where = compat.source_summary(eqn)
        raise NotSeparable(f"{eqn.primitive.name}{f' at {where}' if where else ''}: {why}")

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
            out_axes = batch_axes(sub, axes, batch, sums=sums, record=record,
                                  outer=_outer(sub.invars, eqn.invars, producer, outer))
        elif name == "cond":
            out_axes = _cond_axes(eqn, axes, batch, sums, record, fail, producer, outer)
        elif any(a is SUM for a in axes):
            out_axes = _sum_axes(eqn, axes, producer, fail)
        elif name == "optimization_barrier":
            out_axes = list(axes)
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
            if axes[0] in red and sums and name == "reduce_sum":
                out_axes = [SUM]
            elif axes[0] in red:
                fail(eqn, "reduces over the batch axis")
            else:
                out_axes = [axes[0] - sum(d < axes[0] for d in red)] * len(outs)
        elif name in CUMULATIVE:
            if eqn.params["axis"] == axes[0]:
                fail(eqn, "accumulates along the batch axis")
            out_axes = [axes[0]]
        elif name == "dot_general":
            out_axes = [dot_axis(eqn, axes, constant_along, fail, sums=sums)]
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
                if a is not None and a is not SUM and _shape(v)[a] % batch:
                    fail(eqn, "the batch axis changed length")
                env[v] = a
                record._put(record.of, v, a)
    return [axis(v) for v in jaxpr.outvars]


def _constant_along(v, a, producer, outer, record) -> bool:
    """Whether `v`, which depends on no batched input, is constant along its axis `a`: made
    by broadcasts (along `a`), iotas (along another axis) and elementwise ops of such values,
    looked for through calls (`outer` maps a call body's inputs to the caller's operands).
    Each value found so is recorded as meeting the batch axis there (`Axes.meets`)."""
    if compat.is_literal(v) or not _shape(v) or _shape(v)[a] == 1:
        return True
    eqn = producer.get(v)
    if eqn is None:
        if v in outer:  # a call body's input: the caller's operand
            u, u_producer, u_outer = outer[v]
            if _constant_along(u, a, u_producer, u_outer, record):
                record._put(record.meets, v, a)
                return True
        return False  # an input or a const: it may vary along the axis
    record._put(record.meets, v, a)
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        dims = tuple(eqn.params["broadcast_dimensions"])
        if a not in dims:
            return True
        return _constant_along(eqn.invars[0], dims.index(a), producer, outer, record)
    if name == "iota":
        return eqn.params["dimension"] != a
    if name in ELEMENTWISE:
        # Operands of the output's rank (JAX broadcasts their size-1 axes: those are
        # constant along `a`); scalars are.
        return all(_constant_along(u, a, producer, outer, record) for u in eqn.invars
                   if not compat.is_literal(u) and len(_shape(u)) == len(_shape(v)))
    if name == "transpose":
        return _constant_along(eqn.invars[0], tuple(eqn.params["permutation"])[a], producer,
                               outer, record)
    if name in ("reshape", "squeeze", "expand_dims") and len(eqn.invars) == 1:
        # Only size-1 axes added or removed: axis `a` is the operand's same non-1 axis.
        src, dst = _shape(eqn.invars[0]), _shape(v)
        src_big = [i for i, n in enumerate(src) if n != 1]
        dst_big = [i for i, n in enumerate(dst) if n != 1]
        if [src[i] for i in src_big] != [dst[i] for i in dst_big]:
            return False
        return _constant_along(eqn.invars[0], src_big[dst_big.index(a)], producer, outer,
                               record)
    sub = call_jaxpr(eqn)
    if sub is not None:
        sv = sub.outvars[list(eqn.outvars).index(v)]
        return _constant_along(sv, a, _producers(sub),
                               _outer(sub.invars, eqn.invars, producer, outer), record)
    return False


def _outer(sub_invars, operands, producer, outer) -> dict:
    """A call body's `outer` map (see `_constant_along`): each of its inputs to the caller's
    operand, with the caller's producers and its own `outer`."""
    return {si: (u, producer, outer) for si, u in zip(sub_invars, operands)}


def _cond_axes(eqn, axes, batch, sums, record, fail, producer, outer):
    """A `cond` on a batch-independent index (a `platform_dependent` choice, say): each
    branch is analysed on the operands, and all must agree."""
    if axes[0] is not None:
        fail(eqn, "branches on a batched value")
    outs = None
    for br in eqn.params["branches"]:
        j = compat.jaxpr_and_consts(br)[0]
        got = batch_axes(j, axes[1:], batch, sums=sums, record=record,
                         outer=_outer(j.invars, eqn.invars[1:], producer, outer))
        if outs is not None and got != outs:
            fail(eqn, "branches give different batch axes")
        outs = got
    return outs


def is_zero(v, producer) -> bool:
    """Whether `v` is provably all zeros (a literal 0, or a broadcast or cast of one)."""
    while True:
        if compat.is_literal(v):
            try:
                return bool(np.all(np.asarray(v.val) == 0))
            except Exception:  # noqa: BLE001 - not a number
                return False
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in (
                "broadcast_in_dim", "convert_element_type", "reshape", "copy", "copy_p"):
            return False
        v = eqn.invars[0]


def _sum_axes(eqn, axes, producer, fail):
    """The axes of an equation with an operand that is a sum over the batch (`SUM`): a sum
    stays one through additive maps only (see the module docstring)."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)

    def sum_or_zero(i):
        return axes[i] is SUM or (axes[i] is None and is_zero(eqn.invars[i], producer))

    if any(a is not None and a is not SUM for a in axes):
        fail(eqn, "combines a sum over the batch with batched rows")
    if name in _LINEAR_UNARY or name in ("broadcast_in_dim", "reshape", "transpose",
                                         "squeeze", "reduce_sum", "rev", "cumsum", "slice",
                                         "split", "expand_dims"):
        if any(a is not None for a in axes[1:]) and name not in _LINEAR_UNARY:
            fail(eqn, "a dynamic shape from a sum over the batch")
        return [SUM] * n_out
    if name in ("add", "sub", "add_any", "concatenate"):
        if all(sum_or_zero(i) for i in range(len(axes))):
            return [SUM] * n_out
        fail(eqn, "adds a batch-independent value to a sum over the batch")
    if name == "mul" and sum(a is SUM for a in axes) == 1:
        return [SUM]
    if name == "div" and axes[0] is SUM and axes[1] is None:
        return [SUM]
    if name == "select_n" and axes[0] is None and all(
            sum_or_zero(i) for i in range(1, len(axes))):
        return [SUM]
    if name == "pad" and axes[0] is SUM and sum_or_zero(1):
        return [SUM]
    if name == "dot_general" and sum(a is SUM for a in axes) == 1:
        return [SUM]
    if name == "optimization_barrier":
        return list(axes)
    fail(eqn, "a nonlinear function of a sum over the batch")


def dot_axis(eqn, axes, constant_along, fail, sums=False):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    la, ra = axes
    lhs, rhs = eqn.invars
    if sums and ((la is not None and la in lc) or (ra is not None and ra in rc)):
        # A contraction over the batch axis: a sum over the batch when the other operand
        # is batched at the same contracted position, or constant along it.
        i = lc.index(la) if la is not None and la in lc else rc.index(ra)
        if la is not None and ra is not None and (la not in lc or rc[i] != ra):
            fail(eqn, "operands batched along different axes")
        if la is None and not constant_along(lhs, lc[i]):
            fail(eqn, "an operand that does not depend on the batch varies along it")
        if ra is None and not constant_along(rhs, rc[i]):
            fail(eqn, "an operand that does not depend on the batch varies along it")
        return SUM
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


def check_backward(jaxpr, in_axes: Sequence, batch: int,
                   out_batched: Sequence[bool]) -> Axes:
    """Whether the backward program `jaxpr` may run in slices of the batch and its slices'
    cotangents be concatenated (``out_batched[i]``: output i, a batched input's cotangent)
    or summed (every other output: a parameter's). Returns what the analysis found; raises
    `NotSeparable` naming the equation or output that forbids it."""
    record = Axes()
    outs = batch_axes(jaxpr, in_axes, batch, sums=True, record=record)
    producer = _producers(jaxpr)
    for i, (v, a, b) in enumerate(zip(jaxpr.outvars, outs, out_batched)):
        if not compat.is_literal(v) and v.aval.dtype == _FLOAT0:
            continue
        if a is None and is_zero(v, producer):
            continue
        if b and a != 0:
            raise NotSeparable(f"the cotangent of batched input {i} is not batched along "
                               f"its leading axis (axis {a})")
        if not b and a is not SUM:
            what = "batched" if a is not None else "independent of the batch"
            raise NotSeparable(f"the cotangent of unbatched input {i} is not a sum over the "
                               f"batch's rows ({what})")
    return record


def _array_equal(a, b) -> bool:
    """Whether two constants (arrays or scalars) are equal in dtype, shape and value; a
    traced value only to itself."""
    if a is b:
        return True
    try:
        x, y = np.asarray(a), np.asarray(b)
    except Exception:  # noqa: BLE001 - a tracer or an opaque value: not provably equal
        return False
    if x.dtype == y.dtype == _FLOAT0:  # no values: an integer input's zero cotangent
        return x.ndim == y.ndim
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    try:
        return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    except TypeError:
        return bool(np.array_equal(x, y))


def _without_identities(jaxpr) -> tuple[list, dict]:
    """`jaxpr`'s equations less its identity reshapes (to the operand's own shape, which JAX
    emits or not depending on its trace caches), and the variable each of those stands for."""
    alias: dict = {}
    eqns = []
    for e in jaxpr.eqns:
        u = e.invars[0] if e.invars else None
        if (e.primitive.name == "reshape" and len(e.invars) == 1 and not compat.is_literal(u)
                and e.params.get("dimensions") is None
                and tuple(e.params["new_sizes"]) == _shape(u)):
            alias[e.outvars[0]] = alias.get(u, u)
            continue
        eqns.append(e)
    return eqns, alias


# Params that hold an equation's output shape (or its bound along each axis): they may be `k`
# times smaller at a slice at the position of the output's batch axis, and nowhere else.
_SHAPE_PARAMS = frozenset(("shape", "new_sizes", "limit_indices"))
# Params that place values on devices and never change them: a block traced at a slice of a
# sharded batch holds other shardings (its slice's), and computes the same rows.
_LAYOUT_PARAMS = frozenset(("sharding", "out_sharding", "in_shardings", "out_shardings",
                            "in_layouts", "out_layouts"))


def same_program(full, sliced, k: int, axes: Axes | None = None, consts_full=(),
                 consts_sliced=(), explain: list | None = None) -> bool:
    """Whether `sliced` (a jaxpr traced at 1/`k` of the batch) is `full` (the one analysed,
    which found `axes`) with its batch axes `k` times shorter: the same equations, wired the
    same way, with the same dtypes, equal constants (`consts_full` / `consts_sliced`, the
    values of their constvars), literals and params, and a shape or shape param `k` times
    smaller only at a variable's batch axis (`Axes.batch_axis`). `explain`, a list, gets
    the first difference found."""
    axes = Axes() if axes is None else axes

    def differ(what, e=None) -> bool:
        if explain is not None:
            explain.append(f"{e.primitive.name}: {what}" if e is not None else what)
        return False

    def same_value(a, b) -> bool:
        if isinstance(a, compat._JAXPR_TYPES) or isinstance(b, compat._JAXPR_TYPES):
            if type(a) is not type(b):
                return False
            (ja, ca), (jb, cb) = compat.jaxpr_and_consts(a), compat.jaxpr_and_consts(b)
            return same_jaxpr(ja, jb, ca, cb)
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same_value(a[x], b[x]) for x in a)
        if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
            return _array_equal(a, b)
        try:
            if bool(a == b):
                return True
        except Exception:  # noqa: BLE001 - values that do not compare: not provably the same
            return False
        return _same_rule(a, b)

    def same_shape(sa, sb, a) -> bool:
        """Equal, but at position `a` (a batch axis, or None) where `sa` is `k` times `sb`."""
        sa, sb = tuple(sa), tuple(sb)
        if len(sa) != len(sb):
            return False
        return all(x == y or (i == a and x == k * y) for i, (x, y) in enumerate(zip(sa, sb)))

    def same_aval(u, v) -> bool:
        au, av = u.aval, v.aval
        if getattr(au, "dtype", None) != getattr(av, "dtype", None):
            return False
        if au.dtype == _FLOAT0:  # no values (see `_array_equal`)
            return len(au.shape) == len(av.shape)
        return same_shape(getattr(au, "shape", ()), getattr(av, "shape", ()),
                          axes.batch_axis(u))

    def same_params(e1, e2) -> bool:
        if e1.params.keys() != e2.params.keys():
            return False
        outs = [v for v in e1.outvars if not compat.is_dropvar(v)]
        a = axes.batch_axis(outs[0]) if outs else None
        for key in e1.params:
            x, y = e1.params[key], e2.params[key]
            if key in _LAYOUT_PARAMS:
                continue
            if key in _SHAPE_PARAMS and isinstance(x, (tuple, list)) \
                    and isinstance(y, (tuple, list)) \
                    and all(isinstance(i, (int, np.integer)) for i in (*x, *y)):
                if not same_shape(x, y, a):
                    return differ(f"param {key} {x} vs {y} (batch axis {a})", e1)
            elif not same_value(x, y):
                return differ(f"param {key} differs", e1)
        return True

    def same_jaxpr(j1, j2, c1=(), c2=()) -> bool:
        (eqns1, alias1), (eqns2, alias2) = _without_identities(j1), _without_identities(j2)
        n1 = (len(eqns1), len(j1.invars), len(j1.outvars), len(j1.constvars))
        n2 = (len(eqns2), len(j2.invars), len(j2.outvars), len(j2.constvars))
        if n1 != n2:
            return differ(f"(equations, inputs, outputs, constants) {n1} vs {n2}")
        if len(c1) != len(c2) or not all(_array_equal(x, y) for x, y in zip(c1, c2)):
            return differ("a constant differs")
        m = {}
        for u, v in zip([*j1.constvars, *j1.invars], [*j2.constvars, *j2.invars]):
            if not same_aval(u, v):
                return False
            m[u] = v

        def same_atom(u, v):
            if compat.is_literal(u) or compat.is_literal(v):
                return (compat.is_literal(u) and compat.is_literal(v)
                        and _array_equal(u.val, v.val))
            return m.get(alias1.get(u, u)) is alias2.get(v, v)

        for e1, e2 in zip(eqns1, eqns2):
            if e1.primitive is not e2.primitive or len(e1.invars) != len(e2.invars) \
                    or len(e1.outvars) != len(e2.outvars):
                return differ(f"another equation ({e2.primitive.name})", e1)
            if not all(same_atom(u, v) for u, v in zip(e1.invars, e2.invars)):
                return differ("other operands (a literal or the wiring)", e1)
            if not same_params(e1, e2):
                return False
            for u, v in zip(e1.outvars, e2.outvars):
                if compat.is_dropvar(u) != compat.is_dropvar(v):
                    return differ("another output", e1)
                if not compat.is_dropvar(u):
                    if not same_aval(u, v):
                        return differ(f"output {u.aval.str_short()} vs {v.aval.str_short()} "
                                      f"(batch axis {axes.batch_axis(u)})", e1)
                    m[u] = v
        return all(same_atom(u, v) for u, v in zip(j1.outvars, j2.outvars))

    return same_jaxpr(full, sliced, consts_full, consts_sliced)
