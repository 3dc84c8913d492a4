"""Compressed activation checkpoints: `checkpoint` and `scan`.

`checkpoint(fun, codec=...)` is `jax.checkpoint` with the saved inputs *encoded*: the forward runs
`fun` as written and saves ``codec.encode(x)`` for each array input; the backward decodes them,
recomputes `fun` from the decoded inputs and runs its backward in tangent precision (`hg.vjp`).
`scan` applies the same to every step of a `lax.scan`: each step's carry is saved encoded (scan
stacks the encodings) and each step is recomputed in the backward.

At the checkpoint's boundary each input cotangent is cast to its input's dtype, as JAX requires.
Under `hg.grad` those casts are promoted away (the boundary is float32 too); under plain
`jax.grad` they round to the input's dtype, which for float32 carries and master parameters loses
nothing.

Values a function closes over (parameters under `jax.grad`) are hoisted into explicit inputs with
`jax.closure_convert`; they are saved as they are, never encoded.

The backward in batch slices (``backward_slices``, ``save="inputs"``): a float32 backward of a
bf16 block holds float32 cotangents of its big intermediates (attention scores, MLP hidden),
twice the bf16 backward's bytes. So when the cotangents are wider than the saved activations,
the recomputed backward runs in slices along the batch axis, in a `lax.scan` (one slice's
working set live at a time): each slice recomputes and differentiates its rows, the
activations' cotangents are concatenated and the parameters' summed in float32. At forward
time `checkpoint_call` decides it (`_slice_plan`): the block must be separable along the batch
axis, which `separable.batch_axes` proves from its jaxpr, and the block traced at a slice of
the batch must be the same program (`separable.same_program`); else the backward runs at once.

What is saved (``save=``):

``"inputs"`` (default, the least memory)
    As `jax.checkpoint` with nothing saveable: only the encoded inputs. The backward recomputes
    `fun` from the *decoded* inputs, so anything derived from them differs from the forward by
    the codec's error, gates included: a ReLU whose pre-activation is within the codec's error
    of zero can be open in the forward and closed in the recomputation. In that backward, a
    matmul that is the last use of a recomputed activation runs before the other matmuls on
    the same cotangent (`_freeing_first`), so that peak memory does not depend on how XLA
    happens to order them (one hidden-sized buffer more on XLA:CPU from jax 0.11.2 on).
``"residuals"`` (ActNN-style: no recomputation of the block, exact gates)
    The forward linearizes `fun` (with hifigrad, so the backward runs in tangent precision)
    and saves, for each chain of elementwise ops between linear ones (dot_general, conv,
    reductions, ...), one tensor: the chain's *input*, encoded. The backward rebuilds the
    chain's output (the next linear op's input) and its derivative from it, elementwise: cheap,
    and not a recomputation of the block's matmuls. For a pre-LN GELU MLP block that is its
    input and the first matmul's output (tanh-GELU's five intermediates are not saved). Bool
    masks (a ReLU's gate) are saved as the forward computed them, bit-packed 8 per byte, so
    the backward's gates are the forward's exactly, never recomputed from lossy data. Which
    values are saved: an encoded input or the output of a non-elementwise equation that the
    backward needs; a float one with at least as many elements as the smallest encoded input
    is encoded (smaller ones, such as LayerNorm's per-row statistics, are saved as they are),
    an integer one is saved as it is. Values that depend on no encoded input (casts of the
    parameters, constants) are recomputed in the backward from the inputs saved as they are.
    It costs more memory than ``"inputs"`` (one more activation-sized tensor per linear op)
    and computes less: the backward runs no forward matmul. Its backward orders the matmuls
    on a cotangent as ``"inputs"`` does (`_freeing_first`: 2 MiB less peak temp on
    memory_bench's int8 model on XLA:CPU from jax 0.11.2 on).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import tree_flatten, tree_unflatten

from . import compat
from .codecs import Codec, Encoded, get_codec
from .policy import Policy, effective_policy, resolve_checkpoint_policy
from .separable import call_jaxpr as _call_jaxpr

__all__ = ["SliceWarning", "checkpoint", "scan"]

_SAVE = ("inputs", "residuals")


# The adapter API: what framework adapters (`hifigrad.flax`, ...) build on. `check_save`,
# `is_float_array` and `checkpoint_call` are stable names within hifigrad; the rest of this
# module is private to it.


def check_save(save: str) -> str:
    """Returns `save` if it is a valid ``save=`` mode, else raises a ValueError naming them."""
    if save not in _SAVE:
        raise ValueError(f"save must be one of {_SAVE}; got {save!r}.")
    return save


def check_slices(backward_slices):
    """Returns `backward_slices` if valid (None or a positive int), else raises a ValueError."""
    if backward_slices is None:
        return None
    if isinstance(backward_slices, bool) or not isinstance(backward_slices, (int, np.integer)) \
            or backward_slices < 1:
        raise ValueError(f"backward_slices must be None (automatic) or a positive int (1: never "
                         f"slice the backward); got {backward_slices!r}.")
    return int(backward_slices)


def check_checkpoint_args(where: str, fun, codec, policy, tangent_dtype, save: str,
                          backward_slices, *, stateful: bool = False):
    """The arguments every compressed checkpoint takes (`checkpoint`, `scan`,
    `compress_checkpoints`), checked where it is made, with the same messages: returns
    ``(codec, policy, save, backward_slices)`` resolved. `stateful`: a delayed-scaling codec
    is allowed (`scan` threads its state)."""
    if not callable(fun):
        raise TypeError(f"{where}: expected a function to checkpoint; got {fun!r}.")
    codec = get_codec(codec)
    if _is_stateful(codec) and not stateful:
        raise TypeError(
            f"{where}: codec {codec.name!r} uses delayed scaling, whose state the caller "
            f"threads through training; use hifigrad.scan(..., codec_state=...) for it, or a "
            f"current-scaling codec such as 'fp8_e4m3'.")
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            f"{where}: `policy` is a hifigrad.Policy for the recomputed backward (a "
            f"jax.checkpoint policy does not apply: the block is recomputed from its encoded "
            f"inputs); got {policy!r}.")
    return (codec, resolve_checkpoint_policy(policy, tangent_dtype), check_save(save),
            check_slices(backward_slices))


def is_float_array(x) -> bool:
    """Whether `x` (an array or scalar) has a floating-point dtype: what a codec may encode."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _check_encodable(x):
    if isinstance(x, Encoded):
        raise TypeError("hifigrad.checkpoint: an input is already an encoded (compressed) value; "
                        "decode it first, or pass the uncompressed array.")


def _encoded_call(fun_flat: Callable, codec: Codec, policy: Policy, encode: Sequence[bool],
                  args: Sequence, consts: Sequence, save: str = "inputs", state=None,
                  slice_plan=None, derived=None):
    if save == "residuals":
        return _ckpt_res(fun_flat, codec, policy, tuple(encode), tuple(args), tuple(consts))
    derived = derived or {}
    derive = tuple((i, d.axis, d.perm) for i, d in sorted(derived.items()))
    # The sources a derived input is re-read from: not differentiated through this
    # checkpoint (the input's own cotangent carries the gradient, through the slicing that
    # made it), saved as they are: a scan's loop-invariant const and its step index.
    aux = tuple((lax.stop_gradient(d.source), d.index) for _, d in sorted(derived.items()))
    return _ckpt(fun_flat, codec, policy, tuple(encode), slice_plan, derive, tuple(args),
                 tuple(consts), {} if state is None else dict(state), aux)


@dataclasses.dataclass(frozen=True)
class Derived:
    """A checkpoint input that is one step's slice of a scanned array: ``transpose(
    index_in_dim(source, index, axis), perm)``. The checkpoint saves ``source`` (a loop
    invariant, alive anyway) and ``index`` instead of the slice, and re-reads the slice in
    its backward, so that a scan over a transposed stack of weights (``nnx.scan`` with
    ``in_axes=1``, MaxText's ``param_scan_axis=1``) needs no transposed copy of them."""

    source: Any
    index: Any
    axis: int
    perm: tuple | None  # None: no transpose after the slice

    def value(self):
        return derive_slice(self.source, self.index, self.axis, self.perm)


