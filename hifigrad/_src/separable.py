"""Which values of a program are computed row by row along the batch axis: one abstract
interpretation over one lattice, with its rules in one registry keyed by primitive.

A recomputed block's backward may run in slices of the batch (`checkpoint`'s
``backward_slices``): each slice re-runs the block *resized* to its rows (`resize.py`: every
equation re-bound with its batch axis `k` times shorter), and the slices' cotangents are
concatenated (activations) or summed (parameters). That is right exactly when every value the
resized program computes is the restriction of the full program's value to the slice's rows.
This module decides which values are, from the block's jaxpr, by giving each variable a type:

``None`` (*unbatched*)
    The value is not resized: the slice computes it by the same equations from the same
    unbatched values, so it is the full program's value, bit for bit.
an axis ``a`` (*batched*)
    The value's axis ``a`` is ``batch * m`` long, batch-major (a batch row owns ``m``
    consecutive positions: ``m > 1`` once the batch is merged with minor axes, as in
    ``[B, T, D] -> [B*T, D]``), and the resized value is the full one restricted to the
    slice's rows along it. *Every* resized value is batched, whatever it depends on: an
    ``ones(h.shape[:2])`` mask that meets the batch is batched, and so is every other use of
    it (its sum over the batch axis mixes rows). Nothing is resized that is not batched.
`SUM` (backward programs only)
    The value is a sum over the batch's rows of per-row terms, not resized: the slices' values
    add up to the full one (a parameter's cotangent). It stays one only through additive maps.
`Mix` (*mixing*)
    Anything else: reduced, accumulated, sorted or gathered across the batch axis, computed
    from a sum over the batch nonlinearly, made by a primitive with no rule. A mixing value
    must reach no output that the slices need.

Types flow forward through each equation by its primitive's rule (`RULES`, keyed by
primitive; JAX's own batching registry is the evidence for the elementwise ones, see
`compat.batching_kind`). A primitive without a rule makes its outputs mixing whenever an
operand is batched. No equation is skipped: one whose operands are all unbatched is unbatched
only because its result does not depend on which rows a slice holds.

Batchedness also flows *back from uses*: when an unbatched operand must be batched for an
equation to be row-wise (``mask * x``, ``mask`` of shape ``[B, T]`` unbatched, ``x`` batched),
the rule *demands* it, and the analysis runs again with that variable forced batched, until
no new demand arises (a fixpoint: demands only add batchedness). The producer of a forced
value must then make it row by row: a broadcast along the batch axis does, an iota along it
(the row's position) does not, and a value that also feeds a reduction over the batch axis is
mixing there. A block input may be forced too (positions or segment ids ``[B, T]`` sliced with
the activations, a per-row weight); a program constant may not.

`check_backward` runs the same analysis on the block's backward program, where reductions and
contractions over the batch axis make `SUM`s, and checks that every batched input's
cotangent is batched along the same axis and every other input's is a `SUM` (or zero).
`same_program` checks that a program traced at the slice's size is the analysed one with
exactly its batched axes `k` times shorter (the backward of the resized block, whose custom
rules ran as the user wrote them, against the analysed backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from . import compat

_FLOAT0 = np.dtype(jax.dtypes.float0)


class NotSeparable(Exception):
    """The program mixes rows along the batch axis, or this analysis cannot show it does not."""


class _Sum:
    """The type of a value that is a sum over the batch's rows of per-row terms."""

    def __repr__(self):
        return "SUM"


SUM = _Sum()


