"""A program evaluated at a slice of its batch: the one way every checkpoint resizes a block.

`checkpoint` (and so `scan` and `compress_checkpoints`) runs a recomputed block's backward in
slices of the batch. Each slice re-runs the block's jaxpr, traced once at the full batch,
with every equation re-bound at the slice's size: a batched value's batch axis (`separable`'s
typing) `k` times shorter, shape params (a broadcast's ``shape``, a reshape's ``new_sizes``,
a full slice's ``limit_indices``, ...) divided there, everything else as traced. The user's
Python is not run again at the slice's size, so a block that bakes its shapes in
(``x.reshape(B, T, H, D)`` with Python ints) resizes as well as one that reads them.

Sub-programs are resized by their own typing: jit calls and `cond` branches are re-traced at
the slice's size, nested checkpoints re-staged, a `custom_jvp` function re-bound with its JVP
rule's program resized (analysed on its own, `separable.analyse`), a `custom_vjp` function
with its primal and forward programs resized and its backward function as the user wrote it
(run on the slice's residuals; `checkpoint` then checks the backward traced that way against
the analysed one, `separable.same_program`).

Every output is checked against the shape the typing promises (batched axes `k` times
shorter, the rest unchanged); a mismatch, or a sub-program the analysis rejects, raises
`Unresizable`, and the block's backward then runs at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, separable
from .separable import Typing, is_axis


class Unresizable(Exception):
    """The block cannot be evaluated at a slice of its batch (a reason is given).
    ``size_dependent``: at another slice size it might be (a shape JAX computed otherwise);
    else no slice size will do (a sub-program that mixes rows)."""

    def __init__(self, msg: str, size_dependent: bool = False):
        super().__init__(msg)
        self.size_dependent = size_dependent


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def expected_shape(typing: Typing, v, k: int) -> tuple:
    s = list(_shape(v))
    a = typing.axis(v)
    if a is not None:
        s[a] //= k
    return tuple(s)


def slice_aval(x, t, k: int):
    """What stands for `x` (an array) at a slice in a trace (axis `t` `k` times shorter): its
    abstract value with its sharding (under `jax.set_mesh` a value's type carries its mesh:
    without it, JAX reshards the slice's values to an empty mesh, and the backward at the
    slice is another program), or, for a value that varies along manual mesh axes inside a
    `shard_map` (a type `jax.make_jaxpr` does not take as an input), its first rows (traced,
    unused)."""
    aval = compat.aval_of(x)
    if compat.varying_axes(aval):
        return jax.lax.slice_in_dim(x, 0, np.shape(x)[t] // k, axis=t) if is_axis(t) else x
    shape = list(np.shape(x))
    if is_axis(t):
        shape[t] //= k
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    # (a weakly typed input, `jnp.full(s, 0.5)`, stays weak: else the program at the slice
    # has a cast the analysed one has not)
    weak = bool(getattr(aval, "weak_type", False))
    if mesh is not None and getattr(mesh, "shape_tuple", ()):
        return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x), sharding=sharding,
                                    weak_type=weak)
    return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x), weak_type=weak)


def eval_at(typing: Typing, args: Sequence, k: int) -> list:
    """`typing.jaxpr` on `args` (its inputs at the slice's size: batched ones `k` times
    shorter along their batch axis), each equation re-bound at that size."""
    jaxpr = typing.jaxpr
    env: dict = {}

    def read(v):
        return v.val if compat.is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, typing.consts))
    for v, x in zip(jaxpr.invars, args):
        if tuple(np.shape(x)) != expected_shape(typing, v, k):
            raise Unresizable(f"an input of shape {np.shape(x)} for "
                              f"{expected_shape(typing, v, k)}")
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        if i in typing.subs:
            outs = _nested(typing, i, eqn, invals, k)
        elif typing.involved(i) and k != 1:
            rule = separable.rule_for(eqn.primitive)
            params = rule.resize(eqn, typing, k) if (rule and rule.resize) else None
            outs = compat.bind_eqn(eqn, invals, params)
        else:
            outs = compat.bind_eqn(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            if compat.is_dropvar(v):
                continue
            if tuple(np.shape(o)) != expected_shape(typing, v, k):
                raise Unresizable(f"{eqn.primitive.name}: a result of shape {np.shape(o)} at "
                                  f"the slice, {expected_shape(typing, v, k)} expected", True)
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _at_slice(typing: Typing, k: int) -> list:
    """Abstract values of `typing.jaxpr`'s inputs at the slice's size (a loop body's)."""
    return [jax.ShapeDtypeStruct(expected_shape(typing, v, k), v.aval.dtype)
            for v in typing.jaxpr.invars]


def _retrace(typing: Typing, invals: Sequence, k: int):
    return jax.make_jaxpr(lambda *a: eval_at(typing, a, k))(*invals)


def _sub(typing: Typing, i: int, j: int) -> Typing:
    sub = typing.sub(i, j)
    if sub is None:
        raise Unresizable(f"{typing.jaxpr.eqns[i].primitive.name}: a sub-program not analysed")
    return sub


def _nested(typing: Typing, i: int, eqn, invals: Sequence, k: int) -> list:
    prim = eqn.primitive
    if prim in (compat.pjit_p, compat.closed_call_p):
        key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
        closed = _retrace(_sub(typing, i, 0), invals, k)
        return compat.bind_eqn(eqn, invals, dict(eqn.params, **{key: closed}))
    if prim is compat.cond_p:
        branches = tuple(_retrace(_sub(typing, i, j), invals[1:], k)
                         for j in range(len(eqn.params["branches"])))
        return compat.bind_eqn(eqn, invals, dict(eqn.params, branches=branches))
    if prim is compat.remat_p:
        sub = _sub(typing, i, 0)
        fn = jax.checkpoint(lambda *a: eval_at(sub, a, k),
                            prevent_cse=eqn.params.get("prevent_cse", True),
                            policy=eqn.params.get("policy"))
        with compat.eqn_context(eqn):
            return list(fn(*invals))
    if prim is compat.scan_p:
        sub = _sub(typing, i, 0)
        params = dict(eqn.params, jaxpr=_retrace(sub, _at_slice(sub, k), k))
        return compat.bind_eqn(eqn, invals, params)
    if prim is compat.while_p:
        cond, body = _sub(typing, i, 0), _sub(typing, i, 1)
        params = dict(eqn.params, cond_jaxpr=_retrace(cond, _at_slice(cond, k), k),
                      body_jaxpr=_retrace(body, _at_slice(body, k), k))
        return compat.bind_eqn(eqn, invals, params)
    if prim is compat.call_hi_primitive_p:  # what it expands to (`separable`'s reading)
        return eval_at(_sub(typing, i, 0), invals, k)
    if prim is compat.custom_jvp_call_p:
        return compat.bind_eqn(eqn, invals, _custom_jvp(typing, i, eqn, invals, k))
    if prim is compat.custom_vjp_call_p:
        return _custom_vjp(typing, i, eqn, invals, k)
    raise Unresizable(f"{prim.name}: no way to evaluate its body at a slice")


def _rule_typing(jaxpr, consts, in_types, batch, want_out: Sequence, what: str):
    """The typing of a custom rule's program (its own analysis, its outputs demanded as
    `want_out`: an axis or None each, or `ANY`: any type that does not mix rows)."""
    want = [None if w is ANY else w for w in want_out]
    typing = separable.analyse(jaxpr, in_types, batch, consts=consts, want=want,
                               free=[False] * len(jaxpr.invars))
    if typing.fatal:
        raise Unresizable(f"{what}: {typing.fatal[0].why}")
    for n, (t, w) in enumerate(zip(typing.out_types, want_out)):
        if isinstance(t, separable.Mix):
            raise Unresizable(f"{what}: {t.why}")
        if w is not ANY and t != w:
            raise Unresizable(f"{what}: result {n} is typed {t}, {w} expected")
    return typing


def _custom_jvp(typing: Typing, i: int, eqn, invals, k: int) -> dict:
    """A custom_jvp function's params at the slice's size: its primal program resized by its
    typing, and its JVP rule's program (JAX holds it traced at the full batch, a thunk of the
    tangents' symbolic zeros) resized by its own analysis, its primals typed as the call's
    operands and its tangents like their primals."""
    nc = eqn.params["num_consts"]
    call = _retrace(_sub(typing, i, 0), invals, k)
    p_types = [typing.type(v) for v in eqn.invars[nc:]]
    primals = invals[nc:]
    out_types = [typing.type(v) for v in eqn.outvars]

    def jvp(jaxpr, consts, zeros, out_zeros):
        t_types = [t for t, z in zip(p_types, zeros) if not z]
        tangents = [compat.struct_like(p, jnp.result_type(p)
                                       if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                                       else jax.dtypes.float0)
                    for p, z in zip(primals, zeros) if not z]
        want = [*out_types, *[t for t, z in zip(out_types, out_zeros) if not z]]
        rule = _rule_typing(jaxpr, consts, (*p_types, *t_types), typing.batch, want,
                            "a custom_jvp rule")
        closed = jax.make_jaxpr(lambda *a: eval_at(rule, a, k))(
            *[compat.struct_like(p, jnp.result_type(p)) for p in primals],
            *tangents)
        return compat.jaxpr_and_consts(closed)

    return compat.custom_jvp_with_rule(eqn.params, call, jvp)


def _custom_vjp(typing: Typing, i: int, eqn, invals, k: int) -> list:
    """A custom_vjp function at the slice's size: a new `jax.custom_vjp` whose primal is the
    function's primal program resized, whose forward is its forward rule's program (traced by
    JAX at the full batch) resized, and whose backward is its backward rule traced at the full
    batch and resized, each program analysed on its own (`_rule_typing`; the backward as a
    backward program: a parameter's cotangent must be a sum over the batch's rows)."""
    from .separable import SUM

    params = eqn.params
    nc = params["num_consts"]
    if params.get("symbolic_zeros"):
        raise Unresizable("a custom_vjp with symbolic zeros: its rules see which inputs are "
                          "differentiated")
    call_t = _sub(typing, i, 0)
    in_types = [typing.type(v) for v in eqn.invars]
    out_types = [typing.type(v) for v in eqn.outvars]
    primal_avals = [v.aval for v in eqn.invars[nc:]]
    nonzeros = [bool(jnp.issubdtype(a.dtype, jnp.inexact)) for a in primal_avals]
    with compat.assumption("read a custom_vjp's forward rule and residuals"):
        fwd_jaxpr, fwd_consts = compat.jaxpr_and_consts_of(
            *params["fwd_jaxpr_thunk"].call_wrapped(*nonzeros))
        _, res_tree, fwds = params["out_trees"]()
    n_res_out = len(fwd_jaxpr.outvars) - len(eqn.outvars)
    fwd_t = _rule_typing(fwd_jaxpr, fwd_consts, in_types[nc:], typing.batch,
                         [*([ANY] * n_res_out), *out_types], "a custom_vjp's forward rule")
    res_out = iter(zip(fwd_jaxpr.outvars[:n_res_out], fwd_t.out_types[:n_res_out]))
    res_avals, res_types = [], []
    for f in fwds:
        if f is None:
            v, t = next(res_out)
            res_avals.append(v.aval)
        else:
            v, t = eqn.invars[f], in_types[f]
            res_avals.append(v.aval)
        res_types.append(t)
    ct_avals = [v.aval.to_tangent_aval() for v in eqn.outvars]
    bwd = params["bwd"]

    def full_bwd(res, cts):
        return compat.custom_lin_call_bwd(bwd, list(res), list(cts))

    bwd_closed = jax.make_jaxpr(full_bwd)(
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_avals],
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ct_avals])
    bwd_jaxpr, bwd_consts = compat.jaxpr_and_consts(bwd_closed)
    ct_types = [t if is_axis(t) else SUM for t in out_types]
    bwd_t = separable.analyse(bwd_jaxpr, [*res_types, *ct_types], typing.batch,
                              consts=bwd_consts, sums=True, free=[False] * len(bwd_jaxpr.invars),
                              want=[t if is_axis(t) else None for t in in_types[nc:]])
    producer = bwd_t.producer()
    for n, (v, t_in) in enumerate(zip(bwd_jaxpr.outvars, in_types[nc:])):
        t = bwd_t.type(v)
        if isinstance(t, separable.Mix):
            raise Unresizable(f"a custom_vjp's backward rule: {t.why}")
        if is_axis(t_in) and t != t_in:
            raise Unresizable(f"a custom_vjp's backward rule: the cotangent of input {n} is "
                              f"typed {t}, its input {t_in}")
        if not is_axis(t_in) and not (t is SUM or separable.is_zero(v, producer)):
            raise Unresizable(f"a custom_vjp's backward rule: the cotangent of input {n} is "
                              f"not a sum over the batch's rows ({t})")

    @jax.custom_vjp
    def fn(*xs):
        return eval_at(call_t, xs, k)

    def fn_fwd(*xs):
        outs = eval_at(fwd_t, xs[nc:], k)
        it = iter(outs[:n_res_out])
        res = [next(it) if f is None else xs[f] for f in fwds]
        return outs[n_res_out:], res

    def fn_bwd(res, cts):
        cts_in = eval_at(bwd_t, [*res, *cts], k)
        return (*[None] * nc, *cts_in)

    fn.defvjp(fn_fwd, fn_bwd)
    with compat.eqn_context(eqn):
        return list(fn(*invals))


ANY = object()  # `_rule_typing`: a result of any type that does not mix rows
