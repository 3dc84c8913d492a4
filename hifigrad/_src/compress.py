"""`compress_checkpoints`: compressed activation checkpoints on a model as it is written.

A user's model already says what to checkpoint: `jax.checkpoint` / `jax.remat`, Flax's
``nn.remat`` and ``nnx.remat``, Equinox's ``eqx.filter_checkpoint``, a trainer's
``lax.scan(jax.checkpoint(layer, policy=...), ...)``. All of them stage one primitive, ``remat``
(``remat2`` in the jaxpr). `compress_checkpoints(fun, codec)` traces ``fun`` to a jaxpr and
evaluates it again with each ``remat`` equation, at any depth, replaced by a hifigrad
compressed checkpoint (`checkpoint.checkpoint_call`): the forward is the same program, but
what the checkpoint saves for the backward is encoded with the codec, and its backward is
recomputed in the policy's tangent precision (float32 by default), as `hifigrad.scan` does.

Which inputs of a checkpoint are encoded: the float ones that are *activations*, i.e. values
the program computed that would not stay alive anyway. Values that stay alive are saved as
they are, never encoded (encoding them saves no memory and adds error): the function's own
inputs (parameters, the batch), constants, a scan's consts and its per-step slices of ``xs``
(stacked per-layer parameters), a while loop's consts, and any cast, reshape, broadcast,
transpose or slice of one of those (``w.astype(bf16)``, ``params[i]``). Everything else a
checkpoint takes that is a float (a scan's or a loop's carry, a previous layer's output) is
encoded. Integer, bool and typed-key inputs (per-layer PRNG keys) are saved as they are.

A scan whose ``xs`` include a transposed stack of weights (``nnx.scan(in_axes=1)``,
``nn.scan(variable_axes={"params": 1})``, MaxText's ``param_scan_axis=1``) that its body only
passes to checkpoints is run reading each step's slice from the untransposed stack, where the
platform would otherwise copy the stack for the loop (XLA:CPU; `policy.auto_choices`'
``"stacks"``): the checkpoint saves the stack and the step's index instead of the slice
(`checkpoint.Derived`). The values are the same; the copy is gone.

What a checkpoint's own policy marks saveable (``save_only_these_names``,
``dots_saveable``, ...) is not kept: with ``save="inputs"`` the block is recomputed from its
decoded inputs, as with ``jax.checkpoint(..., policy=nothing_saveable)`` (saving those
residuals uncompressed would cost the memory the codec saves); ``save="residuals"`` saves
hifigrad's own choice of residuals, encoded (see `hifigrad.checkpoint`).

Where nothing is rewritten: a scan, loop, branch or jit that holds no checkpoint is re-bound
unchanged; so is a `custom_jvp` / `custom_vjp` function (its own rule decides what its
derivative saves; a checkpoint inside its primal is never differentiated).

The trace is the one JAX makes for `jax.jit`: ``fun`` runs once per call on abstract values.
Its Python side effects run then; NNX ``Variable`` updates made inside it (BatchNorm
statistics, RNG counts) are written back to the caller's objects, as `nnx.grad` does.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import tree_flatten, tree_unflatten

from . import compat
from .checkpoint import Derived, check_checkpoint_args, checkpoint_call
from .dtypes import is_real_float
from .policy import Policy, auto_choices, current_platform

__all__ = ["compress_checkpoints"]

# Primitives whose output is a cast or a rearrangement of its (one) float operand: the output
# of one applied to a value that stays alive is a parameter-like value, never encoded.
_STRUCTURAL = frozenset("""
    convert_element_type reshape broadcast_in_dim transpose squeeze expand_dims copy copy_p
    slice dynamic_slice rev reduce_precision sharding_constraint device_put pvary pcast
    mesh_cast reshard
    """.split())


def _is_activation_dtype(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    return dt is not None and is_real_float(dt)


@functools.lru_cache(maxsize=4096)
def _holds_remat(jaxpr) -> bool:
    """Whether `jaxpr` (open) holds a `remat` equation at any depth outside custom rules."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is compat.remat_p:
            return True
        if eqn.primitive in _OPAQUE:
            continue
        if any(_holds_remat(compat.jaxpr_and_consts(j)[0])
               for j in compat.jaxprs_in_params(eqn.params)):
            return True
    return False