class Mix:
    """The type of a mixing value; ``why`` names the equation that made it and the reason."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def __repr__(self):
        return f"Mix({self.why!r})"


class Position(Mix):
    """The row's position along the batch axis (an iota along it), as an index: ``x[arange(B),
    idx]``, MaxText's ``w.at[arange(B)[:, None, None], arange(T)[:, None], idx]``. At a slice
    the iota is the slice's own (0 to B/k - 1): as an index into a value batched along that
    axis it picks the slice's own rows, so a gather or scatter by it is row by row. Any other
    use (a mask ``arange(B) < n``, a key folded in) would see other positions at a slice: for
    every rule that does not know it (`_POSITION_RULES`), it is mixing.

    ``axis``: the axis along which the value is the position; ``comp``: for an index array
    whose last axis holds index vectors, the component that is the position (None: the value
    itself); ``rest``: the type of the other components (None or ``axis``); ``derived``: a
    piece of JAX's normalization of negative indices (`_pos_normalized`); ``ids``: not the
    row's position but an injective labeling of the batch's elements, batch-major (an iota
    over the batch merged with other axes: JAX's scatter JVP scatters such ids and compares
    them to see which update won), which only moves and equality may read (`_ids_rule`)."""

    __slots__ = ("axis", "comp", "rest", "derived", "ids")

    def __init__(self, why: str, axis: int, comp: int | None = None, rest=None,
                 derived: bool = False, ids: bool = False):
        super().__init__(why)
        self.axis, self.comp, self.rest, self.derived, self.ids = axis, comp, rest, derived, ids

    def __repr__(self):
        return (f"Position(axis={self.axis}, comp={self.comp}, rest={self.rest}"
                f"{', derived' if self.derived else ''}{', ids' if self.ids else ''})")

    def _key(self):
        return (self.axis, self.comp, self.rest, self.derived, self.ids)

    def __eq__(self, other):
        return isinstance(other, Position) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


_CONFLICT = "conflict"  # a variable demanded batched along two axes


def is_axis(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _producers(jaxpr) -> dict:
    """The equation that makes each variable of `jaxpr`."""
    return {v: e for e in jaxpr.eqns for v in e.outvars if not compat.is_dropvar(v)}


class Typing:
    """What the analysis found for one jaxpr at one call site: ``of[v]``, the type of each of
    its variables, and ``subs[i][j]``, the `Typing` of the j-th jaxpr in equation i's params
    (`compat.jaxprs_in_params` order) wherever the analysis looked into it."""

    def __init__(self, jaxpr, consts, batch: int, path: tuple):
        self.jaxpr, self.consts, self.batch, self.path = jaxpr, list(consts), batch, path
        self.of: dict = {}
        self.subs: dict = {}
        self.fatal: list[Mix] = []  # (the root's) effects on batched values
        self._producer = None

    def type(self, v):
        return None if compat.is_literal(v) else self.of.get(v)

    def axis(self, v) -> int | None:
        """The batch axis of `v` (a `Position` is batch-long along its axis too: it is
        resized), or None."""
        t = self.type(v)
        if isinstance(t, Position):
            return t.axis
        return int(t) if is_axis(t) else None

    def sub(self, i: int, j: int) -> Typing | None:
        return self.subs.get(i, {}).get(j)

    @property
    def in_types(self) -> list:
        return [self.type(v) for v in self.jaxpr.invars]

    @property
    def out_types(self) -> list:
        return [self.type(v) for v in self.jaxpr.outvars]

    def producer(self) -> dict:
        if self._producer is None:
            self._producer = _producers(self.jaxpr)
        return self._producer

    def involved(self, i: int) -> bool:
        """Whether equation i takes or makes a batched value (it is resized)."""
        eqn = self.jaxpr.eqns[i]
        return i in self.subs or any(
            self.axis(v) is not None for v in (*eqn.invars, *eqn.outvars)
            if not compat.is_dropvar(v) and not compat.is_literal(v))


# ------------------------------------------------------------------------------ the registry

class Rule(NamedTuple):
    """How a primitive's outputs are typed from its operands' (``types(cx, eqn, ins, want)``,
    ``want[i]``: the axis output i is demanded batched along, or None), how a `SUM` operand
    passes (``linear(cx, eqn, ins)``; None: it does not), and which params hold its output's
    shape (``resize(eqn, typing, k)``: the params at a slice; None: no shape params)."""

    types: Callable
    linear: Callable | None = None
    resize: Callable | None = None


RULES: dict = {}


def register(prims, types, linear=None, resize=None) -> None:
    """Registers a `Rule` for each primitive of `prims` (missing ones, None, skipped)."""
    for p in prims if isinstance(prims, (list, tuple)) else [prims]:
        if p is not None:
            RULES[p] = Rule(types, linear, resize)


def _named(*names):
    return compat.primitives_named(names)


def rule_for(prim) -> Rule | None:
    rule = RULES.get(prim)
    if rule is not None:
        return rule
    kind = compat.batching_kind(prim)
    if kind == "broadcast":
        return _BROADCASTING
    if kind == "vectorized":
        return _VECTORIZED
    return None


# ------------------------------------------------------------------------------ the analysis

class _Cx:
    """What a rule sees: the equation's place, its operands' shapes, and `demand`."""

    def __init__(self, pas: _Pass, typing: Typing, index: int, eqn):
        self.pas, self.typing, self.index, self.eqn = pas, typing, index, eqn
        self.batch, self.sums = pas.batch, pas.sums

    def shape(self, j: int) -> tuple:
        return _shape(self.eqn.invars[j])

    def out_shape(self, j: int = 0) -> tuple:
        return _shape(self.eqn.outvars[j])

    def mix(self, why: str) -> Mix:
        where = compat.source_summary(self.eqn)
        return Mix(f"{self.eqn.primitive.name}{f' at {where}' if where else ''}: {why}")

    def demand(self, j: int, axis: int) -> bool:
        """Asks for operand j, unbatched, to be batched along `axis`: True if it is (or will
        be, once the analysis runs again), False if it cannot be (a literal, a constant, an
        input the caller does not let be sliced, a value batched otherwise)."""
        return self.pas.demand(self.typing, self.eqn.invars[j], axis)

    def zero(self, j: int) -> bool:
        return is_zero(self.eqn.invars[j], self.typing.producer())

    def sub(self, j: int, closed, ins: Sequence, operands: Sequence, want: Sequence,
            shift: Sequence[int] | None = None) -> list:
        """The output types of `closed` (the equation's j-th jaxpr) on operands of types
        `ins`, its outputs demanded as `want`. `shift[i]`: how many axes operand i has
        before the sub-program's input i (a scan's ``xs``: the scanned axis), so that a
        demand from inside reaches the operand at the right axis."""
        return self.pas.sub(self, j, closed, ins, operands, want, shift)


class _Pass:
    """One pass of the analysis over a program, with the demands known so far (`forced`,
    keyed by the path of the jaxpr: (equation index, jaxpr index) from the root)."""

    def __init__(self, batch: int, sums: bool, forced: dict, free):
        self.batch, self.sums, self.forced, self.free = batch, sums, forced, free
        self.requests: list = []
        self.fatal: list[Mix] = []
        self.root_invars: set = set()

    def demand(self, typing: Typing, v, axis: int) -> bool:
        if compat.is_literal(v) or not is_axis(axis):
            return False
        t = typing.type(v)
        if is_axis(t):
            return int(t) == int(axis)
        if t is not None:
            return False
        shape = _shape(v)
        if axis >= len(shape) or shape[axis] % self.batch or shape[axis] == 0:
            return False
        if v in typing.jaxpr.constvars:
            return False
        if typing.path == () and v in self.root_invars and not self.free(v):
            return False
        cur = self.forced.get(typing.path, {}).get(v)
        if cur is not None and cur != axis:
            return False
        self.requests.append((typing.path, v, int(axis)))
        return True

    def run(self, jaxpr, consts, in_types: Sequence, path: tuple) -> Typing:
        typing = Typing(jaxpr, consts, self.batch, path)
        forced = self.forced.get(path, {})
        if path == ():
            self.root_invars = set(jaxpr.invars)
        for v in jaxpr.constvars:
            typing.of[v] = None
        for v, t in zip(jaxpr.invars, in_types):
            f = forced.get(v)
            if f is _CONFLICT:
                t = Mix("an input demanded batched along two axes")
            elif f is not None and t is None:
                # demanded by a use; a sub-jaxpr's caller makes its operand batched (`sub`)
                t = f if (path != () or self.free(v)) else Mix(
                    "an input that is not sliced meets the batch")
            elif f is not None and f != t:
                t = Mix("an input batched along two axes")
            typing.of[v] = t
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [typing.type(v) for v in eqn.invars]
            want = [None if compat.is_dropvar(v) else forced.get(v) for v in eqn.outvars]
            cx = _Cx(self, typing, i, eqn)
            outs = self._eqn(cx, eqn, ins, want)
            if any(t is not None for t in ins) and compat.side_effects(eqn):
                self.fatal.append(cx.mix("has effects on batched values"))
            for v, t, w in zip(eqn.outvars, outs, want):
                if compat.is_dropvar(v):
                    continue
                if w is _CONFLICT:
                    t = cx.mix("a value demanded batched along two axes")
                elif w is not None and not isinstance(t, Mix) and t != w:
                    t = cx.mix(
                        "a value the batch meets is not made row by row" if t is None else
                        f"a value batched along axis {t} is demanded along axis {w}")
                if is_axis(t):
                    s = _shape(v)
                    if t >= len(s) or s[t] % self.batch or not s[t]:
                        t = cx.mix("the batch axis changed length")
                typing.of[v] = t
        return typing

    def _eqn(self, cx: _Cx, eqn, ins: list, want: list) -> list:
        n = len(eqn.outvars)
        mixes = [t for t in ins if isinstance(t, Mix)]
        if any(isinstance(t, Position) for t in mixes):
            prule = _POSITION_RULES.get(eqn.primitive)
            outs = prule(cx, eqn, ins, want) if prule is not None else None
            if outs is None:
                outs = _ids_rule(cx, eqn, ins, want)
            if outs is not None:
                return outs
            pos = next(t for t in mixes if isinstance(t, Position))
            return [Mix(pos.why)] * n  # a plain mix: no other use keeps the position
        if mixes:
            return [mixes[0]] * n
        if all(t is None for t in ins) and all(w is None for w in want):
            return [None] * n  # made from unbatched values alone: the same in every slice
        rule = rule_for(eqn.primitive)
        if any(t is SUM for t in ins):
            if not self.sums:
                return [cx.mix("a sum over the batch in a forward program")] * n
            if rule is None or rule.linear is None:
                return [cx.mix("a nonlinear function of a sum over the batch")] * n
            if any(w is not None for w in want):
                return [cx.mix("a sum over the batch demanded batched")] * n
            return rule.linear(cx, eqn, ins)
        if rule is None:
            return [cx.mix("no rule for this primitive on batched values")] * n
        return rule.types(cx, eqn, ins, want)

    def sub(self, cx: _Cx, j: int, closed, ins, operands, want, shift=None) -> list:
        jaxpr, consts = compat.jaxpr_and_consts(closed)
        path = (*cx.typing.path, (cx.index, j))
        forced = self.forced.get(path, {})
        sub_ins = []
        shift = [0] * len(ins) if shift is None else shift
        for u, t, op, sh in zip(jaxpr.invars, ins, operands, shift):
            f = forced.get(u)
            if is_axis(f) and t is None:
                # the body needs this input batched: so must the caller's operand be
                t = f if self.demand(cx.typing, op, f + sh) else cx.mix(
                    "a call's operand that cannot be batched meets the batch inside it")
            sub_ins.append(t)
        child = self.run(jaxpr, consts, sub_ins, path)
        cx.typing.subs.setdefault(cx.index, {})[j] = child
        outs = []
        for v, w in zip(jaxpr.outvars, want):
            t = child.type(v)
            if is_axis(w) and t is None:
                t = w if self.demand(child, v, w) else cx.mix(
                    "a call's result the batch meets is not made row by row")
            outs.append(t)
        return outs


def analyse(jaxpr, in_types: Sequence, batch: int, *, consts=(), sums: bool = False,
            free: Callable | Sequence[bool] | None = None,
            want: Sequence | None = None) -> Typing:
    """Types every variable of `jaxpr` (nested jaxprs included) given its inputs' types
    (`in_types`: an axis or None each; with `sums`, `SUM` too), a batch axis being `batch`
    rows long (times `m` once merged). ``free`` says which unbatched inputs a use may demand
    batched (a callable of the input variable, or one bool per input; default: all);
    `consts` are the values of `jaxpr`'s constvars; ``want`` demands outputs batched (an
    axis or None each). Never raises for a mixing program: the types say where it mixes
    (`Mix`), and ``typing.fatal`` lists effects on batched values."""
    if free is None:
        free_fn = lambda v: True  # noqa: E731
    elif callable(free):
        free_fn = free
    else:
        allowed = {v for v, f in zip(jaxpr.invars, free) if f}
        free_fn = allowed.__contains__
    forced: dict = {}
    for v, w in zip(jaxpr.outvars, want or ()):
        if is_axis(w) and not compat.is_literal(v):
            forced.setdefault((), {})[v] = int(w)
    for _ in range(10_000):
        pas = _Pass(batch, sums, forced, free_fn)
        typing = pas.run(jaxpr, consts, list(in_types), ())
        new = False
        for path, v, a in pas.requests:
            here = forced.setdefault(path, {})
            cur = here.get(v)
            if cur is None:
                here[v] = a
                new = True
            elif cur != a and cur is not _CONFLICT:
                here[v] = _CONFLICT
                new = True
        if not new:
            typing.fatal = pas.fatal
            return typing
    raise NotSeparable("the batch-axis analysis did not settle")  # pragma: no cover


def batch_axes(jaxpr, in_axes: Sequence, batch: int, *, sums: bool = False) -> list:
    """The type of each output of `jaxpr` (an axis, None, or `SUM`), its inputs typed
    `in_axes`, no unbatched input demanded batched; raises `NotSeparable` naming where an
    output mixes rows or where an effect meets the batch."""
    typing = analyse(jaxpr, in_axes, batch, sums=sums, free=[False] * len(jaxpr.invars))
    if typing.fatal:
        raise NotSeparable(typing.fatal[0].why)
    outs = typing.out_types
    for t in outs:
        if isinstance(t, Mix):
            raise NotSeparable(t.why)
    return outs


def is_zero(v, producer) -> bool:
    """Whether `v` is provably all zeros (a literal 0, or a broadcast, cast or reshape of
    one), float0 values included."""
    while True:
        if np.dtype(getattr(v.aval, "dtype", np.float32)) == _FLOAT0:
            return True  # no values (an integer input's cotangent, a literal one included)
        if compat.is_literal(v):
            try:
                return bool(np.all(np.asarray(v.val) == 0))
            except Exception:  # noqa: BLE001 - not a number
                return False
        eqn = producer.get(v)
        if eqn is None or eqn.primitive.name not in (
                "broadcast_in_dim", "convert_element_type", "reshape", "copy", "copy_p",
                "transpose", "squeeze"):
            return False
        v = eqn.invars[0]


def check_backward(jaxpr, in_types: Sequence, batch: int, n_args: int, *, consts=()) -> Typing:
    """Whether the backward program `jaxpr` may run in slices of the batch: its first
    `n_args` inputs are the block's (typed `in_types[:n_args]`, as the forward's analysis
    found them), the rest the cotangents of its outputs; its outputs are the block inputs'
    cotangents, one each. Each batched input's cotangent must be batched along the same axis
    (the slices' rows are concatenated) and each other's a `SUM` or zero (the slices' are
    added up). No input is demanded batched here: what is sliced was decided by the forward.
    Returns the typing; raises `NotSeparable` naming the equation or output that forbids it."""
    # Each batched input's cotangent is demanded batched along the input's axis: one that is
    # zeros (a mask used through `where`, an input a custom_vjp's backward returns None for)
    # is then typed as made at the slice's size, as the backward at a slice makes it.
    want = [t if is_axis(t) and np.dtype(v.aval.dtype) != _FLOAT0 else None
            for v, t in zip(jaxpr.outvars, in_types[:n_args])]
    typing = analyse(jaxpr, in_types, batch, consts=consts, sums=True,
                     free=[False] * len(jaxpr.invars), want=want)
    if typing.fatal:
        raise NotSeparable(typing.fatal[0].why)
    producer = typing.producer()
    for i, (v, t_in) in enumerate(zip(jaxpr.outvars, in_types[:n_args])):
        t = typing.type(v)
        if np.dtype(v.aval.dtype) == _FLOAT0:  # a literal one too (NNX's rng counter's)
            continue
        if t is None and is_zero(v, producer):
            continue
        if isinstance(t, Mix):
            raise NotSeparable(t.why)
        if is_axis(t_in):
            if not (is_axis(t) and t == t_in):
                raise NotSeparable(f"the cotangent of batched input {i} is not batched along "
                                   f"its axis {t_in} ({t})")
        elif t is not SUM:
            what = "batched" if is_axis(t) else "independent of the batch"
            raise NotSeparable(f"the cotangent of unbatched input {i} is not a sum over the "
                               f"batch's rows ({what})")
    return typing


# ------------------------------------------------------------------------------ the rules

def _common(cx: _Cx, ins, want, operands=None):
    """The one axis the batched operands (those of `operands`, default all) and the demanded
    outputs share: an axis, None (none batched), or a `Mix`."""
    idx = range(len(ins)) if operands is None else operands
    axes = {int(ins[j]) for j in idx if is_axis(ins[j])} | {int(w) for w in want if is_axis(w)}
    if len(axes) > 1:
        return cx.mix("operands batched along different axes")
    return axes.pop() if axes else None


def _demand_all(cx: _Cx, ins, a: int, operands) -> Mix | None:
    """Demands each unbatched operand of `operands` that extends along axis `a` batched."""
    for j in operands:
        if ins[j] is None and cx.shape(j)[a] != 1 and not cx.demand(j, a):
            return cx.mix("an operand that does not depend on the batch varies along it")
    return None


def _broadcasting_types(cx: _Cx, eqn, ins, want):
    """n-ary elementwise ops (JAX's broadcasting batchers, `select_n`, `clamp`, casts, ...):
    operands of the output's rank (size-1 axes broadcast) or scalars."""
    n = len(eqn.outvars)
    a = _common(cx, ins, want)
    if a is None or isinstance(a, Mix):
        return [a] * n
    r = len(cx.out_shape())
    if a >= r:
        return [cx.mix("the batch axis is not an axis of the result")] * n
    length = cx.out_shape()[a]
    ops = []
    for j, v in enumerate(eqn.invars):
        s = _shape(v)
        if not s:
            continue  # a scalar, broadcast
        if len(s) != r:
            return [cx.mix("operands of different ranks")] * n
        if s[a] == 1:
            continue  # broadcast along the batch axis: the same for every row
        if s[a] != length:
            return [cx.mix("operands of different lengths along the batch axis")] * n
        ops.append(j)
    bad = _demand_all(cx, ins, a, ops)
    return [bad or a] * n


def _vectorized_types(cx: _Cx, eqn, ins, want):
    """Primitives mapped over every axis of their operands (JAX's vectorized batchers: unary
    elementwise ops, `random_bits` over its keys, `bitcast_convert_type`): the batch axis is
    the same axis of every operand and output; no operand is broadcast along it."""
    n = len(eqn.outvars)
    a = _common(cx, ins, want)
    if a is None or isinstance(a, Mix):
        return [a] * n
    lengths = {_shape(v)[a] if a < len(_shape(v)) else None for v in eqn.outvars}
    lengths |= {_shape(v)[a] if a < len(_shape(v)) else None for v in eqn.invars}
    if len(lengths) != 1 or None in lengths:
        return [cx.mix("the batch axis is not an axis of every operand and result")] * n
    bad = _demand_all(cx, ins, a, range(len(ins)))
    return [bad or a] * n


def _linear_unary(cx: _Cx, eqn, ins):
    """Linear in its first operand, the others (indices, sizes) unbatched: a sum stays one."""
    if ins[0] is SUM and all(t is None for t in ins[1:]):
        return [SUM] * len(eqn.outvars)
    return [cx.mix("a sum over the batch meets another operand")] * len(eqn.outvars)


def _sum_or_zero(cx: _Cx, ins, j) -> bool:
    return ins[j] is SUM or (ins[j] is None and cx.zero(j))


def _linear_additive(cx: _Cx, eqn, ins):
    """Sums of sums (and zeros) are sums; a sum plus anything else is not."""
    if all(_sum_or_zero(cx, ins, j) for j in range(len(ins))):
        return [SUM] * len(eqn.outvars)
    return [cx.mix("adds a value that is not a sum over the batch to one")] * len(eqn.outvars)


def _linear_bilinear(cx: _Cx, eqn, ins):
    """A product of a sum with unbatched values is a sum (of the products)."""
    if sum(t is SUM for t in ins) == 1 and all(t is None or t is SUM for t in ins):
        return [SUM] * len(eqn.outvars)
    return [cx.mix("multiplies a sum over the batch by a batched value or another sum")] * len(
        eqn.outvars)


def _linear_div(cx: _Cx, eqn, ins):
    if ins[0] is SUM and ins[1] is None:
        return [SUM]
    return [cx.mix("divides by a sum over the batch")]


def _linear_select(cx: _Cx, eqn, ins):
    if ins[0] is None and all(_sum_or_zero(cx, ins, j) for j in range(1, len(ins))):
        return [SUM]
    return [cx.mix("selects between a sum over the batch and another value")]


def _linear_barrier(cx: _Cx, eqn, ins):
    return list(ins)


def _linear_cast(cx: _Cx, eqn, ins):
    """A cast is linear only between inexact dtypes (to an integer it truncates each slice's
    partial sum: a different result)."""
    src = np.dtype(eqn.invars[0].aval.dtype)
    dst = np.dtype(eqn.params["new_dtype"])
    if jax.numpy.issubdtype(src, jax.numpy.inexact) and jax.numpy.issubdtype(
            dst, jax.numpy.inexact):
        return [SUM]
    return [cx.mix(f"casts a sum over the batch from {src} to {dst}")]


def _linear_pad(cx: _Cx, eqn, ins):
    if ins[0] is SUM and _sum_or_zero(cx, ins, 1):
        return [SUM]
    return [cx.mix("pads a sum over the batch with a nonzero value")]


def _linear_dus(cx: _Cx, eqn, ins):
    if _sum_or_zero(cx, ins, 0) and _sum_or_zero(cx, ins, 1) and all(
            t is None for t in ins[2:]):
        return [SUM]
    return [cx.mix("updates a sum over the batch with another value")]


_BROADCASTING = Rule(_broadcasting_types)
_VECTORIZED = Rule(_vectorized_types)

# Elementwise primitives JAX batches with its own rules (not `compat.batching_kind`'s).
register([lax.select_n_p, lax.clamp_p, compat.add_jaxvals_p,
          *_named("random_gamma_grad", "polygamma", "igamma_grad_a")], _broadcasting_types)
register([compat.add_jaxvals_p], _broadcasting_types, _linear_additive)
register(_named("add", "sub"), _broadcasting_types, _linear_additive)
register(_named("mul"), _broadcasting_types, _linear_bilinear)
register(_named("div"), _broadcasting_types, _linear_div)
register(_named("neg", "real", "imag", "conj", "reduce_precision"), _vectorized_types,
         _linear_unary)
register([lax.select_n_p], _broadcasting_types, _linear_select)
register([lax.convert_element_type_p], _broadcasting_types, _linear_cast)
register([compat.copy_p, *_named("copy"), compat.name_p, compat.stop_gradient_p,
          compat.sharding_constraint_p, compat.pvary_p], _broadcasting_types, _linear_unary)


# The rules a primitive defined elsewhere (hifigrad's own, `primitives.py`) registers with.
broadcasting_types = _broadcasting_types
linear_unary = _linear_unary


def _identity_each_types(cx: _Cx, eqn, ins, want):
    """Each output is its operand (`optimization_barrier`, `device_put`)."""
    outs = []
    for j, (t, w) in enumerate(zip(ins, want)):
        if is_axis(w) and t is None:
            t = w if cx.demand(j, w) else cx.mix("an operand the batch meets is not batched")
        outs.append(t)
    return outs


register([compat.optimization_barrier_p, compat.device_put_p], _identity_each_types,
         _linear_barrier)
# Collectives inside a `shard_map` act position by position across devices (every device
# slices its own rows at the same positions): a batched operand gives a batched result; the
# linear ones keep a sum over the batch one (a parameter's cotangent summed over devices).
register([*_named("psum", "psum_invariant", "ppermute", "pbroadcast"), compat.pvary_p],
         _identity_each_types, _linear_barrier)
register(_named("pmax", "pmin"), _identity_each_types)


def _broadcast_in_dim_types(cx: _Cx, eqn, ins, want):
    dims = tuple(eqn.params["broadcast_dimensions"])
    if any(t is not None for t in ins[1:]):
        return [cx.mix("a batched dynamic shape")]
    t, w = ins[0], want[0]
    if is_axis(t):
        return [dims[t]]
    if w is None:
        return [None]
    if w in dims:
        i = dims.index(w)
        if cx.shape(0)[i] != 1 and not cx.demand(0, i):
            return [cx.mix("an operand that does not depend on the batch varies along it")]
    return [w]  # a new axis, or a size-1 one: the same for every row


def _resize_out_shape(key):
    def resize(eqn, typing, k):
        a = typing.axis(eqn.outvars[0])
        if a is None:
            return None
        shape = list(eqn.params[key])
        shape[a] //= k
        return dict(eqn.params, **{key: tuple(shape)})
    return resize


register([lax.broadcast_in_dim_p], _broadcast_in_dim_types, _linear_unary,
         _resize_out_shape("shape"))


def _iota_types(cx: _Cx, eqn, ins, want):
    w = want[0]
    if w is None:
        return [None]
    if eqn.params["dimension"] == w:
        where = compat.source_summary(eqn)
        merged = cx.out_shape()[w] != cx.batch  # an iota over the batch and other axes
        return [Position(f"iota{f' at {where}' if where else ''}: the row's position (an iota "
                         f"along the batch axis) used otherwise than to index the batch", w,
                         ids=merged)]
    return [w]


register([lax.iota_p], _iota_types, None, _resize_out_shape("shape"))


def _reshape_axis(src, a, dst, batch) -> int | None:
    """The axis of shape `dst` that axis `a` of `src` (batch-major, `batch` rows) becomes in a
    row-major reshape, or None when the reshape splits the batch or moves it under another
    axis."""
    pre, post = math.prod(src[:a]), math.prod(src[a:])
    for j in range(len(dst)):
        if math.prod(dst[:j]) == pre and dst[j] and dst[j] % batch == 0 \
                and math.prod(dst[j:]) == post:
            return j
    return None


def _reshape_types(cx: _Cx, eqn, ins, want):
    if eqn.params.get("dimensions") is not None or any(t is not None for t in ins[1:]):
        return [cx.mix("a reshape with dimensions or a batched dynamic shape")]
    src, dst = cx.shape(0), cx.out_shape()
    t, w = ins[0], want[0]
    if is_axis(t):
        j = _reshape_axis(src, t, dst, cx.batch)
        return [cx.mix("splits the batch axis or moves it under another axis")
                if j is None else j]
    i = _reshape_axis(dst, w, src, cx.batch)
    if i is None or not cx.demand(0, i):
        return [cx.mix("makes a batch-length axis from other axes")]
    return [w]


register([lax.reshape_p], _reshape_types, _linear_unary, _resize_out_shape("new_sizes"))


def _squeeze_types(cx: _Cx, eqn, ins, want):
    dims = tuple(d % len(cx.shape(0)) for d in eqn.params["dimensions"])
    kept = [i for i in range(len(cx.shape(0))) if i not in dims]
    t, w = ins[0], want[0]
    if is_axis(t):
        return [kept.index(t)] if t in kept else [cx.mix("squeezes the batch axis")]
    return [w] if cx.demand(0, kept[w]) else [cx.mix("an operand that cannot be batched")]


register([lax.squeeze_p], _squeeze_types, _linear_unary)


def _transpose_types(cx: _Cx, eqn, ins, want):
    perm = tuple(eqn.params["permutation"])
    t, w = ins[0], want[0]
    if is_axis(t):
        return [perm.index(t)]
    return [w] if cx.demand(0, perm[w]) else [cx.mix("an operand that cannot be batched")]


register([lax.transpose_p], _transpose_types, _linear_unary)


def _along_other_axes(param, what):
    """Ops that act along the axes named by ``params[param]`` and map over the others
    (reversals, sorts, cumulative ops, top_k): row-wise unless the batch axis is one of
    them. Operands are all batched alike."""
    def types(cx: _Cx, eqn, ins, want):
        n = len(eqn.outvars)
        a = _common(cx, ins, want)
        if a is None or isinstance(a, Mix):
            return [a] * n
        rank = len(cx.shape(0))
        p = eqn.params.get(param, rank - 1)  # top_k before its `axis` param: the last
        axes = tuple(p) if isinstance(p, (tuple, list)) else (p,)
        if a in tuple(x % rank for x in axes):
            return [cx.mix(what)] * n
        bad = _demand_all(cx, ins, a, range(len(ins)))
        return [bad or a] * n
    return types


register([lax.rev_p], _along_other_axes("dimensions", "reverses the batch axis"),
         _linear_unary)
register(_named("cumsum"), _along_other_axes("axis", "accumulates along the batch axis"),
         _linear_unary)
register(_named("cumprod", "cummax", "cummin", "cumlogsumexp"),
         _along_other_axes("axis", "accumulates along the batch axis"))
register([lax.sort_p], _along_other_axes("dimension", "sorts along the batch axis"))
register(_named("top_k"), _along_other_axes("axis", "takes the top k along the batch axis"))
register([lax.split_p], _along_other_axes("axis", "splits along the batch axis"),
         _linear_unary)


def _fft_types(cx: _Cx, eqn, ins, want):
    """`fft` transforms its operand's trailing ``len(fft_lengths)`` axes: row-wise along any
    other axis."""
    a = _common(cx, ins, want)
    if a is None or isinstance(a, Mix):
        return [a]
    if a >= len(cx.shape(0)) - len(eqn.params["fft_lengths"]):
        return [cx.mix("transforms along the batch axis")]
    return [_demand_all(cx, ins, a, (0,)) or a]


register(_named("fft"), _fft_types, _linear_unary)
register(_named("approx_top_k"),
         _along_other_axes("reduction_dimension", "takes the top k along the batch axis"))


def _stack_types(cx: _Cx, eqn, ins, want):
    """`stack` (jnp.stack): operands of one shape stacked along a new axis."""
    r = len(cx.shape(0))
    ax = eqn.params["axis"] % (r + 1)
    w = want[0]
    if w is not None and w == ax:
        return [cx.mix("stacks along the batch axis")]
    a = _common(cx, ins, [] if w is None else [w if w < ax else w - 1])
    if a is None or isinstance(a, Mix):
        return [a]
    return [_demand_all(cx, ins, a, range(len(ins))) or (a if a < ax else a + 1)]


def _unstack_types(cx: _Cx, eqn, ins, want):
    """`unstack` (jnp.unstack): one output per position along ``axis``, that axis removed."""
    n = len(eqn.outvars)
    ax = eqn.params["axis"] % len(cx.shape(0))
    ws = {w if w < ax else w + 1 for w in want if w is not None}
    a = _common(cx, ins, list(ws))
    if a is None or isinstance(a, Mix):
        return [a] * n
    if a == ax:
        return [cx.mix("unstacks along the batch axis")] * n
    return [_demand_all(cx, ins, a, (0,)) or (a if a < ax else a - 1)] * n


def _tile_types(cx: _Cx, eqn, ins, want):
    """`tile` (jnp.tile): row-wise when the batch axis is repeated once."""
    r, out_r = len(cx.shape(0)), len(cx.out_shape())
    off = out_r - r
    reps = tuple(eqn.params["reps"])
    reps = (1,) * (out_r - len(reps)) + reps
    w = want[0]
    if w is not None and w < off:
        return [cx.mix("a new leading axis the batch meets")]
    a = _common(cx, ins, [] if w is None else [w - off])
    if a is None or isinstance(a, Mix):
        return [a]
    if reps[a + off] != 1:
        return [cx.mix("repeats the batch axis")]
    return [_demand_all(cx, ins, a, (0,)) or a + off]


register(_named("stack"), _stack_types, _linear_additive)
register(_named("unstack"), _unstack_types, _linear_unary)
register(_named("tile"), _tile_types, _linear_unary)

# The PRNG's primitives map over their keys' leading axes (JAX's own batchers say so on some
# releases and not others): keys per row make bits, splits and key data per row.
register(_named("random_bits", "random_split", "random_unwrap", "random_seed"),
         _vectorized_types)
register(_named("random_fold_in", "threefry2x32"), _broadcasting_types)


def _reduce_types(cx: _Cx, eqn, ins, want):
    """Reductions over ``axes``: the batch axis kept (renumbered), or reduced over: a `SUM`
    for a `reduce_sum` in a backward program, else mixing."""
    name = eqn.primitive.name
    red = tuple(eqn.params["axes"] if "axes" in eqn.params else eqn.params["dimensions"])
    n_ops = len(eqn.outvars) if name == "reduce" else len(ins)
    if any(t is not None for t in ins[n_ops:]):
        return [cx.mix("a batched initial value")] * len(eqn.outvars)
    rank = len(cx.shape(0))
    kept = [i for i in range(rank) if i not in red]
    a = _common(cx, ins, [], range(n_ops))
    if isinstance(a, Mix):
        return [a] * len(eqn.outvars)
    if a is None:
        w = next(w for w in want if w is not None)
        a = kept[w]
    if a in red:
        if cx.sums and name == "reduce_sum":
            return [SUM] * len(eqn.outvars)
        return [cx.mix("reduces over the batch axis")] * len(eqn.outvars)
    bad = _demand_all(cx, ins, a, range(n_ops))
    return [bad or kept.index(a)] * len(eqn.outvars)


register(_named("reduce_sum"), _reduce_types, _linear_unary)
register(_named("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                "reduce_xor", "argmax", "argmin", "reduce"), _reduce_types)


def _dot_general_types(cx: _Cx, eqn, ins, want):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    la, ra = ins
    nl, nr = len(cx.shape(0)), len(cx.shape(1))
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]
    la = int(la) if is_axis(la) else None
    ra = int(ra) if is_axis(ra) else None

    def other(j, axis):
        return (ins[j] is None and cx.demand(j, axis)) or (is_axis(ins[j]) and ins[j] == axis)

    if (la is not None and la in lc) or (ra is not None and ra in rc):
        if not cx.sums:
            return [cx.mix("contracts over the batch axis")]
        i = lc.index(la) if la is not None and la in lc else rc.index(ra)
        if not (other(0, lc[i]) and other(1, rc[i])):
            return [cx.mix("contracts the batch axis with another axis")]
        return [SUM]  # a sum over the rows of per-row products
    if la is not None and la in lb:
        i = lb.index(la)
        return [i] if other(1, rb[i]) else [cx.mix("operands batched along different axes")]
    if ra is not None and ra in rb:
        i = rb.index(ra)
        return [i] if other(0, lb[i]) else [cx.mix("operands batched along different axes")]
    if la is not None and ra is not None:
        return [cx.mix("an outer product of two batched operands")]
    if la is not None:
        return [len(lb) + lfree.index(la)]
    if ra is not None:
        return [len(lb) + len(lfree) + rfree.index(ra)]
    w = want[0]
    if w < len(lb):
        ok = other(0, lb[w]) and other(1, rb[w])
    elif w < len(lb) + len(lfree):
        ok = other(0, lfree[w - len(lb)])
    else:
        ok = other(1, rfree[w - len(lb) - len(lfree)])
    return [w] if ok else [cx.mix("an operand that cannot be batched")]


register([lax.dot_general_p], _dot_general_types, _linear_bilinear)


def _conv_types(cx: _Cx, eqn, ins, want):
    """`conv_general_dilated`: the batch axis is the lhs's batch dimension (a forward conv, or
    the input gradient's), or, in a backward program, the contracted feature dimension of
    both operands (the kernel gradient's conv, a `SUM`)."""
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = eqn.params.get("feature_group_count", 1), eqn.params.get("batch_group_count", 1)
    la, ra = ins
    if (is_axis(la) and la == lhs_spec[0] and ra is None and groups[1] == 1) or (
            la is None and ra is None and want[0] == out_spec[0] and groups[1] == 1
            and cx.demand(0, lhs_spec[0])):
        return [out_spec[0]]
    # The kernel's cotangent: the batch axis is the contracted feature dimension of both
    # operands (a grouped or depthwise conv's has `batch_group_count` > 1: it groups the
    # lhs's *batch* dimension, which there holds the input's channels, not the rows).
    if cx.sums and groups[0] == 1 and (
            (is_axis(la) and la == lhs_spec[1]) or (is_axis(ra) and ra == rhs_spec[1])):
        ok_l = (is_axis(la) and la == lhs_spec[1]) or (la is None and cx.demand(0, lhs_spec[1]))
        ok_r = (is_axis(ra) and ra == rhs_spec[1]) or (ra is None and cx.demand(1, rhs_spec[1]))
        if ok_l and ok_r:
            return [SUM]
    return [cx.mix("a convolution that is not per row")]


register([lax.conv_general_dilated_p], _conv_types, _linear_bilinear)


def _concatenate_types(cx: _Cx, eqn, ins, want):
    a = _common(cx, ins, want)
    if a is None or isinstance(a, Mix):
        return [a]
    if eqn.params["dimension"] == a:
        return [cx.mix("concatenates along the batch axis")]
    return [_demand_all(cx, ins, a, range(len(ins))) or a]


register([lax.concatenate_p], _concatenate_types, _linear_additive)


def _full_along(eqn, j, a, start_key, limit_key, stride_key=None) -> bool:
    n = _shape(eqn.invars[j])[a]
    starts = eqn.params.get(start_key)
    start = 0 if starts is None else starts[a]
    strides = eqn.params.get(stride_key) if stride_key else None
    stride = 1 if strides is None else strides[a]
    return (start, eqn.params[limit_key][a], stride) == (0, n, 1)


def _slice_types(cx: _Cx, eqn, ins, want):
    t, w = ins[0], want[0]
    a = int(t) if is_axis(t) else w
    if not _full_along(eqn, 0, a, "start_indices", "limit_indices", "strides"):
        return [cx.mix("slices the batch axis")]
    if t is None and not cx.demand(0, a):
        return [cx.mix("an operand that cannot be batched")]
    return [a]


def _resize_slice(eqn, typing, k):
    a = typing.axis(eqn.invars[0])
    if a is None:
        return None
    limit = list(eqn.params["limit_indices"])
    limit[a] //= k
    return dict(eqn.params, limit_indices=tuple(limit))


register([lax.slice_p], _slice_types, _linear_unary, _resize_slice)


def _dynamic_slice_types(cx: _Cx, eqn, ins, want):
    if any(t is not None for t in ins[1:]):
        return [cx.mix("a batched start index")]
    t, w = ins[0], want[0]
    a = int(t) if is_axis(t) else w
    if eqn.params["slice_sizes"][a] != cx.shape(0)[a]:
        return [cx.mix("slices the batch axis")]  # a full slice's start is clamped to 0
    if t is None and not cx.demand(0, a):
        return [cx.mix("an operand that cannot be batched")]
    return [a]


def _resize_dynamic_slice(eqn, typing, k):
    a = typing.axis(eqn.invars[0])
    if a is None:
        return None
    sizes = list(eqn.params["slice_sizes"])
    sizes[a] //= k
    return dict(eqn.params, slice_sizes=tuple(sizes))


register([lax.dynamic_slice_p], _dynamic_slice_types, _linear_unary, _resize_dynamic_slice)


def _dynamic_update_slice_types(cx: _Cx, eqn, ins, want):
    if any(t is not None for t in ins[2:]):
        return [cx.mix("a batched start index")]
    a = _common(cx, ins, want, (0, 1))
    if a is None or isinstance(a, Mix):
        return [a]
    if cx.shape(1)[a] != cx.shape(0)[a]:
        return [cx.mix("updates some of the batch's rows")]
    return [_demand_all(cx, ins, a, (0, 1)) or a]


register([lax.dynamic_update_slice_p], _dynamic_update_slice_types, _linear_dus)


def _pad_types(cx: _Cx, eqn, ins, want):
    if ins[1] is not None:
        return [cx.mix("a batched padding value")]
    t, w = ins[0], want[0]
    a = int(t) if is_axis(t) else w
    if tuple(eqn.params["padding_config"][a]) != (0, 0, 0):
        return [cx.mix("pads along the batch axis")]
    if t is None and not cx.demand(0, a):
        return [cx.mix("an operand that cannot be batched")]
    return [a]


register([lax.pad_p], _pad_types, _linear_pad)


def _window_types(n_ops: int):
    """Windowed reductions (`reduce_window_sum`, max/min pooling, their transposes): row-wise
    when the window is one row along the batch axis, unstrided, undilated and unpadded."""
    def types(cx: _Cx, eqn, ins, want):
        n = len(eqn.outvars)
        ops = range(min(n_ops, len(ins)) if n_ops else len(ins) - n)
        a = _common(cx, ins, want, ops)
        if a is None or isinstance(a, Mix):
            return [a] * n
        p = eqn.params
        one = all(p[key][a] == 1 for key in ("window_dimensions", "window_strides",
                                               "base_dilation", "window_dilation") if key in p)
        pad = tuple(p.get("padding", ((0, 0),) * (a + 1))[a]) == (0, 0)
        if not (one and pad) or any(ins[j] is not None for j in range(len(ins)) if j not in ops):
            return [cx.mix("a window that spans rows of the batch")] * n
        return [_demand_all(cx, ins, a, ops) or a] * n
    return types


register(_named("reduce_window_sum"), _window_types(1), _linear_unary)
register(_named("reduce_window_max", "reduce_window_min", "cumred"), _window_types(1))
register([compat.select_and_gather_add_p], _window_types(2))
register([compat.select_and_scatter_add_p], _window_types(2))
register(_named("reduce_window"), _window_types(0))


def _gather_types(cx: _Cx, eqn, ins, want):
    """`gather`: row-wise when the operand's batch axis is a whole window (``x[:, idx]``),
    when unbatched indices' rows pick from an unbatched operand (a table indexed by
    per-row positions), or when both are batched along their paired batching dimensions
    (``take_along_axis``)."""
    dn = eqn.params["dimension_numbers"]
    sizes = tuple(eqn.params["slice_sizes"])
    offset, collapsed = tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims)
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    op_rank, out_rank = len(cx.shape(0)), len(cx.out_shape())
    window = [d for d in range(op_rank) if d not in collapsed and d not in op_batching]
    out_batch = [d for d in range(out_rank) if d not in offset]  # the indices' dims, in order
    to, ti, w = ins[0], ins[1], want[0]

    def window_axis(d):  # operand axis d as a whole window: the output's axis
        if d in window and sizes[d] == cx.shape(0)[d]:
            return offset[window.index(d)]
        return None

    if is_axis(to) and ti is None:
        if to in op_batching:  # per-row indices for per-row operands (take_along_axis)
            ai = idx_batching[op_batching.index(to)]
            return [out_batch[ai]] if cx.demand(1, ai) else [
                cx.mix("indices that cannot be batched pick from batched rows")]
        o = window_axis(int(to))
        return [o] if o is not None else [cx.mix("gathers along the batch axis")]
    if is_axis(ti) and to is None:
        if ti == len(cx.shape(1)) - 1 or ti in idx_batching:
            return [cx.mix("batched index vectors")]
        return [out_batch[ti]]
    if is_axis(to) and is_axis(ti):
        if to in op_batching and idx_batching[op_batching.index(to)] == ti:
            return [out_batch[ti]]
        return [cx.mix("gathers across the batch's rows")]
    # neither batched, the output demanded along w
    if w in offset:
        d = window[offset.index(w)]
        if window_axis(d) == w and cx.demand(0, d):
            return [w]
        return [cx.mix("a gathered window the batch meets")]
    ai = out_batch.index(w)
    if ai in idx_batching:
        p = idx_batching.index(ai)
        ok = cx.demand(1, ai) and cx.demand(0, op_batching[p])
    else:
        ok = cx.demand(1, ai)
    return [w] if ok else [cx.mix("gathered rows the batch meets")]


def _resize_gather(eqn, typing, k):
    a = typing.axis(eqn.invars[0])
    if a is None:
        return None
    sizes = list(eqn.params["slice_sizes"])
    if sizes[a] == _shape(eqn.invars[0])[a]:
        sizes[a] //= k
    return dict(eqn.params, slice_sizes=tuple(sizes))


register([lax.gather_p], _gather_types, _linear_unary, _resize_gather)


def _scatter_types(cx: _Cx, eqn, ins, want):
    """The scatters: row-wise when the operand's batch axis is a whole window of the updates
    (``x.at[:, idx].set(u)``) or a batching dimension paired with the indices' and updates'
    (a vmapped scatter: a one-hot row per row); in a backward program a `scatter-add` of
    batched updates into zeros or a sum (an embedding table's cotangent) is a `SUM`. The
    operand's batch axis comes from whichever of the operand, the result's use, the indices
    or the updates is batched, and every unbatched one of them is demanded batched alike (a
    mask made with ``ones_like(h).at[:, 0].set(0)``)."""
    dn = eqn.params["dimension_numbers"]
    uwin = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    n_out = len(eqn.outvars)
    n_in = len(ins)
    n_ops = (n_in - 1) // 2
    op_rank, upd_rank = len(cx.shape(0)), len(cx.shape(n_in - 1))
    window = [d for d in range(op_rank) if d not in inserted and d not in op_batching]
    upd_scatter = [d for d in range(upd_rank) if d not in uwin]
    ops, upds = range(n_ops), range(n_ops + 1, n_in)
    ti = ins[n_ops]
    for j in (*ops, *upds):
        if isinstance(ins[j], Mix):
            return [ins[j]] * n_out
    a_op = _common(cx, ins, [w for w in want if w is not None], ops)
    if isinstance(a_op, Mix):
        return [a_op] * n_out
    au = _common(cx, ins, [], upds)
    if isinstance(au, Mix):
        return [au] * n_out
    name = eqn.primitive.name
    if cx.sums and name in ("scatter-add", "scatter_add") and au in upd_scatter \
            and all(ins[j] is None or ins[j] is SUM for j in ops):
        i = upd_scatter.index(au)
        if i not in idx_batching and (ti is None or (is_axis(ti) and ti == i)) and all(
                ins[j] is SUM or cx.zero(j) for j in ops):
            return [SUM] * n_out  # batched updates summed into zeros or a sum: a table's
    # The operand's batch axis, from what is batched.
    a = a_op
    if a is None and is_axis(ti) and ti in idx_batching:
        a = op_batching[idx_batching.index(ti)]
    if a is None and au is not None:
        if au in uwin:
            a = window[uwin.index(au)]
        elif upd_scatter.index(au) in idx_batching:
            a = op_batching[idx_batching.index(upd_scatter.index(au))]
        else:
            return [cx.mix("scatters batched updates across the batch's rows")] * n_out
    if a is None:
        if is_axis(ti):
            return [cx.mix("batched indices scatter across the batch's rows")] * n_out
        return [None] * n_out
    if a in window:  # ``x.at[:, idx].set(u)``: the batch axis a whole window of the updates
        j = uwin[window.index(a)]
        if cx.shape(n_in - 1)[j] != cx.shape(0)[a] or ti is not None:
            return [cx.mix("scatters along the batch axis")] * n_out
        ju = j
    elif a in op_batching:  # a vmapped scatter: per-row indices and updates
        ai = idx_batching[op_batching.index(a)]
        ju = upd_scatter[ai] if ai < len(upd_scatter) else None
        if ju is None or not ((is_axis(ti) and ti == ai) or (ti is None and cx.demand(n_ops, ai))):
            return [cx.mix("scatters across the batch's rows")] * n_out
    else:
        return [cx.mix("scatters into the batch's rows by index")] * n_out
    for jj in upds:
        if not ((is_axis(ins[jj]) and ins[jj] == ju) or (ins[jj] is None and cx.demand(jj, ju))):
            return [cx.mix("updates batched along another axis")] * n_out
    for jj in ops:
        if not ((is_axis(ins[jj]) and ins[jj] == a) or (ins[jj] is None and cx.demand(jj, a))):
            return [cx.mix("an operand that cannot be batched")] * n_out
    return [a] * n_out


def _linear_scatter(cx: _Cx, eqn, ins):
    n_ops = (len(ins) - 1) // 2
    if any(is_axis(t) for t in ins):  # batched updates into a sum: `_scatter_types` says
        return _scatter_types(cx, eqn, ins, [None] * len(eqn.outvars))
    if eqn.primitive.name in ("scatter-add", "scatter_add") and ins[n_ops] is None and all(
            _sum_or_zero(cx, ins, j) for j in (*range(n_ops), *range(n_ops + 1, len(ins)))):
        return [SUM] * len(eqn.outvars)
    return [cx.mix("scatters a sum over the batch nonlinearly")] * len(eqn.outvars)


_SCATTERS = frozenset(_named("scatter", "scatter-add", "scatter_add", "scatter_mul",
                              "scatter_min", "scatter_max", "scatter_sub"))
register(list(_SCATTERS), _scatter_types, _linear_scatter)


def _random_wrap_types(cx: _Cx, eqn, ins, want):
    """`random_wrap`: uint32 key data ``[..., n]`` to keys ``[...]``, over leading axes."""
    a = _common(cx, ins, want)
    if a is None or isinstance(a, Mix):
        return [a]
    if a >= len(cx.out_shape()):
        return [cx.mix("the batch axis is the key data's")]
    return [_demand_all(cx, ins, a, (0,)) or a]


register(_named("random_wrap"), _random_wrap_types)


# ------------------------------------------------------------------------ sub-programs

def call_jaxpr(eqn):
    """The sub-jaxpr of a call-like equation with the equation's arity, or None."""
    from .rules import CALL_PRIMITIVES, _call_jaxpr_param

    if eqn.primitive not in CALL_PRIMITIVES and eqn.primitive is not compat.closed_call_p:
        return None
    try:
        param = _call_jaxpr_param(eqn)
    except KeyError:
        return None
    jaxpr = compat.jaxpr_and_consts(param)[0]
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return param


def _call_types(cx: _Cx, eqn, ins, want):
    """jit, closed calls, checkpoints and custom_jvp / custom_vjp functions (their primal
    program; their rules are resized and checked where the backward is, `resize.py`): the
    body, analysed at this call site."""
    closed = call_jaxpr(eqn)
    if closed is None:
        return [cx.mix("a call whose body this analysis cannot read")] * len(eqn.outvars)
    return cx.sub(0, closed, ins, eqn.invars, want)


def _call_linear(cx: _Cx, eqn, ins):
    return _call_types(cx, eqn, ins, [None] * len(eqn.outvars))


register([compat.pjit_p, compat.closed_call_p, compat.remat_p, compat.custom_jvp_call_p,
          compat.custom_vjp_call_p], _call_types, _call_linear)


def _cond_types(cx: _Cx, eqn, ins, want):
    """`cond` on an unbatched index (a `platform_dependent` choice, say): every branch on the
    operands; an output batched in one branch is demanded batched in all."""
    n = len(eqn.outvars)
    if ins[0] is not None:
        return [cx.mix("branches on a batched value")] * n
    branches = eqn.params["branches"]
    want = list(want)
    for _ in range(2):
        outs = [cx.sub(j, br, ins[1:], eqn.invars[1:], want) for j, br in enumerate(branches)]
        joined = []
        for i in range(n):
            ts = [o[i] for o in outs]
            mix = next((t for t in ts if isinstance(t, Mix)), None)
            axes = {int(t) for t in ts if is_axis(t)}
            if mix is not None:
                joined.append(mix)
            elif len(axes) > 1 or (axes and any(t is SUM for t in ts)):
                joined.append(cx.mix("branches give different batch axes"))
            elif axes:
                joined.append(axes.pop())
            elif any(t is SUM for t in ts):
                joined.append(SUM if all(t is SUM or t is None for t in ts) else
                              cx.mix("branches give different types"))
            else:
                joined.append(None)
        if all(not is_axis(j) or all(o[i] == j for o in outs) for i, j in enumerate(joined)):
            return joined
        want = [j if is_axis(j) else w for j, w in zip(joined, want)]
    return joined


def _cond_linear(cx: _Cx, eqn, ins):
    if ins[0] is not None:
        return [cx.mix("branches on a sum over the batch")] * len(eqn.outvars)
    return _cond_types(cx, eqn, ins, [None] * len(eqn.outvars))


register([compat.cond_p], _cond_types, _cond_linear)


def _join(a, b, cx: _Cx):
    """The type of a loop's carry that is `a` on entry and `b` after an iteration."""
    for t in (a, b):
        if isinstance(t, Mix):
            return t
    if a is None or a == b:
        return b
    if b is None:
        return a
    return cx.mix("a loop carry typed differently on entry and after an iteration")


def _loop_carries(cx: _Cx, run, carry_ops: Sequence[int], carry_t: list, carry_want: list):
    """A loop's carry types by a fixpoint: `run(cur)` types the body with carries `cur` and
    returns (the body's carry inputs as typed, its carry outputs); a carry batched on one
    side is batched on both (its initial value demanded batched: a broadcast of zeros
    is). Returns the carry types or a `Mix`."""
    cur = [t if t is not None else (w if is_axis(w) else None)
           for t, w in zip(carry_t, carry_want)]
    # In a backward program, a carry that starts as a sum over the batch or as zeros may be an
    # accumulator of per-row terms (a parameter's cotangent summed over a loop): tried as a
    # `SUM`, and typed unbatched instead if the body does not keep it one.
    sums = [cx.sums and not is_axis(t) and (t is SUM or (t is None and cx.zero(j)))
            for j, t in zip(carry_ops, carry_t)]
    cur = [SUM if s_ else t for s_, t in zip(sums, cur)]
    for _ in range(3 * len(cur) + 3):
        body_in, body_out = run(cur)
        dropped = [i for i, (c, o) in enumerate(zip(cur, body_out))
                   if c is SUM and o is not SUM and carry_t[i] is not SUM]
        if dropped:
            cur = [None if i in dropped else c for i, c in enumerate(cur)]
            continue
        new = [c if c is SUM else _join(_join(c, i, cx), o, cx)
               for c, i, o in zip(cur, body_in, body_out)]
        bad = next((t for t in new if isinstance(t, Mix)), None)
        if bad is not None:
            return bad
        if new == cur:
            break
        cur = new
    else:  # pragma: no cover - each round only makes carries batched or drops a sum
        return cx.mix("a loop's carries did not settle")
    for j, t0, t in zip(carry_ops, carry_t, cur):
        if is_axis(t) and t0 is None and not cx.demand(j, t):
            return cx.mix("a loop carry's initial value cannot be batched")
    return cur


def _scan_types(cx: _Cx, eqn, ins, want):
    """`scan` (and what lowers to one: `fori_loop` with static bounds, `lax.map`, an RNN over
    tokens): over another axis, the body typed with its carries by a fixpoint (a carry
    batched in one iteration is batched in all) and its ``xs``/``ys`` one axis shorter; over
    the batch axis itself (`lax.map` over rows), row-wise when nothing carries from row to
    row (`_scan_over_rows`)."""
    n = len(eqn.outvars)
    nc, ncar = compat.scan_split(eqn)
    closed = eqn.params["jaxpr"]
    consts_t, carry_t, xs_t = list(ins[:nc]), list(ins[nc:nc + ncar]), list(ins[nc + ncar:])
    nx = len(xs_t)
    carry_want, ys_want = list(want[:ncar]), list(want[ncar:])
    if any(t == 0 for t in xs_t if is_axis(t)) or any(w == 0 for w in ys_want if is_axis(w)):
        return _scan_over_rows(cx, eqn, ins, want, nc, ncar)
    if any(t is SUM for t in consts_t):
        return [cx.mix("a sum over the batch read inside a loop")] * n
    ops = list(range(len(ins)))
    body_xs = [t - 1 if is_axis(t) else t for t in xs_t]
    body_ys_want = [w - 1 if is_axis(w) else None for w in ys_want]
    shift = [0] * (nc + ncar) + [1] * nx
    last: list = []

    def run(cur):
        outs = cx.sub(0, closed, [*consts_t, *cur, *body_xs], eqn.invars,
                      [*cur, *body_ys_want], shift)
        child = cx.typing.sub(cx.index, 0)
        last[:] = [outs]
        return child.in_types[nc:nc + ncar], outs[:ncar]

    # a carry that starts as a sum over the batch (a backward's accumulator) or as zeros
    # and adds sums stays one
    cur = _loop_carries(cx, run, ops[nc:nc + ncar], carry_t, carry_want)
    if isinstance(cur, Mix):
        return [cur] * n
    ys = [o + 1 if is_axis(o) else o for o in last[0][ncar:]]
    return [*cur, *ys]


def _scan_over_rows(cx: _Cx, eqn, ins, want, nc: int, ncar: int):
    """A scan over the batch axis itself (``lax.map(f, x)``): each iteration one row, so it is
    row-wise when every ``xs`` is batched along the scanned axis (or made so), the constants
    are not batched (every iteration would read the whole batch) and no carry depends on a
    row (none carries from row to row); its ``ys`` are batched along the scanned axis, and
    at a slice it runs ``length / k`` iterations (`_resize_scan`)."""
    n = len(eqn.outvars)
    consts_t, carry_t = ins[:nc], ins[nc:nc + ncar]
    if any(t is not None for t in (*consts_t, *carry_t)):
        return [cx.mix("a loop over the batch's rows reads batched values whole")] * n
    if any(is_axis(w) for w in want[:ncar]):
        return [cx.mix("a loop over the batch's rows carries a value the batch meets")] * n
    for j in range(nc + ncar, len(ins)):
        if not (ins[j] == 0 or (ins[j] is None and cx.demand(j, 0))):
            return [cx.mix("a loop over the batch's rows scans a value along another axis")] * n
    jaxpr, consts = compat.jaxpr_and_consts(eqn.params["jaxpr"])
    row = Mix("a row of the batch")
    typing = cx.pas.run(jaxpr, consts, [*consts_t, *carry_t, *[row] * (len(ins) - nc - ncar)],
                        (*cx.typing.path, (cx.index, "rows")))
    if typing.fatal:
        return [cx.mix("a loop over the batch's rows has effects")] * n
    carries = []
    for i, t in enumerate(typing.out_types[:ncar]):
        if t is None:
            carries.append(None)
        elif cx.pas.sums and (carry_t[i] is SUM or cx.zero(nc + i)) and _row_sum(
                jaxpr, nc, ncar, i):
            carries.append(SUM)  # the backward's accumulator of per-row terms
        else:
            return [cx.mix("a loop over the batch's rows carries a value from row to row")] * n
    return [*carries, *[0] * (n - ncar)]


def _row_sum(jaxpr, nc: int, ncar: int, i: int) -> bool:
    """Whether carry `i` of a scan body is ``carry_i + term`` with a term that depends on no
    carry: summed over the iterations (rows), a sum of per-row terms."""
    carry_in = set(jaxpr.invars[nc:nc + ncar])
    dep: dict = {}
    for eqn in jaxpr.eqns:
        d = any(not compat.is_literal(v) and (v in carry_in or dep.get(v, False))
                for v in eqn.invars)
        for v in eqn.outvars:
            dep[v] = d
    out = jaxpr.outvars[i]
    eqn = _producers(jaxpr).get(out)
    if eqn is None or eqn.primitive.name not in ("add", "add_any"):
        return False
    a, b = eqn.invars
    mine = jaxpr.invars[nc + i]
    for x, y in ((a, b), (b, a)):
        if x is mine and (compat.is_literal(y) or not (y in carry_in or dep.get(y, False))):
            return True
    return False


def _resize_scan(eqn, typing, k):
    """A scan over the batch's rows at a slice: ``length / k`` iterations."""
    nc, ncar = compat.scan_split(eqn)
    if any(typing.axis(v) == 0 for v in eqn.invars[nc + ncar:]):
        return dict(eqn.params, length=eqn.params["length"] // k)
    return None


def _while_types(cx: _Cx, eqn, ins, want):
    """`while_loop`: its body typed as a scan's (carries by a fixpoint); row-wise when the
    loop's predicate does not depend on the batch (the trip count is every row's)."""
    n = len(eqn.outvars)
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts_t, bconsts_t = list(ins[:cn]), list(ins[cn:cn + bn])
    carry_t = list(ins[cn + bn:])
    if any(t is SUM for t in ins):
        return [cx.mix("a sum over the batch read inside a loop")] * n
    ops = list(range(len(ins)))
    # jaxprs_in_params order: cond_jaxpr (0), body_jaxpr (1)
    pred: list = []

    def run(cur):
        outs = cx.sub(1, p["body_jaxpr"], [*bconsts_t, *cur],
                      [*eqn.invars[cn:cn + bn], *eqn.invars[cn + bn:]], list(cur))
        child = cx.typing.sub(cx.index, 1)
        pred[:] = cx.sub(0, p["cond_jaxpr"], [*cconsts_t, *cur],
                         [*eqn.invars[:cn], *eqn.invars[cn + bn:]], [None])
        cond_in = cx.typing.sub(cx.index, 0).in_types[cn:]
        body_in = child.in_types[bn:]
        return [_join(a, b, cx) for a, b in zip(body_in, cond_in)], outs

    cur = _loop_carries(cx, run, ops[cn + bn:], carry_t, list(want))
    if isinstance(cur, Mix):
        return [cur] * n
    if pred and pred[0] is not None:
        return [pred[0] if isinstance(pred[0], Mix) else
                cx.mix("the loop's trip count depends on the batch's rows")] * n
    return cur


register([compat.scan_p], _scan_types, None, _resize_scan)
register([compat.while_p], _while_types)


def _hi_primitive_types(cx: _Cx, eqn, ins, want):
    """JAX 0.12's hi-primitives (`call_hi_primitive`: `jnp.searchsorted` in `jnp.interp`, ...):
    analysed through the program they expand to (`compat.hi_primitive_expansion`), which is
    what runs at a slice (`resize.py`)."""
    closed = compat.hi_primitive_expansion(eqn)
    if closed is None:
        return [cx.mix("a hi-primitive whose expansion this analysis cannot read")] * len(
            eqn.outvars)
    return cx.sub(0, closed, ins, eqn.invars, want)


register([compat.call_hi_primitive_p], _hi_primitive_types)


# ------------------------------------------------------------------------ row positions
# How a `Position` passes: through what only moves it (broadcasts, reshapes, integer casts,
# JAX's normalization of negative indices, the concatenation of index vectors) and into the
# gathers and scatters that index the batch axis by it. Each rule returns None where it does
# not apply: the position is then plain mixing.

_POSITION_RULES: dict = {}


def _position_of(ins) -> Position | None:
    ps = [t for t in ins if isinstance(t, Position)]
    return ps[0] if len(ps) == 1 else None


def _pos_broadcast(cx: _Cx, eqn, ins, want):
    p = ins[0]
    if not isinstance(p, Position) or p.comp is not None or p.derived or p.ids or any(
            t is not None for t in ins[1:]):
        return None
    dims = tuple(eqn.params["broadcast_dimensions"])
    a = dims[p.axis]
    if want[0] is not None and want[0] != a:
        return None
    return [Position(p.why, a)]


def _pos_reshape(cx: _Cx, eqn, ins, want):
    p = ins[0]
    if not isinstance(p, Position) or p.comp is not None or p.derived or p.ids or \
            eqn.params.get("dimensions"):
        return None
    j = _reshape_axis(cx.shape(0), p.axis, cx.out_shape(), cx.batch)
    src, dst = cx.shape(0), cx.out_shape()
    # only unit axes added or removed: the position stays one value per row
    if j is None or [d for d in src if d != 1] != [d for d in dst if d != 1]:
        return None
    return [Position(p.why, j)]


def _pos_cast(cx: _Cx, eqn, ins, want):
    p = ins[0]
    if not isinstance(p, Position) or p.derived or p.ids or not jax.numpy.issubdtype(
            eqn.params["new_dtype"], jax.numpy.integer):
        return None
    return [Position(p.why, p.axis, p.comp, p.rest)]


def _pos_derived(cx: _Cx, eqn, ins, want):
    """``lt(p, 0)`` and ``add(p, n)`` of a position by a literal: the pieces of JAX's
    normalization of negative indices (`_pos_normalized`), batch-long along its axis, and
    mixing for any other use."""
    p = ins[0]
    if not isinstance(p, Position) or p.comp is not None or p.derived or p.ids or \
            not all(compat.is_literal(v) and np.ndim(v.val) == 0 for v in eqn.invars[1:]):
        return None
    return [Position(p.why, p.axis, derived=True)]


def _pos_normalized(cx: _Cx, eqn, ins, want):
    """``select_n(lt(p, 0), p, add(p, n))``: JAX's normalization of negative indices, which
    leaves a position (never negative) as it is."""
    if len(ins) != 3 or not isinstance(ins[1], Position) or ins[1].derived or ins[1].ids:
        return None
    producer = cx.typing.producer()
    pred, p, other = eqn.invars
    lt, add = producer.get(pred), producer.get(other)
    if lt is None or add is None or lt.primitive.name != "lt" or add.primitive.name != "add":
        return None
    if lt.invars[0] is not p or not compat.is_literal(lt.invars[1]) or \
            np.any(np.asarray(lt.invars[1].val) != 0):
        return None
    if p not in add.invars or not all(v is p or compat.is_literal(v) for v in add.invars):
        return None
    return [ins[1]]


def _pos_concatenate(cx: _Cx, eqn, ins, want):
    """Index vectors concatenated along the last axis (JAX's advanced indexing): one piece the
    position, the others per row or not batched."""
    r = len(cx.out_shape())
    if eqn.params["dimension"] != r - 1:
        return None
    comp, pos, rest = 0, None, set()
    for j, t in enumerate(ins):
        size = cx.shape(j)[-1]
        if isinstance(t, Position):
            if pos is not None or t.comp is not None or t.derived or t.ids or size != 1 \
                    or t.axis == r - 1:
                return None
            pos = (t, comp)
        elif isinstance(t, Mix) or t is SUM:
            return None
        elif t is not None:
            rest.add(int(t))
        comp += size
    if pos is None:
        return None
    p, c = pos
    if rest - {p.axis}:
        return None
    for j, t in enumerate(ins):
        if t is None and cx.shape(j)[p.axis] != 1 and not cx.demand(j, p.axis):
            return None
    return [Position(p.why, p.axis, c, p.axis if rest else None)]


def _pos_index(cx: _Cx, eqn, ins, n_ops: int, op_dim_of_comp, idx_j: int):
    """A gather or scatter whose index vectors hold the position along the indices' axis
    `t.axis` in the component that indexes operand dimension d: the batch axis is d for the
    operands, `t.axis` for the indices, and the matching axis for the updates/result."""
    t = ins[idx_j]
    if not isinstance(t, Position) or t.comp is None or t.derived or t.ids:
        return None
    d = op_dim_of_comp(t.comp)
    if d is None:
        return None
    n_out = len(eqn.outvars)
    for j in range(n_ops):
        if not ((is_axis(ins[j]) and ins[j] == d) or (ins[j] is None and cx.demand(j, d))):
            return None
    return d, t.axis, n_out


def _pos_gather(cx: _Cx, eqn, ins, want):
    dn = eqn.params["dimension_numbers"]
    start = tuple(dn.start_index_map)
    found = _pos_index(cx, eqn, ins, 1, lambda c: start[c] if c < len(start) else None, 1)
    if found is None:
        return None
    d, ai, _ = found
    offset = tuple(dn.offset_dims)
    out_batch = [k for k in range(len(cx.out_shape())) if k not in offset]
    # the batch axis of the operand is collapsed (indexed by the position): the result's
    # batch axis is the indices' position axis
    if d not in tuple(dn.collapsed_slice_dims) or ai >= len(out_batch):
        return None
    return [out_batch[ai]]


def _pos_scatter(cx: _Cx, eqn, ins, want):
    dn = eqn.params["dimension_numbers"]
    n_in = len(ins)
    n_ops = (n_in - 1) // 2
    s2o = tuple(dn.scatter_dims_to_operand_dims)
    found = _pos_index(cx, eqn, ins, n_ops, lambda c: s2o[c] if c < len(s2o) else None, n_ops)
    if found is None:
        return None
    d, ai, n_out = found
    if d not in tuple(dn.inserted_window_dims):
        return None
    uwin = tuple(dn.update_window_dims)
    upd_rank = len(cx.shape(n_in - 1))
    upd_scatter = [k for k in range(upd_rank) if k not in uwin]
    if ai >= len(upd_scatter):
        return None
    ju = upd_scatter[ai]
    for jj in range(n_ops + 1, n_in):
        if not ((is_axis(ins[jj]) and ins[jj] == ju) or (ins[jj] is None and cx.demand(jj, ju))):
            return None
    return [d] * n_out


_IDS_MOVES = frozenset([lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p,
                        lax.convert_element_type_p, lax.add_p])
_IDS_COMPARE = frozenset(_named("eq", "ne"))


def _constant(cx: _Cx, v) -> bool:
    """Whether `v` is a literal, or a broadcast of a scalar literal (the same everywhere)."""
    if compat.is_literal(v):
        return np.ndim(v.val) == 0
    e = cx.typing.producer().get(v)
    return (e is not None and e.primitive is lax.broadcast_in_dim_p
            and compat.is_literal(e.invars[0]) and np.ndim(e.invars[0].val) == 0)


def _ids_rule(cx: _Cx, eqn, ins, want):
    """An injective labeling of the batch's elements (`Position` with ``ids``, or a row
    position, injective too), moved (reshaped, broadcast, cast, shifted by an unbatched
    value, scattered or gathered by per-row indices: still one label per element, batch-major)
    or compared for equality (a row-wise result: labels of one row are equal only to labels of
    that row). JAX's JVP of a scatter with possibly repeated indices does exactly this."""
    prim = eqn.primitive

    def data(t):
        return isinstance(t, Position) and t.comp is None and not t.derived

    def view(t):
        return t.axis if data(t) else t

    if prim in _IDS_COMPARE:
        if not any(data(t) for t in ins) or any(
                isinstance(t, Mix) and not data(t) for t in ins):
            return None
        return _broadcasting_types(cx, eqn, [view(t) for t in ins], want)
    if prim in _SCATTERS or prim is lax.gather_p:
        idx = (len(ins) - 1) // 2 if prim in _SCATTERS else 1
        if not any(data(t) for j, t in enumerate(ins) if j != idx):
            return None
        viewed = [t if j == idx else view(t) for j, t in enumerate(ins)]
        if any(isinstance(t, Mix) and not isinstance(t, Position) for t in viewed):
            return None
        if isinstance(viewed[idx], Position):
            outs = (_pos_scatter if prim in _SCATTERS else _pos_gather)(cx, eqn, viewed, want)
        elif isinstance(viewed[idx], Mix):
            return None
        else:
            outs = (_scatter_types if prim in _SCATTERS else _gather_types)(cx, eqn, viewed,
                                                                            want)
    elif prim in _IDS_MOVES:
        if prim is lax.convert_element_type_p and not jax.numpy.issubdtype(
                eqn.params["new_dtype"], jax.numpy.integer):
            return None
        if prim is lax.add_p and not (sum(data(t) for t in ins) == 1 and all(
                data(t) or t is None or _constant(cx, v) for t, v in zip(ins, eqn.invars))):
            return None  # (a shift by one value keeps labels distinct; JAX adds ones)
        viewed = [view(t) for t in ins]
        if any(isinstance(t, Mix) for t in viewed):
            return None
        outs = rule_for(prim).types(cx, eqn, viewed, want)
    else:
        return None
    if outs is None or not all(is_axis(o) for o in outs):
        return None
    why = next(t for t in ins if isinstance(t, Position)).why
    return [Position(why, int(o), ids=True) for o in outs]


def _pos_identity(cx: _Cx, eqn, ins, want):
    """Identities on values (a sharding constraint, a copy, a checkpoint name): the position
    or the labels pass as they are."""
    if len(ins) != 1 or not isinstance(ins[0], Position):
        return None
    return [ins[0]] * len(eqn.outvars)


for _p in (compat.copy_p, *_named("copy"), compat.name_p, compat.sharding_constraint_p,
           compat.pvary_p, compat.optimization_barrier_p):
    if _p is not None:
        _POSITION_RULES[_p] = _pos_identity
_POSITION_RULES.update({lax.lt_p: _pos_derived, lax.add_p: _pos_derived,
                        lax.broadcast_in_dim_p: _pos_broadcast, lax.reshape_p: _pos_reshape,
                        lax.convert_element_type_p: _pos_cast, lax.select_n_p: _pos_normalized,
                        lax.concatenate_p: _pos_concatenate, lax.gather_p: _pos_gather})
for _p in _SCATTERS:
    _POSITION_RULES[_p] = _pos_scatter


# ------------------------------------------------------------------------ same program

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


# Params that hold an equation's output shape (or its bound along each axis): they may be `k`
# times smaller at a slice at the position of the batch axis, and nowhere else.
_SHAPE_PARAMS = frozenset(("shape", "new_sizes", "limit_indices", "slice_sizes"))
# Params that place values on devices and never change them: a block traced at a slice of a
# sharded batch holds other shardings (its slice's), and computes the same rows.
_LAYOUT_PARAMS = frozenset(("sharding", "out_sharding", "in_shardings", "out_shardings",
                            "in_layouts", "out_layouts"))


def same_program(full, sliced, k: int, typing: Typing | None = None, consts_full=(),
                 consts_sliced=(), explain: list | None = None) -> bool:
    """Whether `sliced` (a jaxpr traced at 1/`k` of the batch) is `full` (the one analysed,
    typed `typing`) with exactly its batched axes `k` times shorter: the same equations, wired
    the same way, with the same dtypes, equal constants (`consts_full` / `consts_sliced`),
    literals and params, each shape (and shape param) `k` times smaller at its batch axis and
    equal everywhere else. `explain`, a list, gets the first difference found."""

    def differ(what, e=None) -> bool:
        if explain is not None:
            explain.append(f"{e.primitive.name}: {what}" if e is not None else what)
        return False

    def same_value(a, b) -> bool:
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
        if isinstance(a, float) and isinstance(b, float):
            return bool(np.isnan(a) and np.isnan(b))  # a gather's fill_value=nan
        return _same_rule(a, b)

    def no_jaxprs(v):
        if isinstance(v, compat._JAXPR_TYPES):
            return "<jaxpr>"
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, *(no_jaxprs(x) for x in v))
        if isinstance(v, dict):
            return {x: no_jaxprs(y) for x, y in v.items()}
        return v

    def same_shape(sa, sb, a) -> bool:
        """Equal, but at position `a` (a batch axis, or None) where `sa` is `k` times `sb`."""
        sa, sb = tuple(sa), tuple(sb)
        if len(sa) != len(sb):
            return False
        return all((x == k * y) if i == a else (x == y) for i, (x, y) in enumerate(zip(sa, sb)))

    def same_aval(ty, u, v) -> bool:
        au, av = u.aval, v.aval
        if getattr(au, "dtype", None) != getattr(av, "dtype", None):
            return False
        if au.dtype == _FLOAT0:  # no values (see `_array_equal`)
            return len(au.shape) == len(av.shape)
        return same_shape(getattr(au, "shape", ()), getattr(av, "shape", ()),
                          ty.axis(u) if ty is not None else None)

    def same_params(ty, i, e1, e2) -> bool:
        if e1.params.keys() != e2.params.keys():
            return False
        outs = [v for v in e1.outvars if not compat.is_dropvar(v)]
        a = ty.axis(outs[0]) if (outs and ty is not None) else None
        a_in = ty.axis(e1.invars[0]) if (e1.invars and ty is not None) else None
        for key in e1.params:
            x, y = e1.params[key], e2.params[key]
            if key in _LAYOUT_PARAMS:
                continue
            if key == "length" and e1.primitive is compat.scan_p and ty is not None and any(
                    ty.axis(v) == 0 for v in e1.invars[sum(compat.scan_split(e1)):]):
                if x != k * y:  # a scan over the batch's rows: k times fewer at a slice
                    return differ(f"param length {x} vs {y}", e1)
                continue
            if key in _SHAPE_PARAMS and isinstance(x, (tuple, list)) \
                    and isinstance(y, (tuple, list)) \
                    and all(isinstance(n, (int, np.integer)) for n in (*x, *y)):
                at = a_in if key in ("limit_indices", "slice_sizes") else a
                if not (same_shape(x, y, at) or (at is not None and same_shape(x, y, None))):
                    return differ(f"param {key} {x} vs {y} (batch axis {at})", e1)
            elif not same_value(no_jaxprs(x), no_jaxprs(y)):
                return differ(f"param {key} differs", e1)
        subs1, subs2 = compat.jaxprs_in_params(e1.params), compat.jaxprs_in_params(e2.params)
        if len(subs1) != len(subs2):
            return differ("another number of sub-programs", e1)
        for j, (s1, s2) in enumerate(zip(subs1, subs2)):
            if type(s1) is not type(s2):
                return differ("another kind of sub-program", e1)
            (j1, c1), (j2, c2) = compat.jaxpr_and_consts(s1), compat.jaxpr_and_consts(s2)
            if not same_jaxpr(ty.sub(i, j) if ty is not None else None, j1, j2, c1, c2):
                return False
        return True

    def same_jaxpr(ty, j1, j2, c1=(), c2=()) -> bool:
        (eqns1, alias1), (eqns2, alias2) = _without_identities(j1), _without_identities(j2)
        n1 = (len(eqns1), len(j1.invars), len(j1.outvars), len(j1.constvars))
        n2 = (len(eqns2), len(j2.invars), len(j2.outvars), len(j2.constvars))
        if n1 != n2:
            return differ(f"(equations, inputs, outputs, constants) {n1} vs {n2}")
        if len(c1) != len(c2) or not all(_array_equal(x, y) for x, y in zip(c1, c2)):
            return differ("a constant differs")
        index = {id(e): i for i, e in enumerate(j1.eqns)}
        m = {}
        for u, v in zip([*j1.constvars, *j1.invars], [*j2.constvars, *j2.invars]):
            if not same_aval(ty, u, v):
                return differ(f"input {u.aval.str_short()} vs {v.aval.str_short()}")
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
            if not same_params(ty, index[id(e1)], e1, e2):
                return False
            for u, v in zip(e1.outvars, e2.outvars):
                if compat.is_dropvar(u) != compat.is_dropvar(v):
                    return differ("another output", e1)
                if not compat.is_dropvar(u):
                    if not same_aval(ty, u, v):
                        return differ(f"output {u.aval.str_short()} vs {v.aval.str_short()} "
                                      f"(batch axis {ty.axis(u) if ty else None})", e1)
                    m[u] = v
        return all(same_atom(u, v) for u, v in zip(j1.outvars, j2.outvars))

    return same_jaxpr(typing, full, sliced, consts_full, consts_sliced)