def derive_slice(source, index, axis: int, perm):
    """``transpose(source[..., index, ...], perm)``, the index along ``axis``."""
    x = lax.dynamic_index_in_dim(source, index, axis, keepdims=False)
    return x if perm is None else lax.transpose(x, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _ckpt(fun_flat, codec, policy, encode, plan, derive, args, consts, state, aux):
    del state, plan, derive, aux
    return fun_flat(*args, *consts)


def _ckpt_fwd(fun_flat, codec, policy, encode, plan, derive, args, consts, state, aux):
    del plan
    out = fun_flat(*args, *consts)
    kw = {"state": state} if state else {}  # a delayed-scaling codec's state
    skip = {i for i, _, _ in derive}  # re-read from `aux` in the backward, not saved
    saved = tuple(None if i in skip else codec.encode(x, **kw) if e else x
                  for i, (x, e) in enumerate(zip(args, encode)))
    dtypes = tuple(jnp.result_type(x) for x in (*args, *consts))
    return out, (saved, consts, _Dtypes(dtypes), state, aux)


def _input_cotangents(cts_in, dtypes, n_args: int) -> tuple[tuple, tuple]:
    """(args', consts') cotangents, each float one cast to its input's dtype, as JAX requires
    at a custom_vjp's boundary (under `hg.grad` these casts are promoted away)."""
    cast = [lax.convert_element_type(c, dt) if jnp.issubdtype(dt, jnp.floating) else c
            for c, dt in zip(cts_in, dtypes)]
    return tuple(cast[:n_args]), tuple(cast[n_args:])


class _Dtypes:
    """Input dtypes carried through the residuals as static data."""

    def __init__(self, dtypes):
        self.dtypes = dtypes


jax.tree_util.register_pytree_node(_Dtypes, lambda d: ((), d.dtypes),
                                   lambda aux, _: _Dtypes(aux))


def _ckpt_bwd(fun_flat, codec, policy, encode, plan, derive, res, cts):
    from .api import promoted_region

    saved, consts, dtypes, state, aux = res
    args = [codec.decode(s, dt) if e else s for s, e, dt in zip(saved, encode, dtypes.dtypes)]
    for (i, axis, perm), (source, index) in zip(derive, aux):
        args[i] = derive_slice(source, index, axis, perm)
    n = len(args)

    def backward(cts):
        if plan is not None:  # a `_SlicePlan`: the backward in batch slices
            cts_in = _sliced_backward(plan, policy, args, consts, cts)
            if checking_slices(policy):
                cts_in = _checked(plan, cts_in,
                                  _whole_backward(fun_flat, policy, args, consts, cts), cts)
            return cts_in
        return _whole_backward(fun_flat, policy, args, consts, cts)  # at once

    # Built in the tangent dtype already: not promoted again by an enclosing hg.grad.
    cts_in = promoted_region(backward, cts, policy)
    args_ct, consts_ct = _input_cotangents(cts_in, dtypes.dtypes, n)
    # The scaling state is not differentiated (like an optimizer state), nor are a derived
    # input's sources (stopped: their cotangents are never read).
    # (a source is a float array, an index an integer: its cotangent is float0)
    aux_ct = tuple((jnp.zeros_like(source), np.zeros(np.shape(index), jax.dtypes.float0))
                   for source, index in aux)
    return args_ct, consts_ct, jax.tree_util.tree_map(jnp.zeros_like, state), aux_ct


def _whole_backward(fun_flat, policy, args, consts, cts):
    from .api import _vjp
    from .rules import PROMOTE

    _, vjp_fn = _vjp(lambda *a: fun_flat(*a), (*args, *consts), False, policy, PROMOTE)
    return _freeing_first(vjp_fn, cts)


_ckpt.defvjp(_ckpt_fwd, _ckpt_bwd)


# ------------------------------------------------------------------ the backward in slices

# `backward_slices=None` (the default): the slice count when the backward's cotangents are
# wider than the activation-sized values the block computes (a bf16 block's float32
# backward), so that its working set is no larger than their own dtype's backward would
# hold; 1 otherwise (`_slice_count`).
AUTO_SLICES = 4
# A slice keeps at least this many rows (the product of its non-feature axes) for each
# matmul: enough for tensor cores and a TPU's 128-wide MXU, and a loop of a few long
# iterations rather than many short. 256, not 512: a model of 512 to 1023 tokens per step
# (4 x 128) then slices in 2 and its float32 backward costs no more than the bf16 remat
# scan's (`transformer_memory_bench.py --models`: 1.12-1.31x at once, 0.85-0.93x sliced).
MIN_SLICE_ROWS = 256


def _activations(encode, args) -> tuple[int | None, int | None, list[int]]:
    """(batch, largest, same): the activations are the encoded float inputs of at least two
    axes; the batch is the leading axis of the largest (`hg.checkpoint` also encodes
    parameters passed as arguments); `same`, the activations whose leading axis is that
    long. Which of those are sliced, and which other inputs go with them (positions, segment
    ids, per-row weights), is the analysis' to say (`separable.analyse`)."""
    acts = [i for i, (a, e) in enumerate(zip(args, encode))
            if e and np.ndim(a) >= 2 and is_float_array(a)]
    if not acts:
        # Nothing encoded (the first block of `compress_checkpoints`, whose input is the
        # function's own and stays alive): the float inputs of two or more axes are the
        # candidates, the largest giving the batch (the analysis refuses a wrong pick).
        acts = [i for i, a in enumerate(args) if np.ndim(a) >= 2 and is_float_array(a)]
    if not acts:
        return None, None, []
    big = max(acts, key=lambda i: np.size(args[i]))
    batch = np.shape(args[big])[0]
    return batch, big, [i for i in acts if np.shape(args[i])[0] == batch]


def _slice_count(slices, policy: Policy, jaxpr, flat, big: int, batch: int
                 ) -> tuple[int, str]:
    """How many batch slices the recomputed backward runs in (1: at once), and why when 1.

    Decided from what the float32 backward will hold, read off the block's program, not from
    its arguments (a float32 mask, positions or a conditioning vector passed in changes
    nothing): automatically (`slices` None), `AUTO_SLICES` when some activation-sized value
    the block computes (at least as large as its largest activation, `flat[big]`: attention
    scores, an MLP's hidden) is narrower than the tangent dtype, so that its cotangent
    would be wider than the value itself; then as many as keep at least `MIN_SLICE_ROWS` rows
    of the largest activation (its axes but the last) in each slice, dividing the batch."""
    x = flat[big]
    name = f"{jnp.result_type(x)}{list(np.shape(x))}"
    if slices is None:
        big_vals, narrow = _activation_sized(jaxpr, x, policy)
        if not narrow:
            widest = max((np.dtype(a.dtype).itemsize for a in big_vals), default=0)
            return 1, (f"one slice chosen: the block computes its activation-sized values "
                       f"(as large as its largest activation, {name}) in "
                       f"{8 * widest}-bit floats or wider, so its {policy.tangent_dtype} "
                       f"backward holds no more than they do")
        slices = AUTO_SLICES
    rows = math.prod(np.shape(x)[:-1])
    k = int(slices)
    while k > 1 and (batch % k or rows // k < MIN_SLICE_ROWS):
        k -= 1
    if k <= 1:
        why = ("one slice asked for (backward_slices=1)" if int(slices) == 1 else
               f"one slice chosen: the largest activation, {name}, has {rows} rows (its axes "
               f"but the last), fewer than 2 x {MIN_SLICE_ROWS} (each slice keeps "
               f"{MIN_SLICE_ROWS} rows per matmul), or its batch of {batch} does not divide")
        return 1, why
    return k, ""


def _activation_sized(jaxpr, x, policy: Policy) -> tuple[list, list]:
    """The float values `jaxpr` computes that are at least as large as `x` (its largest
    activation), and those of them narrower than the tangent dtype (whose cotangents are wider
    than the values themselves)."""
    tangent = np.dtype(policy.tangent_dtype).itemsize
    size = np.size(x)
    big_vals = [v.aval for v in _all_outvars(jaxpr)
                if jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.floating)
                and math.prod(getattr(v.aval, "shape", ())) >= size]
    return big_vals, [a for a in big_vals if np.dtype(a.dtype).itemsize < tangent]


def _all_outvars(jaxpr):
    """Every variable the equations of `jaxpr` make, in its sub-jaxprs too (a scan's or a
    jit's body: what the block computes)."""
    for eqn in jaxpr.eqns:
        yield from (v for v in eqn.outvars if not compat.is_dropvar(v))
        for sub in compat.jaxprs_in_params(eqn.params):
            yield from _all_outvars(compat.jaxpr_and_consts(sub)[0])


class _SlicePlan:
    """Static: the recomputed backward runs in `k` slices of a `batch`-row batch, each
    evaluating ``fun_k`` (the block's program resized to the slice, `resize.eval_at`) on its
    rows: ``in_types[i]``, input i's batch axis (None: whole in every slice);
    ``out_types[i]``, output i's (None: independent of the batch); ``out_avals``, the
    outputs at a slice."""

    def __init__(self, k, batch, fun_k, out_avals, in_types, out_types, where=""):
        self.k, self.batch, self.fun_k, self.out_avals = k, batch, fun_k, out_avals
        self.in_types, self.out_types, self.where = tuple(in_types), tuple(out_types), where

    def rows(self, shape, axis) -> int:
        """How many positions of `axis` a batch row owns (`m`: more than one once the batch
        is merged with minor axes)."""
        return shape[axis] // self.batch


class SliceWarning(UserWarning):
    """A compressed checkpoint whose float32 backward would run in batch slices (its block
    computes in a narrower dtype) cannot, and runs at once: that backward holds the float32
    cotangents of the block's largest values, more memory than a bf16 backward of it.

    Warned once per checkpoint (its source line), at the first trace, naming what stopped the
    slicing and the extra memory; `hifigrad.slice_report` says the same. ``backward_slices=1``
    (at once, asked for) silences it.

    Examples:
      >>> import hifigrad as hg
      >>> issubclass(hg.SliceWarning, UserWarning)
      True
    """


class _Unsliced(str):
    """`_slice_decision`'s reason when slicing was wanted (a bf16 block's float32 backward)
    and refused: its float32 backward runs at once and holds more than a bf16 one would."""


_warned_unsliced: set = set()


def _slice_plan(fun_flat, converted, consts, flat, encode, policy: Policy, save: str,
                slices) -> _SlicePlan | None:
    """`_slice_decision`'s plan, its reason recorded for `slice_report`; a `SliceWarning`
    once per checkpoint where slicing was wanted and refused."""
    plan, why = _slice_decision(converted, consts, flat, encode, policy, save, slices)
    for log in _SLICE_LOGS:
        log.append(str(why))
    if isinstance(why, _Unsliced) and not _SLICE_LOGS:  # (slice_report says it itself)
        where = compat.current_source() or "an unknown place"
        if where not in _warned_unsliced:
            _warned_unsliced.add(where)
            import warnings

            warnings.warn(f"hifigrad: the checkpoint at {where} runs its float32 backward at "
                          f"once, not in batch slices: {why}. Pass backward_slices=1 to that "
                          f"checkpoint to say so and silence this.", SliceWarning, stacklevel=2)
    return plan


# Lists that `slice_report` opens: each checkpoint traced meanwhile appends why its backward
# runs in slices or at once.
_SLICE_LOGS: list[list] = []


def slice_report(fun: Callable, *args, **kwargs) -> list[str]:
    """Why each compressed checkpoint in ``fun(*args, **kwargs)`` runs its float32 backward
    in batch slices, or at once.

    Traces `fun` abstractly (`jax.eval_shape`: nothing is computed) and returns one line per
    checkpoint traced (`hg.checkpoint`, each `hg.scan` step, each checkpoint
    `hg.compress_checkpoints` found), in trace order: ``"sliced: 4 slices of 16 batch rows"``
    (rows of the batch axis, the activations' leading axis), or the reason it is not, naming
    the equation that stopped it and where the code made it (``file:line (function)``): a
    reduction over the batch, a custom rule whose backward mixes rows, a value made at the
    batch's size that is not made row by row, ...

    A checkpoint traced before (a `lax.scan` body: JAX caches its trace) is traced again:
    JAX's staging caches are emptied first. A jitted step that JAX dispatches from C++ keeps
    its compiled program; one it dispatches from Python (a step with host callbacks or
    ordered effects, as the slice check's first run has) compiles again on its next call.

    Args:
      fun: what to trace, usually the gradient function (``jax.grad(loss)``); the
        decision is made when a checkpoint is called, so ``loss`` itself tells the same.
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`s).
      **kwargs: its keyword arguments.

    Returns:
      A list of strings, one per checkpoint traced.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> f = hg.checkpoint(lambda x: x - x.mean(0, keepdims=True), codec="int8",
      ...                   backward_slices=4)
      >>> hg.slice_report(jax.grad(lambda x: f(x).sum()), jnp.ones((2048, 4)))
      ['the forward mixes rows of the batch: reduce_sum at ...: reduces over the batch axis']
    """
    log: list = []
    # A checkpoint traced before (a scan body: JAX caches its trace by function) would not
    # run its Python again, and would report nothing: traced anew.
    compat.clear_tracing_caches()
    _SLICE_LOGS.append(log)
    try:
        jax.eval_shape(functools.partial(fun, **kwargs), *args)
    finally:
        _SLICE_LOGS.remove(log)
    return log


def _slice_decision(converted, consts, flat, encode, policy: Policy, save: str,
                    slices) -> tuple[_SlicePlan | None, str]:
    """How the backward of ``converted(*flat, *consts)`` (the block, closure-converted) runs:
    in slices when `_slice_count` asks for more than one and the block's program, read once
    at the full batch, is row-wise for the activations (`separable.analyse`: every value it
    resizes is computed row by row; its float outputs do not mix rows), resizes to a slice
    (`resize.eval_at`), and its backward program (custom rules traced in) gives each batched
    input's cotangent row by row and each other input's as a sum over the rows, the backward
    of the resized block being that program at the slice's size (`separable.same_program`).
    Else None: at once. The activations are tried sliced together, then the largest alone."""
    from . import separable

    if save != "inputs":
        return None, f'save="{save}" recomputes nothing: its backward runs at once'
    batch, big, same = _activations(encode, flat)
    if batch is None:
        return None, "no activation to slice (no float input of two or more axes)"
    jaxpr, jconsts, _ = compat.make_jaxpr_closed(converted, *flat, *consts)
    k, why_one = _slice_count(slices, policy, jaxpr, flat, big, batch)
    if k <= 1:
        return None, why_one
    wanted = slices is None  # automatic: a bf16 block's float32 backward
    n = len(flat) + len(consts)
    first = None
    for seeds in ([same, [big]] if len(same) > 1 else [same]):
        in_types = [0 if i in seeds else None for i in range(n)]
        typing = separable.analyse(jaxpr, in_types, batch, consts=jconsts)
        why = _forward_mixes(typing)
        if why is not None:
            first = first or f"the forward mixes rows of the batch: {why}"
            continue
        # A block resized to a slice of a few rows may be traced differently by JAX
        # (length-1 axes specialized in a rule): fewer, larger slices are tried then.
        for kk in [d for d in range(k, 1, -1) if batch % d == 0]:
            plan, why, size_dependent = _plan_for(typing, kk, flat, consts, policy)
            if plan is not None:
                return plan, why
            first = first or why
            if not size_dependent:
                break
    if wanted:
        return None, _Unsliced(f"{first}; {_widening(jaxpr, flat[big], policy)}")
    return None, first


def _widening(jaxpr, x, policy: Policy) -> str:
    """What the float32 backward of a block run at once holds more than a bf16 one: the
    cotangent of its largest value narrower than the tangent dtype, at the tangent's width
    (there is one: slicing was wanted because of it, `_slice_count`)."""
    tangent = np.dtype(policy.tangent_dtype)
    a = max(_activation_sized(jaxpr, x, policy)[1], key=lambda a: math.prod(a.shape))
    n = math.prod(a.shape)
    extra = n * (tangent.itemsize - np.dtype(a.dtype).itemsize) / 2 ** 20
    return (f"its {tangent} backward holds the cotangents of values as large as "
            f"{a.str_short()} in {tangent} ({n * tangent.itemsize / 2 ** 20:.3g} MiB each, "
            f"{extra:.3g} MiB more than in {a.dtype})")


def _forward_mixes(typing) -> str | None:
    """Why the forward's analysis forbids slicing (an effect on batched values, a float
    output that mixes rows), or None."""
    from .separable import Mix

    if typing.fatal:
        return typing.fatal[0].why
    for v, t in zip(typing.jaxpr.outvars, typing.out_types):
        if isinstance(t, Mix) and jnp.issubdtype(v.aval.dtype, jnp.inexact):
            return t.why
    return None


def _resized(typing, k, *xs):
    from .resize import eval_at

    return eval_at(typing, xs, k)


def _plan_for(typing, k: int, flat, consts, policy: Policy):
    """`_slice_decision` at `k` slices: (plan or None, why, whether the failure is the slice
    count's)."""
    from . import resize
    from .separable import SUM, NotSeparable, check_backward, is_axis, same_program

    batch = typing.batch
    full = [*flat, *consts]
    in_types = typing.in_types
    sliced = [resize.slice_aval(x, t, k) for x, t in zip(full, in_types)]
    fun_k = functools.partial(_resized, typing, k)
    try:
        out_k = jax.eval_shape(fun_k, *sliced)
    except resize.Unresizable as e:
        return (None, f"the block cannot be resized to 1/{k} of its batch ({e})",
                e.size_dependent)
    except Exception as e:  # noqa: BLE001 - a primitive that rejects the slice's shapes
        return (None, f"the block cannot be evaluated at 1/{k} of its batch "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", True)
    out_vars = typing.jaxpr.outvars
    out_types = typing.out_types
    is_float = [jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in out_vars]
    out_avals = [v.aval.update(shape=tuple(o.shape)) for v, o in zip(out_vars, out_k)]
    full_avals = [v.aval for v in out_vars]
    try:
        bwd_k, bconsts_k, _ = _backward_program(fun_k, sliced, out_avals, is_float, policy)
    except resize.Unresizable as e:  # a custom rule resized as its backward is traced
        return (None, f"the block cannot be resized to 1/{k} of its batch ({e})",
                e.size_dependent)
    except Exception as e:  # noqa: BLE001 - e.g. a custom rule that cannot run at a slice
        return None, (f"the backward cannot be traced at 1/{k} of its batch "
                      f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"), True
    fun_1 = functools.partial(_resized, typing, 1)
    bwd, bconsts, _ = _backward_program(fun_1, full, full_avals, is_float, policy)
    ct_types = [t if is_axis(t) else SUM for t, f in zip(out_types, is_float) if f]
    try:
        b_typing = check_backward(bwd, [*in_types, *ct_types], batch, len(full),
                                  consts=bconsts)
    except NotSeparable as e:
        return None, f"the backward mixes rows of the batch: {e}", False
    diff: list = []
    if not same_program(bwd, bwd_k, k, b_typing, bconsts, bconsts_k, diff):
        return None, (f"the backward at 1/{k} of the batch is another program "
                      f"({'; '.join(diff) or 'its structure differs'})"), True
    where = compat.current_source()
    plan = _SlicePlan(k, batch, fun_k, out_avals, in_types, out_types, where)
    return plan, f"sliced: {k} slices of {batch // k} batch rows", False


def _backward_program(fun, args, out_avals, is_float, policy: Policy):
    """The jaxpr of `fun`'s backward at `args` as `_sliced_backward` runs it: inputs `args`
    and the float outputs' cotangents, outputs the cotangent of each of `args`."""
    from .api import _vjp
    from .rules import PROMOTE

    n = len(args)

    float_avals = [a for a, f in zip(out_avals, is_float) if f]

    def bwd(*xs):
        _, vjp_fn = _vjp(lambda *a: fun(*a), tuple(xs[:n]), False, policy, PROMOTE)
        # (inside a shard_map, each cotangent varies along the mesh axes its output does)
        cts = [compat.match_varying(c, a) for c, a in zip(xs[n:], float_avals)]
        return vjp_fn(_all_cts(cts, out_avals, is_float))

    cts = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a, f in zip(out_avals, is_float) if f]
    jaxpr, consts, tree = compat.make_jaxpr_closed(bwd, *args, *cts)
    return (*compat.dce(jaxpr, consts), tree)


def _all_cts(float_cts, out_avals, is_float) -> list:
    """One cotangent per output: the float outputs' `float_cts` in order, float0 zeros for
    the others."""
    it = iter(float_cts)
    return [next(it) if f else np.zeros(a.shape, jax.dtypes.float0)
            for a, f in zip(out_avals, is_float)]


def _split(x, axis: int, m: int, k: int, batch: int):
    """`x` as `k` slices along its batch axis `axis` (`batch` rows of `m` positions each),
    stacked on a new leading axis: slice i holds the rows i, i + k, i + 2k, ..."""
    s = tuple(np.shape(x))
    x = x.reshape(*s[:axis], batch // k, k, m, *s[axis + 1:])
    x = jnp.moveaxis(x, axis + 1, 0)
    return x.reshape(k, *s[:axis], (batch // k) * m, *s[axis + 1:])


def _unsplit(y, axis: int, m: int, k: int, batch: int, shape):
    """The inverse of `_split`: `k` stacked slices back to the whole of `shape`."""
    s = tuple(shape)
    y = y.reshape(k, *s[:axis], batch // k, m, *s[axis + 1:])
    y = jnp.moveaxis(y, 0, axis + 1)
    return y.reshape(s)


# The loop over slices (`lax.scan`: one slice's working set live at a time). Tests swap in an
# eager Python loop with the same contract to check thousands of programs without compiling.
_SLICE_LOOP = lax.scan


def _sliced_backward(plan: _SlicePlan, policy: Policy, args, consts, cts):
    """The input cotangents of the block at ``(*args, *consts)``, its backward run in
    ``plan.k`` slices along the batch axis.

    Each slice recomputes its rows of the block (`resize.eval_at`) and runs their backward:
    the same matmuls as the unsliced backward, on `k` times fewer rows. A batched input's
    cotangent is the slices' put back in place; every other input's (parameters) is the sum
    over slices, accumulated in float32 (or wider); a batched output's cotangent goes with
    its rows, an output independent of the batch has its whole cotangent taken once, in
    slice 0 (its sum over the slices). Slice i holds the batch rows i, i + k, i + 2k, ... (any
    partition of a row-wise block's rows gives the same cotangents): a batch sharded along
    its axis stays sharded, each device slicing its own rows, where contiguous slices made
    XLA's SPMD partitioner gather the batch on every device.
    """
    from .api import _vjp
    from .rules import PROMOTE
    from .separable import is_axis

    k, batch, fun_k, out_avals = plan.k, plan.batch, plan.fun_k, plan.out_avals
    everything = (*args, *consts)
    flat_cts, ct_tree = tree_flatten(cts)
    is_float = [jnp.issubdtype(a.dtype, jnp.inexact) for a in out_avals]

    def split(x, t):
        return _split(x, int(t), plan.rows(np.shape(x), int(t)), k, batch)

    xs_in = [split(x, t) for x, t in zip(everything, plan.in_types) if is_axis(t)]
    float_cts = [(c, t) for c, f, t in zip(flat_cts, is_float, plan.out_types) if f]
    xs_cts = [split(c, t) for c, t in float_cts if is_axis(t)]
    others = [(i, x) for i, (x, t) in enumerate(zip(everything, plan.in_types))
              if not is_axis(t)]
    acc_dtype = {i: max((np.dtype(jnp.float32), np.dtype(jnp.result_type(x)),
                         np.dtype(policy.tangent_dtype)), key=lambda t: t.itemsize)
                 for i, x in others if jnp.issubdtype(jnp.result_type(x), jnp.inexact)}
    # The batched float and complex inputs' cotangent rows (an integer input's is float0:
    # made whole).
    rows_out = [i for i, (x, t) in enumerate(zip(everything, plan.in_types))
                if is_axis(t) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]

    def body(acc, xs):
        x_sl, c_sl, i = xs
        it, it_c = iter(x_sl), iter(c_sl)
        inputs = [next(it) if is_axis(t) else x for x, t in zip(everything, plan.in_types)]
        c_all = [next(it_c) if is_axis(t) else jnp.where(i == 0, c, jnp.zeros_like(c))
                 for c, t in float_cts]
        cts_sl = _all_cts(c_all, out_avals, is_float)
        _, vjp_fn = _vjp(lambda *a: fun_k(*a), tuple(inputs), False, policy, PROMOTE)
        cts_in = _freeing_first(vjp_fn, tree_unflatten(ct_tree, cts_sl))
        acc = {j: acc[j] + cts_in[j].astype(acc[j].dtype) for j in acc}
        return acc, [cts_in[j] for j in rows_out]

    acc0 = {i: jnp.zeros(np.shape(x), acc_dtype[i]) for i, x in others if i in acc_dtype}
    acc, ys = _SLICE_LOOP(body, acc0, (xs_in, xs_cts, jnp.arange(k)))
    rows = {i: _unsplit(y, int(plan.in_types[i]),
                        plan.rows(np.shape(everything[i]), int(plan.in_types[i])), k, batch,
                        np.shape(everything[i]))
            for i, y in zip(rows_out, ys)}
    return tuple(
        rows[i] if i in rows else acc[i] if i in acc
        else np.zeros(np.shape(x), jax.dtypes.float0)
        for i, x in enumerate(everything))


# ------------------------------------------------------------------ checking the slices

# `Policy(check_slices=True)`, or this environment variable set to 1, checks every sliced
# backward against the whole one (see `checking_slices`).
CHECK_SLICES_ENV = "HIFIGRAD_CHECK_SLICES"


class SliceCheckError(RuntimeError):
    """A checkpoint's sliced backward differs from its unsliced backward (a hifigrad bug:
    please report it with the message). Raised where `Policy(check_slices=True)` (or the
    environment variable ``HIFIGRAD_CHECK_SLICES=1``) asks for the check: directly when the
    backward runs eagerly; under `jax.jit` JAX reports it as the runtime error of the
    callback that made the check, with the same message.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> f = hg.checkpoint(lambda x: jnp.tanh(x) * 2, "int8", backward_slices=2,
      ...                   policy=hg.Policy(check_slices=True))
      >>> g = jax.grad(lambda x: f(x).sum())(jnp.ones((1024, 4)))  # checked: no error
      >>> issubclass(hg.SliceCheckError, RuntimeError)
      True
    """


def checking_slices(policy: Policy) -> bool:
    """Whether a sliced backward is checked against the whole one: `Policy.check_slices`, or
    ``HIFIGRAD_CHECK_SLICES=1`` in the environment (read when the backward is traced)."""
    import os

    env = os.environ.get(CHECK_SLICES_ENV, "").strip().lower()
    return bool(getattr(policy, "check_slices", False)) or env in ("1", "true", "yes", "on")


def slice_tolerance(dtypes) -> float:
    """The norm-wise relative difference between a sliced and an unsliced backward beyond
    which they differ: 2**-10 (about 1e-3) when the block computes in float32 or wider, the
    two differing only in the order of float32 sums (a few ulps: 2e-7 measured); for a block
    computing in a narrower dtype, 4 of its eps (bf16: 2**-5), since XLA may round the
    recomputed forward's low-precision values differently at another batch size (measured on
    a bf16 attention block, XLA:CPU: 8e-4 with XLA's default flags, 2e-7 with
    ``--xla_allow_excess_precision=false``). Every wrong slicing found so far was off by 10%
    or more."""
    narrow = [jnp.finfo(dt).eps for dt in dtypes if jnp.issubdtype(dt, jnp.floating)
              and np.dtype(dt).itemsize < 4]
    return max([2.0 ** -10, *(4 * float(e) for e in narrow)])


def _wide(x):
    """`x` in float32 (complex64 if complex) or wider: what the check compares in."""
    dt = jnp.result_type(x)
    wide = jnp.complex64 if jnp.issubdtype(dt, jnp.complexfloating) else jnp.float32
    return jnp.asarray(x, jnp.promote_types(dt, wide))


def _checked(plan: _SlicePlan, sliced, whole, cts=()):
    """`sliced`, after checking it against `whole` when the program runs: a norm-wise
    difference above `slice_tolerance` for any input (relative to the largest of its own
    cotangent, the block's largest and the output cotangents `cts`) raises `SliceCheckError`
    naming the checkpoint's source line."""
    pairs = [(i, s, w) for i, (s, w) in enumerate(zip(sliced, whole))
             if jnp.issubdtype(jnp.result_type(w), jnp.inexact)]
    if not pairs:
        return sliced
    tol = slice_tolerance([jnp.result_type(a) for a in plan.out_avals])
    # Each input's difference relative to the largest of its own cotangent, the block's
    # largest and the output cotangents': a cotangent that is zero up to rounding (an
    # attention key bias's: softmax ignores it; every input's through a softmax summed over
    # its own axis) is the rounding of terms as large as the others' or the outputs', and
    # its own norm says nothing of a wrong slicing (0.6 "off" on a TPU, 1e-7 of the block's
    # largest). Every wrong slicing seen was off by 1e-2 of the cotangents or more.
    diffs, norms = [], []
    for _, s, w in pairs:
        s32, w32 = _wide(s), _wide(w)
        diffs.append(jnp.linalg.norm((s32 - w32).ravel()))
        norms.append(jnp.linalg.norm(w32.ravel()))
    ct_norm = jnp.sqrt(sum((jnp.linalg.norm(_wide(c).ravel()) ** 2
                            for c in jax.tree_util.tree_leaves(cts)
                            if jnp.issubdtype(jnp.result_type(c), jnp.inexact)),
                           jnp.float32(0)))
    norms = jnp.stack(norms)
    errs = jnp.stack(diffs) / jnp.maximum(jnp.maximum(norms, jnp.max(norms)),
                                          jnp.maximum(ct_norm, jnp.float32(1e-30)))
    names = [i for i, _, _ in pairs]
    where = plan.where or "an unknown place"

    def report(errs):
        errs = np.asarray(errs)
        bad = [(n, e) for n, e in zip(names, errs) if not (e <= tol)]
        if bad:
            n, e = bad[0]
            raise SliceCheckError(
                f"hifigrad: the checkpoint at {where} ran its backward in {plan.k} batch "
                f"slices and got input {n}'s cotangent {e:.3g} away (norm-wise, relative to "
                f"the block's largest) from its unsliced backward (tolerance {tol:.3g}). "
                f"This is a hifigrad bug: "
                f"please report it with this message. Meanwhile backward_slices=1 runs "
                f"that checkpoint's backward at once.")

    jax.debug.callback(report, errs)
    return sliced


# ------------------------------------------------------------------ the backward's op order

_CONTRACTIONS = frozenset(("dot_general", "conv_general_dilated"))
_CASTS = frozenset(("convert_element_type", "hifigrad_upcast"))


def _is_contraction(eqn) -> bool:
    """A dot_general / conv, or a call or cond whose every branch holds one contraction
    (`Policy(matmul='fast')` stages each backward matmul in a `platform_dependent` cond)."""
    if eqn.primitive.name in _CONTRACTIONS:
        return True
    subs = [compat.jaxpr_and_consts(j)[0] for j in compat.jaxprs_in_params(eqn.params)]
    return bool(subs) and all(
        sum(_is_contraction(e) for e in s.eqns) == 1 for s in subs)


def _freeing_first(vjp_fn: Callable, cts):
    """``vjp_fn(cts)``, with each recomputed activation freed before a new one is allocated.

    In a recomputed step's backward, one cotangent ``g`` feeds several contractions: for
    ``y = a @ W``, ``ct_W = a.T @ g`` is the last use of the recomputed activation ``a``,
    while ``ct_a = g @ W.T`` allocates a new activation-sized buffer and frees nothing. XLA
    may run them in either order; when ``ct_a`` comes first (XLA:CPU's scheduler does this
    for a GELU MLP from jax 0.11.2 on, under `jax.checkpoint` as well), ``a`` and ``ct_a``
    are live together: one more activation at the peak (+4 MiB on memory_bench's model).
    So every contraction that frees more bytes of residuals than it allocates runs before
    the other contractions on the same cotangent (looked through casts): their cotangent
    operand passes through an `lax.optimization_barrier` with the freeing ones' outputs.
    Only the order of the ops changes, not what they compute.
    """
    flat_cts, ct_tree = tree_flatten(cts)
    jaxpr, consts, out_tree = compat.make_jaxpr_closed(
        lambda *c: vjp_fn(tree_unflatten(ct_tree, list(c))), *flat_cts)
    eqns = jaxpr.eqns
    residuals = set(jaxpr.constvars)
    uses: dict = {}
    for eqn in eqns:
        for v in eqn.invars:
            if not compat.is_literal(v):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not compat.is_literal(v):
            uses[v] = uses.get(v, 0) + 2  # an output is never freed here
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars
                if not compat.is_dropvar(v)}

    def cast_source(v):
        """`v` through the casts it was made by (a residual's up-cast, a cotangent's
        rounding under `matmul='fast'`)."""
        while (v in producer and eqns[producer[v]].primitive.name in _CASTS
               and not compat.is_literal(eqns[producer[v]].invars[0])):
            v = eqns[producer[v]].invars[0]
        return v

    def nbytes(v):
        return math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize

    def net_freed(eqn):
        """Bytes of the residuals `eqn` is the last use of, less the bytes it allocates.
        Only a residual used as it is counts: one reached through an up-cast (a bf16
        model's) did not gain from the reordering on XLA:CPU (2.3 -> 2.8 MiB on the bf16 MLP
        of benchmarks/results/scan_backward_hlo.md), so that case keeps XLA's order."""
        last = {v for v in eqn.invars
                if not compat.is_literal(v) and v in residuals and uses[v] == 1}
        return (sum(nbytes(v) for v in last)
                - sum(nbytes(v) for v in eqn.outvars if not compat.is_dropvar(v)))

    def cotangents(eqn):
        return [v for v in eqn.invars if not compat.is_literal(v)
                and cast_source(v) not in residuals]

    contractions = [i for i, e in enumerate(eqns) if _is_contraction(e)]
    frees = {i for i in contractions if net_freed(eqns[i]) > 0}

    # after[i]: the freeing contractions that eqn i (one that frees nothing) must wait for,
    # and its operands the barrier is placed on (the cotangents it shares with them).
    after: dict = {}
    for i in contractions:
        if i in frees:
            continue
        shared = cotangents(eqns[i])
        roots = {cast_source(v) for v in shared}
        first = [j for j in frees
                 if any(cast_source(v) in roots for v in cotangents(eqns[j]))]
        if first:
            after[i] = (first, shared)
    if not after:
        return vjp_fn(cts)

    def ancestors(i):
        seen, stack = set(), [i]
        while stack:
            k = stack.pop()
            for v in eqns[k].invars:
                p = None if compat.is_literal(v) else producer.get(v)
                if p is not None and p not in seen:
                    seen.add(p)
                    stack.append(p)
        return seen

    deps = {i: {producer[v] for v in e.invars if not compat.is_literal(v) and v in producer}
            for i, e in enumerate(eqns)}
    for i, (first, _) in after.items():
        first = [j for j in first if i not in ancestors(j)]  # never a cycle
        after[i] = (first, after[i][1])
        deps[i] |= set(first)
    # Kahn's algorithm, in the traced order wherever the added edges allow it.
    users: dict = {i: [] for i in range(len(eqns))}
    for i, ds in deps.items():
        for d in ds:
            users[d].append(i)
    pending = {i: len(ds) for i, ds in deps.items()}
    ready = [i for i, k in pending.items() if k == 0]
    heapq.heapify(ready)
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, flat_cts))

    def read(v):
        return v.val if compat.is_literal(v) else env[v]

    while ready:
        i = heapq.heappop(ready)
        eqn = eqns[i]
        invals = [read(v) for v in eqn.invars]
        first, shared = after.get(i, ((), ()))
        if first:
            outs_first = [env[v] for j in first for v in eqns[j].outvars
                          if not compat.is_dropvar(v)]
            vals = [env[v] for v in shared]
            vals = lax.optimization_barrier((vals, outs_first))[0]
            sub = dict(zip(shared, vals))
            invals = [x if compat.is_literal(v) or v not in sub else sub[v]
                      for v, x in zip(eqn.invars, invals)]
        outs = compat.bind_eqn(eqn, invals)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not compat.is_dropvar(v))
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    return tree_unflatten(out_tree, [read(v) for v in jaxpr.outvars])


# ------------------------------------------------------------------------------ save="residuals"

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ckpt_res(fun_flat, codec, policy, encode, args, consts):
    return fun_flat(*args, *consts)


# Primitives cheap enough to recompute in the backward: elementwise ops (and comparisons,
# casts, selects), and ops that only broadcast or rearrange elements without dropping any.
# Anything else (dot_general, conv, reductions, slices, gathers, sorts, loops, unknown
# primitives) ends a chain: its output is saved when the backward needs it.
_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not
    one_minus_square or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt
    square sub tan tanh xor broadcast_in_dim reshape squeeze expand_dims transpose
    """.split())


def _cheap(eqn) -> bool:
    """Whether `eqn` is elementwise (or a call of only elementwise equations), so that the
    backward may recompute it instead of its output being saved."""
    if eqn.effects:
        return False
    if eqn.primitive.name in _ELEMENTWISE:
        return True
    sub = _call_jaxpr(eqn)
    return sub is not None and all(_cheap(e) for e in sub.eqns)


class _Plan:
    """Static: what the forward saves for the backward (held in the residuals' treedef).

    ``jaxpr`` computes `fun`'s outputs (the first ``n_out``) and the residual leaves of its
    pullback (``vjp_tree``). ``saved_vars`` are the jaxpr variables whose values the forward
    saves, each as ``kinds[i]``: ``"encode"`` (with the codec), ``"bits"`` (a bit-packed bool
    mask) or ``"keep"``. The backward seeds an environment with them, the kept inputs and
    the consts, and evaluates the equations the residual leaves need from there: elementwise
    chains, and anything that depends on no encoded input (casts of the parameters).
    """

    def __init__(self, jaxpr, n_out, vjp_tree, encoded_in, saved_vars, kinds):
        self.jaxpr, self.n_out, self.vjp_tree = jaxpr, n_out, vjp_tree
        self.encoded_in, self.saved_vars, self.kinds = encoded_in, saved_vars, kinds


jax.tree_util.register_pytree_node(_Plan, lambda p: ((), p), lambda p, _: p)


def _dependence(jaxpr, in_flags: Sequence[bool]) -> dict:
    """For each variable of `jaxpr`, whether it depends on the inputs flagged in `in_flags`.

    Call-like equations (jit, custom_jvp/vjp calls, remat) are looked into; for any other
    equation every output depends on every input (an over-approximation, which only ever makes
    a value saved rather than recomputed).
    """
    dep: dict = {v: bool(f) for v, f in zip(jaxpr.invars, in_flags)}

    def read(v):
        return False if compat.is_literal(v) else dep.get(v, False)

    for eqn in jaxpr.eqns:
        flags = [read(v) for v in eqn.invars]
        if not any(flags):
            continue
        sub = _call_jaxpr(eqn)
        if sub is not None:
            sub_dep = _dependence(sub, flags)
            out = [False if compat.is_literal(v) else sub_dep.get(v, False)
                   for v in sub.outvars]
        else:
            out = [True] * len(eqn.outvars)
        for v, f in zip(eqn.outvars, out):
            if not compat.is_dropvar(v):
                dep[v] = f
    return dep


def _choose_saved(jaxpr, n_out: int, encoded_in: Sequence[bool]) -> list:
    """The variables the forward must save so that the backward can rebuild every residual
    leaf (the outputs after the first `n_out`) by elementwise recomputation only.

    Walking back from the residual leaves: a value that depends on no encoded input is
    recomputed from the inputs kept as they are; an encoded input is saved (encoded); a float
    value computed by an elementwise equation is recomputed from that equation's inputs, so a
    chain of elementwise ops costs one saved tensor, its input; any other value (the output of
    a dot_general, a reduction, ...; a bool mask or an integer) is saved. Bool masks are saved
    as the forward computed them, so gates (a ReLU's) are exact.
    """
    dep = _dependence(jaxpr, encoded_in)
    producer = {v: e for e in jaxpr.eqns for v in e.outvars if not compat.is_dropvar(v)}
    invars = set(jaxpr.invars)
    saved, seen = [], set()
    stack = [v for v in reversed(jaxpr.outvars[n_out:]) if not compat.is_literal(v)]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in invars:
            if dep[v]:  # an encoded input
                saved.append(v)
            continue
        eqn = producer.get(v)
        if eqn is None:  # a constvar
            continue
        floating = jnp.issubdtype(v.aval.dtype, jnp.floating)
        if dep.get(v, False) and not (floating and _cheap(eqn)):
            saved.append(v)
            continue
        stack.extend(u for u in eqn.invars if not compat.is_literal(u) and u not in seen)
    return saved


def _eval_jaxpr(jaxpr, env: dict, want: Sequence, effects: bool = False) -> list:
    """The values of the variables `want`, evaluating from `env` (variables already known)
    only the equations they need (and, with `effects`, every equation that has an effect,
    such as a `jax.debug.print`)."""
    needed = {v for v in want if not compat.is_literal(v) and v not in env}
    live = []
    for eqn in reversed(jaxpr.eqns):
        outs = [v for v in eqn.outvars if not compat.is_dropvar(v)]
        if (effects and eqn.effects) or any(v in needed for v in outs):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not compat.is_literal(v) and v not in env)
    env = dict(env)

    def read(v):
        return v.val if compat.is_literal(v) else env[v]

    for eqn in reversed(live):
        outs = compat.bind_eqn(eqn, [read(v) for v in eqn.invars])
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not compat.is_dropvar(v))
    return [read(v) for v in want]


def _pack_bits(x):
    return jnp.packbits(x.reshape(-1))


def _unpack_bits(packed, aval):
    n = math.prod(aval.shape)
    return jnp.unpackbits(packed, count=n).astype(jnp.bool_).reshape(aval.shape)


def _ckpt_res_fwd(fun_flat, codec, policy, encode, args, consts):
    from .api import _vjp
    from .rules import PROMOTE

    box: list = []

    def outs_and_residuals(*xs):
        out, vjp_fn = _vjp(lambda *a: fun_flat(*a), xs, False, policy, PROMOTE)
        leaves, tree = tree_flatten(vjp_fn)
        box.append((tree, len(out)))
        return [*out, *leaves]

    everything = (*args, *consts)
    jaxpr, jconsts, _ = compat.make_jaxpr_closed(outs_and_residuals, *everything)
    vjp_tree, n_out = box[-1]
    encoded_in = tuple(encode) + (False,) * len(consts)
    saved_vars = _choose_saved(jaxpr, n_out, encoded_in)
    env = dict(zip(jaxpr.constvars, jconsts))
    env.update(zip(jaxpr.invars, everything))
    # The output is `fun`'s own (bitwise, as the forward of a checkpoint must be): the
    # linearized program computes its primal with JAX's JVP rules, whose bf16 roundings may
    # differ. Only the saved values are read from that program (its effects run in `fun`).
    out = fun_flat(*args, *consts)
    values = _eval_jaxpr(jaxpr, env, list(saved_vars))

    sizes = [math.prod(np.shape(a)) for a, e in zip(args, encode) if e]
    min_size = min(sizes) if sizes else math.inf
    kinds, saved = [], []
    for x in values:
        dt = jnp.result_type(x)
        if jnp.issubdtype(dt, jnp.floating) and math.prod(np.shape(x)) >= min_size:
            kinds.append("encode")
            saved.append(codec.encode(x))
        elif dt == jnp.bool_:
            kinds.append("bits")
            saved.append(_pack_bits(x))
        else:
            kinds.append("keep")
            saved.append(x)
    kept = [x for x, e in zip(everything, encoded_in) if not e]
    plan = _Plan(jaxpr, n_out, vjp_tree, encoded_in, tuple(saved_vars), tuple(kinds))
    dtypes = _Dtypes(tuple(jnp.result_type(x) for x in everything))
    return out, (saved, kept, list(jconsts), plan, dtypes)


def _ckpt_res_bwd(fun_flat, codec, policy, encode, res, cts):
    del fun_flat
    saved, kept, jconsts, plan, dtypes = res
    jaxpr = plan.jaxpr
    env = dict(zip(jaxpr.constvars, jconsts))
    env.update(zip([v for v, e in zip(jaxpr.invars, plan.encoded_in) if not e], kept))
    for v, kind, s in zip(plan.saved_vars, plan.kinds, saved):
        if kind == "encode":
            env[v] = codec.decode(s, v.aval.dtype)
        elif kind == "bits":
            env[v] = _unpack_bits(s, v.aval)
        else:
            env[v] = s
    leaves = _eval_jaxpr(jaxpr, env, jaxpr.outvars[plan.n_out:])
    vjp_fn = tree_unflatten(plan.vjp_tree, leaves)
    from .api import promoted_region

    cts_in = promoted_region(lambda c: _freeing_first(vjp_fn, c), list(cts), policy)
    return _input_cotangents(cts_in, dtypes.dtypes, len(encode))


_ckpt_res.defvjp(_ckpt_res_fwd, _ckpt_res_bwd)


def _flat_closure(fun: Callable, args: tuple, in_tree):
    box: list = []

    def fun_flat(*xs):
        out = fun(*tree_unflatten(in_tree, list(xs)))
        flat, tree = tree_flatten(out)
        box.append(tree)
        return [jnp.asarray(o) for o in flat]

    return fun_flat, box


def checkpoint(fun: Callable, codec, *, policy: Policy | None = None,
               tangent_dtype=None, save: str = "inputs",
               backward_slices: int | None = None,
               encode_argnums: int | Sequence[int] | None = None) -> Callable:
    """Like `jax.checkpoint`, but what it saves for the backward is encoded with `codec`.

    Args:
      fun: the function to checkpoint.
      codec: a codec or its name ("none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
        "int2"), positional or by keyword (``checkpoint(f, "int8")``, as
        `compress_checkpoints` takes it).
      policy: a `hifigrad.Policy` for the backward (float32 by default).
      tangent_dtype: shorthand for ``Policy(tangent_dtype=...)``.
      save: ``"inputs"`` saves `fun`'s float array inputs encoded and recomputes `fun` from
        them in the backward (the least memory); ``"residuals"`` saves one encoded tensor per
        chain of elementwise ops (the chain's input) and bool masks bit-packed, recomputes
        only elementwise ops in the backward, and keeps gates exact (see the module
        docstring).
      backward_slices: how many slices along the batch (leading) axis of the encoded inputs
        the recomputed backward runs in, one after the other (``save="inputs"`` only). Each
        slice recomputes and differentiates its rows alone, so the backward's working set
        (the float32 cotangents of the block's attention scores and MLP hidden, say) is
        divided by the slice count; the parameter cotangents are summed over slices in
        float32. It trades a loop of that many iterations (the same matmuls on fewer rows,
        none recomputed twice) and a different summation order of the parameter
        cotangents for memory. Slicing happens only where the block's program is proven
        separable along that axis (no batch statistics, no mixing of rows), else the
        backward runs at once; a slice keeps at least 256 rows per matmul. ``None``
        (default): 4 when the backward's cotangents are wider than the activation-sized
        values the block computes (a bf16 block's float32 backward; masks, positions or
        other inputs of any dtype do not count), else 1; ``1``: never slice.
      encode_argnums: which positional arguments hold the activations to encode (an int or
        a sequence of ints; negative ones count from the end); the float leaves of the
        others are saved as they are, like values `fun` closes over. ``None`` (default):
        every float array input is encoded, parameters passed as arguments too, and the
        backward then recomputes with their decoded (quantized) values. Give it when
        parameters are arguments: in ``lax.scan(hg.checkpoint(block, "int8",
        encode_argnums=0), x, params)`` each step's carry is encoded and its parameters
        are saved exact; the scan's per-step inputs stay alive anyway, so nothing is
        copied (the same peak memory as `scan`, measured by
        ``benchmarks/transformer_memory_bench.py --entry-points``), where encoding them
        stacks an encoded copy of every step's parameters.

    Returns:
      A function with `fun`'s signature. Its forward is `fun` unchanged.

    Raises:
      ValueError: an unknown codec name or ``save`` mode; ``tangent_dtype`` conflicts with
        ``policy.tangent_dtype``; (when called) an ``encode_argnums`` entry out of range of
        the arguments.
      TypeError: ``codec`` is neither a name nor a codec; ``encode_argnums`` is not ints;
        (when called) an input is already an encoded value, or a delayed-scaling codec is
        given (it needs `scan`'s ``codec_state``).

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> f = hg.checkpoint(lambda x: jnp.tanh(x) * 2, "int8")
      >>> jax.grad(lambda x: f(x).sum())(jnp.ones(4)).dtype
      dtype('float32')
      >>> g = hg.checkpoint(lambda x: jax.nn.relu(x), codec="fp8_e4m3", save="residuals")
      >>> jax.grad(lambda x: g(x).sum())(jnp.array([-1.0, 2.0]))
      Array([0., 1.], dtype=float32)
    """
    codec, policy, save, backward_slices = check_checkpoint_args(
        "hifigrad.checkpoint", fun, codec, policy, tangent_dtype, save, backward_slices)
    argnums = _check_argnums(encode_argnums)

    def call(args, kwargs):
        return fun(*args, **kwargs)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        for x in jax.tree_util.tree_leaves((args, kwargs),
                                           is_leaf=lambda v: isinstance(v, Encoded)):
            _check_encodable(x)
        flat, in_tree = tree_flatten((args, kwargs))
        flat = [jnp.asarray(x) for x in flat]
        chosen = _chosen_args(argnums, len(args))
        # the argument each leaf of `flat` comes from (tuples flatten argument by argument;
        # keyword arguments, after them, count as unnamed by `encode_argnums`)
        owner = [i for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
        owner += [None] * (len(flat) - len(owner))
        encode = [is_float_array(x) and (chosen is None or i in chosen)
                  for x, i in zip(flat, owner)]
        return checkpoint_call(call, flat, in_tree, encode, codec, policy, save,
                               backward_slices=backward_slices)

    return wrapped


def _check_argnums(argnums) -> tuple[int, ...] | None:
    """`checkpoint`'s ``encode_argnums`` as a tuple of ints (None: every argument)."""
    if argnums is None:
        return None
    items = (argnums,) if isinstance(argnums, (int, np.integer)) else argnums
    try:
        items = tuple(items)
    except TypeError:
        items = (argnums,)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items):
        raise TypeError("hifigrad.checkpoint: encode_argnums takes an int or a sequence of "
                        f"ints (positions of the arguments to encode), got {argnums!r}.")
    return tuple(int(i) for i in items)


def _chosen_args(argnums, n: int) -> frozenset | None:
    """The argument positions `argnums` names among `n` arguments (None: all)."""
    if argnums is None:
        return None
    bad = [i for i in argnums if not -n <= i < n]
    if bad:
        raise ValueError(f"hifigrad.checkpoint: encode_argnums={argnums} names argument(s) "
                         f"{bad}, but the function was called with {n} positional "
                         f"argument(s).")
    return frozenset(i % n for i in argnums)


def checkpoint_call(fun, flat, in_tree, encode, codec, policy, save="inputs", state=None,
                    *, backward_slices: int | None = None, derived=None):
    """Calls ``fun(*tree_unflatten(in_tree, flat))`` as a compressed checkpoint.

    Args:
      fun: the function; values it closes over are hoisted and saved as they are.
      flat: its arguments, flattened (JAX arrays).
      in_tree: their treedef.
      encode: one bool per leaf of `flat`: whether that input is saved encoded (a float
        activation) or as it is (parameters, integer inputs).
      codec: a `Codec`; policy: a resolved `Policy` (`policy.INHERIT`: the policy of the
        hifigrad transform tracing it, else the default); save: a `check_save`-d mode.
      state: a delayed-scaling codec's state, or None.
      backward_slices: as in `checkpoint` (None: automatic).
      derived: {position in `flat`: `Derived`}: inputs that are slices of a loop invariant,
        re-read from it in the backward instead of saved (``save="inputs"`` only).

    Returns:
      `fun`'s output pytree.
    """
    policy = effective_policy(policy)  # a checkpoint made without one: the transform's
    fun_flat, box = _flat_closure(fun, flat, in_tree)
    converted, consts = jax.closure_convert(fun_flat, *flat)
    plan = _slice_plan(fun_flat, converted, consts, flat, encode, policy, save,
                       check_slices(backward_slices))
    out = _encoded_call(converted, codec, policy, encode, flat, consts, save, state, plan,
                        derived)
    return tree_unflatten(box[-1], list(out))


def _is_stateful(codec) -> bool:
    """Whether `codec` scales with a state the caller threads (delayed scaling)."""
    return callable(getattr(codec, "init_state", None)) and callable(
        getattr(codec, "update_state", None))


def _check_codec_state(codec, codec_state, save: str, where: str):
    if _is_stateful(codec):
        if codec_state is None:
            raise TypeError(
                f"{where}: codec {codec.name!r} uses delayed scaling and needs its state: pass "
                f"codec_state=codec.init_state() (then codec.update_state(state, amaxes) with "
                f"the amaxes {where} returns), or use a current-scaling codec such as "
                f"'fp8_e4m3'.")
        if save != "inputs":
            raise ValueError(
                f"{where}: a delayed-scaling codec's scale is the carry's, so it only applies "
                f"to save='inputs'; got save={save!r}.")
    elif codec_state is not None:
        raise TypeError(f"{where}: codec_state is only for delayed-scaling codecs (such as "
                        f"DelayedFP8Codec); codec {codec.name!r} keeps no state.")


def scan(f: Callable, init, xs=None, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1, *, codec=None, policy: Policy | None = None,
         tangent_dtype=None, save: str = "inputs", codec_state=None,
         backward_slices: int | None = None):
    """`lax.scan` whose steps save their carry encoded with `codec` and are recomputed in the
    backward (in tangent precision).

    The per-step inputs `xs` (for example stacked layer parameters) are saved as they are; the
    carry (the activations passed between steps) is what gets compressed. With
    ``save="residuals"`` each step saves, encoded, the input of each elementwise chain its
    backward needs (the carry and each matmul's output; bool masks bit-packed), and the
    backward recomputes only elementwise ops, no matmul, with the forward's gates (see
    `checkpoint`).

    Delayed scaling (`hifigrad.codecs.DelayedFP8Codec`, as in jax issue 27144's model and Flax's
    ``fp8_ops``): pass ``codec_state``; every step's carry is then encoded with its scale, and
    ``hg.scan`` returns ``(carry, ys, amaxes)``, ``amaxes[i]`` being ``max|carry|`` of step
    ``i`` (the max over the encoded carry leaves). The caller threads the state through
    training, ``state = codec.update_state(state, amaxes)``: the max over all steps (and
    microbatches) becomes the next history entry.

    Args:
      f: the step, ``f(carry, x) -> (carry, y)``, as in `lax.scan`.
      init: the initial carry (a pytree of arrays); its float leaves are what gets encoded.
      xs: the per-step inputs, scanned over their leading axis (saved as they are), or None.
      length: the number of steps, when ``xs`` is None.
      reverse: scan from the end, as in `lax.scan`.
      unroll: as in `lax.scan`.
      codec: a codec or its name ("none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
        "int2"), or a `hifigrad.codecs.DelayedFP8Codec` with ``codec_state``; required, by
        keyword (the positions after ``xs`` are `lax.scan`'s).
      policy: a `hifigrad.Policy` for the recomputed backward (float32 by default).
      tangent_dtype: shorthand for ``Policy(tangent_dtype=...)``.
      save: ``"inputs"`` or ``"residuals"``, as in `checkpoint`.
      codec_state: the delayed-scaling state (``codec.init_state()``, then
        ``codec.update_state(...)``); only with a delayed-scaling codec and ``save="inputs"``.
      backward_slices: as in `checkpoint`: the batch slices each step's recomputed backward
        runs in (None: 4 for a float32 backward of a lower-precision carry, else 1).

    Returns:
      ``(carry, ys)`` as `lax.scan` returns, or ``(carry, ys, amaxes)`` with ``codec_state``.

    Raises:
      ValueError: an unknown codec name or ``save`` mode; ``codec_state`` with
        ``save="residuals"``.
      TypeError: ``codec`` is neither a name nor a codec, or is given positionally (in
        ``length``'s place: ``codec`` is keyword-only here, after `lax.scan`'s own arguments); a
        delayed-scaling codec without ``codec_state``, or ``codec_state`` with a codec that
        keeps no state; an encoded carry.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> def body(c, w):
      ...     return jnp.tanh(c @ w), None
      >>> ws = jnp.ones((3, 4, 4)) * 0.1
      >>> loss = lambda ws: hg.scan(body, jnp.ones((2, 4)), ws, codec="fp8_e4m3")[0].sum()
      >>> jax.grad(loss)(ws).shape
      (3, 4, 4)
    """
    if isinstance(length, (str, Codec)):
        # hg.scan(f, init, xs, "int8"): the fourth position is lax.scan's `length`
        raise TypeError(
            f"hifigrad.scan: got the codec {length!r} as `length`; hifigrad.scan takes "
            f"lax.scan's positional arguments (f, init, xs, length, reverse, unroll), so pass "
            f"the codec by keyword: hifigrad.scan(f, init, xs, codec={length!r}).")
    if codec is None:
        raise TypeError("hifigrad.scan: no codec given; pass one by keyword, e.g. "
                        "hifigrad.scan(f, init, xs, codec='int8') ('none' saves the carry "
                        "uncompressed).")
    codec, policy, save, backward_slices = check_checkpoint_args(
        "hifigrad.scan", f, codec, policy, tangent_dtype, save, backward_slices, stateful=True)
    _check_codec_state(codec, codec_state, save, "hifigrad.scan")
    for x in jax.tree_util.tree_leaves(init, is_leaf=lambda v: isinstance(v, Encoded)):
        _check_encodable(x)

    def step(carry, x):
        args = (carry, x)
        flat, in_tree = tree_flatten(args)
        flat = [jnp.asarray(a) for a in flat]
        n_carry = len(tree_flatten(carry)[0])
        encode = [i < n_carry and is_float_array(a) for i, a in enumerate(flat)]
        out = checkpoint_call(f, flat, in_tree, encode, codec, policy, save, codec_state,
                              backward_slices=backward_slices)
        if codec_state is None:
            return out
        encoded = [a for a, e in zip(flat, encode) if e]
        amax = lax.stop_gradient(jnp.max(jnp.stack(
            [jnp.max(jnp.abs(a)).astype(jnp.float32) for a in encoded]))) if encoded else \
            jnp.zeros((), jnp.float32)
        new_carry, y = out
        return new_carry, (y, amax)

    carry, ys = lax.scan(step, init, xs, length=length, reverse=reverse, unroll=unroll)
    if codec_state is None:
        return carry, ys
    ys, amaxes = ys
    return carry, ys, amaxes