_OPAQUE = frozenset(p for p in (compat.custom_jvp_call_p, compat.custom_vjp_call_p) if p)


class _Rewriter:
    """Evaluates a jaxpr, replacing each `remat` equation with a compressed checkpoint.

    Each value carries an *alive* flag: True for values that stay alive anyway (see the
    module docstring), which a checkpoint saves as they are."""

    def __init__(self, codec, policy: Policy, save: str, slices: int | None = None):
        self.codec, self.policy, self.save, self.slices = codec, policy, save, slices
        # The jaxpr being evaluated: its vars made by a transpose -> (operand, permutation)
        # (a scan over a transposed stack, `_scan`); and traced values that are one scan
        # step's slice of a loop invariant: id -> (value, `Derived`), read by `remat`.
        self.transposed: dict = {}
        self.derived: dict = {}

    def eval(self, jaxpr, consts: Sequence, args: Sequence, alive: Sequence[bool]):
        outer, self.transposed = self.transposed, {}
        try:
            return self._eval(jaxpr, consts, args, alive)
        finally:
            self.transposed = outer

    def _eval(self, jaxpr, consts: Sequence, args: Sequence, alive: Sequence[bool]):
        env: dict = {}

        def read(v):
            return (v.val, True) if compat.is_literal(v) else env[v]

        def write(v, x, a):
            if not compat.is_dropvar(v):
                env[v] = (x, bool(a))

        for v, c in zip(jaxpr.constvars, consts):
            write(v, c, True)
        for v, x, a in zip(jaxpr.invars, args, alive):
            write(v, x, a)
        for eqn in jaxpr.eqns:
            vals, flags = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
            outs, out_alive = self.eqn(eqn, list(vals), list(flags))
            for v, x, a in zip(eqn.outvars, outs, out_alive):
                write(v, x, a)
            if eqn.primitive.name == "transpose":
                self.transposed[eqn.outvars[0]] = (vals[0], tuple(eqn.params["permutation"]))
        res = [read(v) for v in jaxpr.outvars]
        return [x for x, _ in res], [a for _, a in res]

    def eval_closed(self, closed, args, alive):
        jaxpr, consts = compat.jaxpr_and_consts(closed)
        return self.eval(jaxpr, consts, args, alive)

    def eqn(self, eqn, vals, alive):
        prim = eqn.primitive
        if prim is compat.remat_p:
            return self.remat(eqn, vals, alive), [False] * len(eqn.outvars)
        subs = compat.jaxprs_in_params(eqn.params)
        if subs and prim not in _OPAQUE and any(
                _holds_remat(compat.jaxpr_and_consts(j)[0]) for j in subs):
            rule = _RULES.get(prim)
            if rule is not None:
                with compat.eqn_context(eqn):
                    return rule(self, eqn, vals, alive)
        outs = compat.bind_eqn(eqn, vals)
        if prim.name in _STRUCTURAL:
            floats = [a for v, a in zip(eqn.invars, alive)
                      if not compat.is_literal(v) and _is_activation_dtype(v.aval)]
            keep = bool(floats) and all(floats)
        else:
            keep = False
        return outs, [keep] * len(outs)

    # -------------------------------------------------------------------- the checkpoint
    def remat(self, eqn, vals, alive):
        closed = eqn.params["jaxpr"]
        jaxpr, consts = compat.jaxpr_and_consts(closed)
        # The block as written (checkpoints nested in it stay plain `jax.checkpoint`s: they
        # only act during this block's own recomputation). `checkpoint` reads its program
        # and resizes it to slices of the batch where its backward may run in slices.
        body = functools.partial(_eval_plain_args, jaxpr, consts)
        flat = [jnp.asarray(x) if not isinstance(x, jax.Array) else x for x in vals]
        # (`_scan` records slices only with save="inputs"; each entry keeps its value alive,
        # so an id names one value)
        derived = {i: self.derived[id(x)][1] for i, x in enumerate(vals) if id(x) in self.derived}
        encode = [not a and _is_activation_dtype(v.aval) and i not in derived
                  for i, (v, a) in enumerate(zip(eqn.invars, alive))]
        in_tree = jax.tree_util.tree_structure(tuple(flat))
        with compat.eqn_context(eqn):
            out = checkpoint_call(lambda *a: list(body(*a)), flat, in_tree, encode, self.codec,
                                  self.policy, self.save, backward_slices=self.slices,
                                  derived=derived)
        return list(out)


def _eval_plain_args(jaxpr, consts, *args) -> list:
    return _eval_plain(jaxpr, consts, args)


def _eval_plain(jaxpr, consts, args) -> list:
    env: dict = {}

    def read(v):
        return v.val if compat.is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        outs = compat.bind_eqn(eqn, [read(v) for v in eqn.invars])
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not compat.is_dropvar(v))
    return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------- control flow rules
# Each re-traces its primitive through JAX's public API with the bodies rewritten, as the
# promoting interpreter's rules do (rules.py): no equation params are rebuilt by hand.

def _scan(rw: _Rewriter, eqn, vals, alive):
    nc, nk = compat.scan_split(eqn)
    body = eqn.params["jaxpr"]
    consts, init, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
    body_alive = [*alive[:nc], *([False] * nk), *alive[nc + nk:]]
    sliced = _sliced_in_steps(rw, eqn, nc + nk)
    length = eqn.params["length"]

    def step(carry, x):
        x = list(x or ())
        if sliced:  # the transposed stacks' slices, read from the untransposed arrays
            index = x.pop()
            got = iter(x)
            x = []
            for j in range(len(xs)):
                if j in sliced:
                    d = Derived(sliced[j][0], index, *sliced[j][1:])
                    v = d.value()
                    rw.derived[id(v)] = (v, d)
                    x.append(v)
                else:
                    x.append(next(got))
        outs, _ = rw.eval_closed(body, [*consts, *carry, *x], body_alive)
        return outs[:nk], outs[nk:]

    xs_in = [x for j, x in enumerate(xs) if j not in sliced]
    if sliced:
        xs_in.append(jnp.arange(length, dtype=jnp.int32))
    # this scan's slices are known inside its body, an enclosing scan's stay known there too
    outer, rw.derived = rw.derived, dict(rw.derived)
    try:
        carry, ys = lax.scan(step, list(init), xs_in or None, length=length,
                             reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
    finally:
        rw.derived = outer
    outs = [*carry, *ys]
    return outs, [False] * len(outs)


def _sliced_in_steps(rw: _Rewriter, eqn, first_x: int) -> dict:
    """{xs position: (untransposed array, axis, perm)} for each of a scan's ``xs`` that is a
    transpose of a float array and that the body passes only to checkpoints.

    A framework's scan over layers whose weights are stacked along another axis than the first
    (``nnx.scan(..., in_axes=1)``, ``nn.scan(variable_axes={"params": 1})``, MaxText's
    ``param_scan_axis=1``) transposes every stack before the loop: on XLA:CPU (and wherever
    the loop's operands get the default layout) a copy of every scanned weight, live from the
    forward to the end of the backward, and a second stack for their gradients. Reading each
    step's slice from the untransposed array instead (the checkpoint saving the array and the
    step's index, `checkpoint.Derived`) gives each step the same weights, bit for bit, without
    the copy; the slices' cotangents go back into one gradient of the untransposed shape.
    Where the platform makes no copy (a TPU: `policy.auto_choices`), the scan runs as
    written."""
    if rw.save != "inputs" or auto_choices(current_platform())["stacks"] != "slices":
        return {}
    body = compat.jaxpr_and_consts(eqn.params["jaxpr"])[0]
    out: dict = {}
    for j, v in enumerate(eqn.invars[first_x:]):
        made = None if compat.is_literal(v) else rw.transposed.get(v)
        if made is None or not is_real_float(v.aval.dtype):
            continue
        source, perm = made
        binder = body.invars[first_x + j]
        uses = [e for e in body.eqns if binder in e.invars]
        if not uses or any(e.primitive is not compat.remat_p for e in uses) or any(
                binder is o for o in body.outvars):
            continue
        axis = perm[0]
        rest = tuple(q - (q > axis) for q in perm[1:])
        out[j] = (source, axis, None if rest == tuple(range(len(rest))) else rest)
    return out


def _while(rw: _Rewriter, eqn, vals, alive):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
    body_alive = [*alive[cn:cn + bn], *([False] * len(init))]

    def cond_fun(carry):
        return _eval_closed_plain(eqn.params["cond_jaxpr"], [*cconsts, *carry])[0]

    def body_fun(carry):
        return rw.eval_closed(eqn.params["body_jaxpr"], [*bconsts, *carry], body_alive)[0]

    out = lax.while_loop(cond_fun, body_fun, list(init))
    return list(out), [False] * len(out)


def _cond(rw: _Rewriter, eqn, vals, alive):
    index, ops, ops_alive = vals[0], vals[1:], alive[1:]

    def branch(br):
        return lambda *a: rw.eval_closed(br, list(a), ops_alive)[0]

    outs = lax.switch(index, [branch(b) for b in eqn.params["branches"]], *ops)
    return list(outs), [False] * len(outs)


def _call(rw: _Rewriter, eqn, vals, alive):
    """jit and closed calls: inlined (under the caller's trace), kept as a named scope."""
    closed = next(eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params)
    with jax.named_scope(str(eqn.params.get("name", eqn.primitive.name))):
        return rw.eval_closed(closed, vals, alive)


def _shard_map(rw: _Rewriter, eqn, vals, alive):
    closed = eqn.params["jaxpr"]
    outs = compat.shard_map_call(lambda *a: tuple(rw.eval_closed(closed, list(a), alive)[0]),
                                 eqn.params, vals)
    return outs, [False] * len(outs)


def _eval_closed_plain(closed, args):
    jaxpr, consts = compat.jaxpr_and_consts(closed)
    return _eval_plain(jaxpr, consts, args)


_RULES = {p: r for p, r in (
    (compat.scan_p, _scan), (compat.while_p, _while), (compat.cond_p, _cond),
    (compat.pjit_p, _call), (compat.closed_call_p, _call),
    (compat.shard_map_p, _shard_map)) if p is not None}


# ---------------------------------------------------------------------- the public transform

def _is_dynamic(x) -> bool:
    """Leaves traced as inputs: arrays (and tracers). Anything else (Python numbers, strings,
    callables, None) is static, closed over as it is, as `eqx.filter_jit` does."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _nnx_variable_type():
    nnx = sys.modules.get("flax.nnx")  # a model with NNX Variables has imported it
    return getattr(nnx, "Variable", None) if nnx is not None else None


def _get_value(var):
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set_value(var, value):
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


def compress_checkpoints(fun: Callable, codec, *, policy: Policy | None = None,
                         tangent_dtype=None, save: str = "inputs",
                         backward_slices: int | None = None) -> Callable:
    """Makes every checkpoint in ``fun`` save its activations encoded with `codec`.

    ``fun``'s checkpoints (`jax.checkpoint` / `jax.remat`, ``nn.remat``, ``nnx.remat``,
    ``eqx.filter_checkpoint``, with or without a checkpoint policy), at any depth (inside
    ``lax.scan``, ``nn.scan``, ``nnx.scan``, while loops, ``jax.jit``, conditionals,
    ``shard_map``), become hifigrad compressed checkpoints: each saves the float activations
    it takes (a scan's carry, a previous layer's output) encoded, and recomputes its block in
    the backward in ``policy``'s tangent precision (float32 by default), as `hifigrad.scan`
    does. Parameters, per-step slices of a scan's ``xs``, constants, and integer, bool and
    PRNG-key inputs are saved as they are. The forward is ``fun``'s own (bitwise), and the
    result composes with `jax.grad`, `hifigrad.grad`, `nnx.grad`, `eqx.filter_grad`,
    `jax.jit` and `jax.vmap`.

    A checkpoint's own policy (``save_only_these_names(...)``, ...) is replaced: with
    ``save="inputs"`` the block is recomputed from its decoded inputs; ``save="residuals"``
    saves hifigrad's choice of residuals, encoded (see `hifigrad.checkpoint`).

    Args:
      fun: the function (a loss, a model's apply); its arguments are pytrees whose array
        leaves are traced and whose other leaves (numbers, strings, callables) are static.
      codec: a codec or its name ("none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
        "int2"), positional or by keyword (as `hifigrad.checkpoint` takes it).
      policy: a `hifigrad.Policy` for the recomputed backward (float32 by default).
      tangent_dtype: shorthand for ``Policy(tangent_dtype=...)``.
      save: ``"inputs"`` or ``"residuals"``, as in `hifigrad.checkpoint`.
      backward_slices: as in `hifigrad.checkpoint`: the batch slices each checkpoint's
        recomputed backward runs in (None: automatic; 1: never slice). Slicing happens only
        where the block is proven separable; `hifigrad.slice_report` says, per checkpoint,
        whether it was and what stopped it.

    Returns:
      A function with ``fun``'s signature and outputs.

    Raises:
      ValueError: an unknown codec name or ``save`` mode; ``tangent_dtype`` conflicts with
        ``policy.tangent_dtype``.
      TypeError: ``codec`` is neither a name nor a codec, or is a delayed-scaling codec
        (its state must be threaded: use `hifigrad.scan` with ``codec_state``); ``policy``
        is not a `hifigrad.Policy`.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> def loss(ws, x):          # a remat scan, as a trainer writes it
      ...     layer = jax.checkpoint(lambda c, w: (jnp.tanh(c @ w), None))
      ...     return jax.lax.scan(layer, x, ws)[0].sum()
      >>> ws, x = jnp.ones((4, 8, 8)) * 0.1, jnp.ones((2, 8))
      >>> g = jax.grad(hg.compress_checkpoints(loss, "int8"))(ws, x)
      >>> g.shape, g.dtype
      ((4, 8, 8), dtype('float32'))
    """
    codec, policy, save, slices = check_checkpoint_args(
        "compress_checkpoints", fun, codec, policy, tangent_dtype, save, backward_slices)
    rewriter = _Rewriter(codec, policy, save, slices)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        var_type = _nnx_variable_type()
        is_leaf = (lambda x: isinstance(x, var_type)) if var_type is not None else None
        leaves, tree = tree_flatten((args, kwargs), is_leaf=is_leaf)
        variables = [i for i, x in enumerate(leaves) if is_leaf is not None and is_leaf(x)]
        values = list(leaves)
        for i in variables:
            values[i] = _get_value(leaves[i])
        dyn = [i for i, x in enumerate(values) if _is_dynamic(x)]
        out_box: list = []

        def traced(*dyn_vals):
            full = list(values)
            for i, x in zip(dyn, dyn_vals):
                full[i] = x
            for i in variables:
                # A fresh Variable (the caller's, rebuilt as a pytree around this trace's
                # value), so that updates `fun` makes are seen here and written back below.
                full[i] = tree_unflatten(jax.tree_util.tree_structure(leaves[i]), [full[i]])
            a, k = tree_unflatten(tree, full)
            out = fun(*a, **k)
            out_leaves, out_tree = tree_flatten(out)
            dyn_out = [j for j, x in enumerate(out_leaves) if isinstance(x, jax.Array)]
            updates = [_get_value(full[i]) for i in variables]
            out_box.append((out_tree, out_leaves, dyn_out))
            return [out_leaves[j] for j in dyn_out], updates

        dyn_vals = [values[i] for i in dyn]
        jaxpr, consts, _ = compat.make_jaxpr_closed(traced, *dyn_vals)
        if not _holds_remat(jaxpr):
            warnings.warn(
                f"hifigrad.compress_checkpoints: {getattr(fun, '__name__', fun)!r} has no "
                f"checkpoint (jax.checkpoint / jax.remat, nn.remat, nnx.remat, "
                f"eqx.filter_checkpoint), so nothing is compressed and nothing is saved in "
                f"memory. Checkpoint the blocks whose inputs should be saved compressed, or "
                f"use hifigrad.scan / hifigrad.checkpoint.", UserWarning, stacklevel=2)
        outs, _ = rewriter.eval(jaxpr, consts, dyn_vals, [True] * len(dyn_vals))
        out_tree, out_leaves, dyn_out = out_box[-1]
        n_out = len(dyn_out)
        for i, new in zip(variables, outs[n_out:]):
            if new is not values[i]:
                _set_value(leaves[i], new)
        full_out = list(out_leaves)
        for j, x in zip(dyn_out, outs[:n_out]):
            full_out[j] = x
        return tree_unflatten(out_tree, full_out)

    return wrapped
