"""Optimizer state for low-precision parameters (needs optax, imported when first used).

What a training step keeps besides the activations is the parameters and the optimizer's
state. With bf16 parameters and Adam that is, per parameter:

| transformation | state beside the bf16 parameter | bytes in all |
|---|---|---|
| `master_weights(adamw)` | float32 master, float32 moments | 14 |
| `master_weights(adamw, master="split")` | the master's low 16 bits, float32 moments | 12 |
| `master_weights(adamw(moments="fp16"), master="split")` | low 16 bits, float16 moments | 8.1 |
| `master_weights(adamw(moments="8bit"), master="split")` | low 16 bits, 8-bit moments | 6.1 |
| `kahan(adamw(moments="fp16"))` | a bf16 compensation, float16 moments | 8.1 |
| `kahan(adamw(moments="bf16"))` | a bf16 compensation, bf16 moments | 8 |
| `stochastic_rounding(adamw(moments="bf16"))` | bf16 moments | 6 |
| plain `optax.adamw` on bf16 parameters | bf16 moments; updates under half an ulp lost | 6 |

Every one wraps (or is) an optax transformation, works under `jax.jit`, keeps a parameter's
sharding in its state (per-leaf state of the parameter's shape; 8-bit moments blocked along the
last axis), and takes the float32 gradients `hifigrad.grad` gives. The guide
(docs/guides/training-state.md) has the measured loss curves.

`master_weights` wraps an optax transformation so that a model whose parameters are bf16 (or
fp16) is trained as if they were float32: the optimizer keeps a float32 *master* copy of the
parameters and its own state (Adam's moments) in float32, applies the float32 gradients
hifigrad computes to that copy, and returns updates that make the low-precision parameters
the master copy rounded to their dtype. Without it, an update smaller than half a bf16 ulp of
its parameter is lost at every step, and the optimizer's moments start (and, in some
frameworks, stay) in bf16.

    >>> import jax, jax.numpy as jnp, optax, hifigrad as hg
    >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    >>> tx = hg.optim.master_weights(optax.sgd(1e-3))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones((4, 4), jnp.float32)}
    >>> updates, state = tx.update(grads, state, params)
    >>> # optax adds each bf16 parameter and its float32 update (JAX's default 'standard'
    >>> # promotion allows it; set here only because these examples are tested under 'strict')
    >>> with jax.numpy_dtype_promotion("standard"):
    ...     new = optax.apply_updates(params, updates)
    >>> new["w"].dtype, float(new["w"][0, 0])  # 1 - 1e-3 rounds to 1.0 in bf16 ...
    (dtype(bfloat16), 1.0)
    >>> float(state.master["w"][0, 0])          # ... the float32 master keeps the step
    0.9990000128746033
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["AdamState", "KahanState", "MasterWeightsState", "StochasticRoundingState", "adamw",
           "kahan", "master_weights", "round_to_bf16", "scale_by_adam", "stochastic_rounding"]

_INSTALL = "pip install optax (or hifigrad's flax extra: pip install '<clone>[flax]')"


def _optax():
    try:
        import optax
    except ImportError as e:
        raise ImportError(f"hifigrad.optim.master_weights needs optax, which is not installed "
                          f"here ({e}); install it: {_INSTALL}") from None
    return optax


def _is_low_precision(x) -> bool:
    dtype = jnp.result_type(x)
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _to_f32(x):
    return jnp.asarray(x, jnp.float32) if _is_low_precision(x) else x


# ------------------------------------------------------------------ bf16 bit arithmetic
# A float32's top 16 bits are a bf16 (same sign and exponent, 7 of its 23 mantissa bits): bf16
# rounding and splitting are integer operations on the float32's bits.

_ROUNDINGS = ("nearest_even", "nearest_away", "truncate")


def _f32_bits(x):
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def _special(hi):
    """Whether a bf16's bits (uint32, the top half of a float32's) are inf or NaN."""
    return (hi & 0x7F80) == 0x7F80


def _bf16_of(hi):
    return lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.bfloat16)


def _nan_kept(hi, low):
    """`hi` (a float32's top bits), made a quiet NaN where the float32 is a NaN whose
    mantissa lies in the low half only (its top bits alone would read as inf)."""
    hidden = _special(hi) & ((hi & 0x7F) == 0) & (low != 0)
    return jnp.where(hidden, hi | jnp.uint32(0x40), hi)


def round_to_bf16(x, rounding: str = "nearest_even", bits=None):
    """``x`` (float32) rounded to bfloat16.

    Args:
      x: a float32 array.
      rounding: ``"nearest_even"`` (what ``x.astype(jnp.bfloat16)`` does),
        ``"nearest_away"`` (to nearest, ties away from zero), ``"truncate"`` (towards zero:
        the top 16 bits), or ``"stochastic"`` (up with probability equal to the distance
        from the value below, in units of the gap: unbiased; needs `bits`).
      bits: for ``"stochastic"``, uint16 random bits of ``x``'s shape.

    Returns:
      A bfloat16 array. NaN stays NaN, inf stays inf; as with ``astype``, a finite value past
      bf16's largest may round to inf.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> x = jnp.float32(1 + 2 ** -8)                  # halfway between two bf16 values
      >>> [float(hg.optim.round_to_bf16(x, r)) for r in ("nearest_even", "nearest_away")]
      [1.0, 1.0078125]
    """
    x = jnp.asarray(x, jnp.float32)
    if rounding == "nearest_even":
        return x.astype(jnp.bfloat16)
    u = _f32_bits(x)
    hi, low = u >> 16, u & 0xFFFF
    if rounding == "truncate":
        return _bf16_of(_nan_kept(hi, low))
    if rounding == "nearest_away":
        up = ((low >= 0x8000) & ~_special(hi)).astype(jnp.uint32)
        return _bf16_of(jnp.where(_special(hi), _nan_kept(hi, low), hi + up))
    if rounding == "stochastic":
        if bits is None:
            raise ValueError("round_to_bf16(..., 'stochastic') needs `bits`: uint16 random "
                             "bits of x's shape (jax.random.bits(key, x.shape, jnp.uint16)).")
        up = (low + jnp.asarray(bits, jnp.uint32)) >> 16  # 1 where the random bits carry
        return _bf16_of(jnp.where(_special(hi), _nan_kept(hi, low), hi + up))
    raise ValueError(f"rounding must be one of {(*_ROUNDINGS, 'stochastic')}; got {rounding!r}.")


def _split(master, rounding: str):
    """(param bf16, low uint16): the float32 `master` as its rounded bf16 and its low 16 bits,
    from which `_join` gives the master back exactly. With ``nearest_away`` a parameter
    rounded up (its master's low half at least 0x8000) lies above its master by 0x10000 -
    low units of the master's last place; a tie rounded to even would need a 17th bit."""
    u = _f32_bits(master)
    low = u & 0xFFFF
    return round_to_bf16(master, rounding), low.astype(jnp.uint16)


def _join(param, low, rounding: str):
    """The float32 master from its bf16 `param` and `low` half (the inverse of `_split`)."""
    hi = lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32)
    low = low.astype(jnp.uint32)
    plain = (hi << 16) | low
    if rounding == "truncate":
        return lax.bitcast_convert_type(plain, jnp.float32)
    # Rounded up: a finite parameter with a low half of 0x8000 or more, or an inf one made by
    # rounding up the largest finite (a true inf's low half is 0; a NaN stays a NaN).
    inf = _special(hi) & ((hi & 0x7F) == 0)
    rounded_up = (low >= 0x8000) & (~_special(hi) | inf)
    u = jnp.where(rounded_up, (hi << 16) - (jnp.uint32(0x10000) - low), plain)
    return lax.bitcast_convert_type(u, jnp.float32)


class MasterWeightsState(NamedTuple):
    """The state of a `master_weights` transformation.

    Attributes:
      master: the float32 master copy of the parameters (float32 leaves of the parameters'
        pytree; leaves that are not low-precision floats are kept as they are), or, with
        ``master="split"``, the low halves of the bf16 parameters' float32 masters (uint16
        leaves; other leaves: empty). Evaluate or checkpoint the model from the float32
        master (`master_weights` ``.master_params(params, state)``) when the rounded
        parameters are not enough.
      inner: the wrapped transformation's state, created from (and updated against) the
        float32 master, so its float moments are float32 (unless the wrapped transformation
        keeps them otherwise, as `adamw`'s ``moments=`` does).

    Examples:
      >>> import jax.numpy as jnp, optax, hifigrad as hg
      >>> state = hg.optim.master_weights(optax.adam(1e-3)).init(
      ...     {"w": jnp.zeros(3, jnp.bfloat16)})
      >>> state.master["w"].dtype, state.inner[0].mu["w"].dtype
      (dtype('float32'), dtype('float32'))
    """

    master: Any
    inner: Any


_MASTERS = ("float32", "split")


def master_weights(tx, *, master: str = "float32", param_rounding: str | None = None):
    """Wraps an optax transformation to train low-precision parameters through a float32
    master copy.

    ``init(params)`` keeps a float32 copy of ``params`` (bf16 / fp16 leaves upcast, others as
    they are) and initializes ``tx`` on it. ``update(grads, state, params)`` casts low-precision
    gradients to float32 (hifigrad's already are), runs ``tx.update`` on the master copy, applies
    the result to it in float32, and returns updates that turn ``params`` into the new master
    copy rounded to each parameter's dtype: ``optax.apply_updates(params, updates)`` (or
    ``nnx.Optimizer.update``) then gives exactly the rounded master. The updates of bf16 / fp16
    parameters are float32 (``optax.apply_updates`` adds in float32 and casts back, under JAX's
    default ``standard`` dtype promotion, which optax needs anyway); those of float32 parameters
    are ``tx``'s own, so a float32 model trains as with ``tx`` alone.

    ``master="split"`` keeps, for a bf16 parameter, only the float32 master's other half: 16
    bits beside the parameter, exactly the float32 master (2 bytes per parameter instead of
    4). The parameter the forward sees is then the master rounded to nearest with ties away
    from zero (``param_rounding="nearest_away"``, the default there: with ties to even a
    tie's remainder would need a 17th bit) or truncated (``"truncate"``: the master's top 16
    bits); no bit of the master is lost. Eagerly a training run is bitwise the run with
    ``master="float32"`` and the same ``param_rounding``; under `jax.jit` the two update steps
    are different XLA programs, which may fuse a multiply-add in one and not in the other, so
    a master can differ from the float32 run's by a float32 ulp (as jitting the float32 run
    itself changes it), and the runs then drift apart as any two float32 runs do. Leaves
    that are not bf16 (float32, fp16, integers) are kept as with
    ``master="float32"``.

    Args:
      tx: an ``optax.GradientTransformation`` (e.g. ``optax.adamw(1e-3)``, a chain with
        clipping, a schedule, `hifigrad.optim.adamw`).
      master: ``"float32"`` (default) or ``"split"``.
      param_rounding: how a low-precision parameter is made from its master:
        ``"nearest_even"`` (``astype``; the default with ``master="float32"``),
        ``"nearest_away"`` (the default with ``master="split"``) or ``"truncate"``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a `MasterWeightsState`, with a
      ``master_params(params, state)`` method giving the float32 master.

    Raises:
      ImportError: optax is not installed (the message says how to install it).
      TypeError: ``tx`` is not an optax transformation (no ``init`` / ``update``).
      ValueError: an unknown ``master`` or ``param_rounding``; ``master="split"`` with
        ``param_rounding="nearest_even"``; (from ``update``) called without ``params``, which
        the updates are computed against.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, hifigrad as hg
      >>> params = {"w": jnp.full((8, 4), 0.1, jnp.bfloat16)}
      >>> x = jnp.ones((2, 8), jnp.bfloat16)
      >>> loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]).astype(jnp.float32) ** 2)
      >>> tx = hg.optim.master_weights(optax.adamw(1e-2))
      >>> state = tx.init(params)
      >>> @jax.jit
      ... def step(params, state, x):
      ...     grads = hg.grad(loss)(params, x)                  # float32 gradients
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> # (bf16 parameter + float32 update in optax.apply_updates: JAX's default 'standard'
      >>> # promotion allows it; set here only because these examples are tested under 'strict')
      >>> with jax.numpy_dtype_promotion("standard"):
      ...     params, state = step(params, state, x)
      >>> params["w"].dtype, state.master["w"].dtype
      (dtype(bfloat16), dtype('float32'))
      >>> bool((params["w"] == state.master["w"].astype(jnp.bfloat16)).all())
      True
      >>> split = hg.optim.master_weights(optax.adamw(1e-2), master="split")
      >>> split.init(params).master["w"].dtype              # 2 bytes beside the parameter
      dtype('uint16')
    """
    optax = _optax()
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"hifigrad.optim.master_weights: expected an optax "
                        f"GradientTransformation (with init and update), got "
                        f"{type(tx).__name__}: wrap the optimizer itself, e.g. "
                        f"master_weights(optax.adamw(1e-3)).")
    if master not in _MASTERS:
        raise ValueError(f"hifigrad.optim.master_weights: master must be one of {_MASTERS}; "
                         f"got {master!r}.")
    if param_rounding is None:
        param_rounding = "nearest_away" if master == "split" else "nearest_even"
    if param_rounding not in _ROUNDINGS:
        raise ValueError(f"hifigrad.optim.master_weights: param_rounding must be one of "
                         f"{_ROUNDINGS}; got {param_rounding!r}.")
    if master == "split" and param_rounding == "nearest_even":
        raise ValueError("hifigrad.optim.master_weights: master='split' keeps the master's "
                         "other 16 bits, which a tie rounded to even would overflow: use "
                         "param_rounding='nearest_away' (the default) or 'truncate'.")
    split = master == "split"

    def is_split(p) -> bool:
        return split and jnp.result_type(p) == jnp.bfloat16

    def to_master(p, stored):
        if is_split(p):
            return _join(p, stored, param_rounding)
        return stored

    def master_params(params, state):
        """The float32 master of `params` (as they are after the last update)."""
        return jax.tree.map(to_master, params, state.master)

    def round_param(new, p):
        if jnp.result_type(p) == jnp.bfloat16:
            return round_to_bf16(new, param_rounding)
        return new.astype(p.dtype)

    def init(params):
        full = jax.tree.map(_to_f32, params)
        if split:
            stored = jax.tree.map(
                lambda p, m: _split(m, param_rounding)[1] if is_split(p) else m, params, full)
        else:
            stored = full
        return MasterWeightsState(master=stored, inner=tx.init(full))

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.master_weights: update needs the current "
                             "parameters, tx.update(grads, state, params): the updates it "
                             "returns turn them into the rounded float32 master copy.")
        grads = jax.tree.map(_to_f32, grads)
        full = master_params(params, state)
        inner_updates, inner = tx.update(grads, state.inner, full, **extra_args)
        new_master = optax.apply_updates(full, inner_updates)

        def to_param(p, new, u):
            if not _is_low_precision(p):
                return u  # a float32 (or integer) parameter: tx's own update
            # Both terms are values of p's dtype, so their float32 difference is exact (unless
            # their exponents are over 15 apart), and p + it, added in float32, is the
            # rounded master value exactly.
            return round_param(new, p).astype(jnp.float32) - jnp.asarray(p, jnp.float32)

        updates = jax.tree.map(to_param, params, new_master, inner_updates)
        if split:
            stored = jax.tree.map(
                lambda p, m: _split(m, param_rounding)[1] if is_split(p) else m,
                params, new_master)
        else:
            stored = new_master
        return updates, MasterWeightsState(master=stored, inner=inner)

    out = optax.GradientTransformationExtraArgs(init, update)
    return _with_master_params(out, master_params)


def _with_master_params(tx, master_params):
    """`tx` (an optax transformation) with a ``master_params`` method, still an optax
    transformation (optax's chains take any object with ``init`` and ``update``)."""
    optax = _optax()

    class MasterWeightsTransformation(optax.GradientTransformationExtraArgs):
        def master_params(self, params, state):
            """The float32 master of `params` (as they are after the last update)."""
            return master_params(params, state)

    return MasterWeightsTransformation(tx.init, tx.update)


# ------------------------------------------------------------------ compensated updates

class KahanState(NamedTuple):
    """The state of a `kahan` transformation.

    Attributes:
      compensation: per low-precision parameter, in its own dtype, what its last rounding
        dropped (other leaves: empty).
      inner: the wrapped transformation's state.

    Examples:
      >>> import jax.numpy as jnp, optax, hifigrad as hg
      >>> state = hg.optim.kahan(optax.sgd(1e-3)).init({"w": jnp.ones(3, jnp.bfloat16)})
      >>> state.compensation["w"].dtype
      dtype(bfloat16)
    """

    compensation: Any
    inner: Any


def _low_precision_zeros(p):
    return jnp.zeros_like(p) if _is_low_precision(p) else jnp.zeros((), jnp.float32)


def kahan(tx):
    """Wraps an optax transformation with Kahan-compensated updates of low-precision
    parameters: what rounding the updated parameter to its dtype drops is kept, in the
    parameter's own dtype (a bf16 compensation: 2 bytes per parameter), and added to the next
    update, so that updates far below half an ulp of the parameter accumulate instead of
    being lost (as optimi's Kahan summation does for PyTorch).

    ``update(grads, state, params)`` runs ``tx.update`` on the float32 values the parameters
    stand for (each low-precision parameter plus its compensation), then for each bf16 /
    fp16 parameter computes ``exact = p + update + compensation`` in float32,
    the new parameter ``round(exact)``, the new compensation ``exact - new`` (rounded to the
    parameter's dtype), and returns updates that make ``optax.apply_updates`` give exactly the
    new parameter. Other leaves take ``tx``'s own updates.

    Args:
      tx: an ``optax.GradientTransformation`` (its state is kept as it keeps it: use
        `hifigrad.optim.adamw` with ``moments="fp16"`` or ``"bf16"`` for 2-byte moments).

    Returns:
      An ``optax.GradientTransformation`` whose state is a `KahanState`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, hifigrad as hg
      >>> p = {"w": jnp.ones(4, jnp.bfloat16)}
      >>> tx = hg.optim.kahan(optax.sgd(1e-3))           # steps of 1e-3: under half an ulp
      >>> state = tx.init(p)
      >>> with jax.numpy_dtype_promotion("standard"):     # (optax: bf16 + float32 update)
      ...     for _ in range(10):
      ...         u, state = tx.update({"w": jnp.ones(4, jnp.float32)}, state, p)
      ...         p = optax.apply_updates(p, u)
      >>> float(p["w"][0])                  # the parameter moved: 0.99 rounded to bf16
      0.98828125
      >>> float(p["w"][0]) + float(state.compensation["w"][0])   # with the compensation: 0.99
      0.9900054931640625
    """
    optax = _optax()
    _check_tx("kahan", tx)

    def init(params):
        return KahanState(compensation=jax.tree.map(_low_precision_zeros, params),
                          inner=tx.init(params))

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.kahan: update needs the current parameters, "
                             "tx.update(grads, state, params): it compensates their rounding.")
        # the inner transformation sees each parameter as the float32 value it stands for
        # (with its compensation): weight decay of the exact value, no bf16 arithmetic
        exact_params = jax.tree.map(
            lambda p, c: jnp.asarray(p, jnp.float32) + jnp.asarray(c, jnp.float32)
            if _is_low_precision(p) else p, params, state.compensation)
        inner_updates, inner = tx.update(grads, state.inner, exact_params, **extra_args)

        def one(p, u, c):
            if not _is_low_precision(p):
                return u, c
            p32 = jnp.asarray(p, jnp.float32)
            exact = p32 + jnp.asarray(u, jnp.float32) + jnp.asarray(c, jnp.float32)
            new = exact.astype(p.dtype)
            return new.astype(jnp.float32) - p32, (exact - new.astype(jnp.float32)).astype(
                p.dtype)

        pairs = jax.tree.map(one, params, inner_updates, state.compensation)
        updates = jax.tree.map(lambda _, t: t[0], params, pairs)
        comp = jax.tree.map(lambda _, t: t[1], params, pairs)
        return updates, KahanState(compensation=comp, inner=inner)

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------ stochastic rounding

class StochasticRoundingState(NamedTuple):
    """The state of a `stochastic_rounding` transformation.

    Attributes:
      count: the steps taken (with the seed, what each step's random bits are drawn from).
      inner: the wrapped transformation's state.

    Examples:
      >>> import jax.numpy as jnp, optax, hifigrad as hg
      >>> state = hg.optim.stochastic_rounding(optax.sgd(1e-3)).init(
      ...     {"w": jnp.ones(3, jnp.bfloat16)})
      >>> int(state.count)
      0
    """

    count: Any
    inner: Any


def _hash32(x):
    """An integer hash of uint32 values (Wellons' "lowbias32"): exact integer arithmetic, so
    the same bits on every backend."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _leaf_bits(seed, count, index: int, shape):
    """uint16 random bits for leaf ``index`` at step ``count``: a counter-based hash of each
    element's position in the leaf, keyed by ``seed``, the step and the leaf (two rounds of
    `_hash32`). Exact integer arithmetic: the same bits on every backend and under any
    sharding (the position is the element's in the whole array). Elementwise, it fuses with
    the rounding that uses it; threefry's counters were materialized for every leaf at once
    (4 bytes per parameter per draw) and cost most of the update's time."""
    step = jnp.asarray(count).astype(jnp.uint32)
    key = _hash32(_hash32(jnp.uint32(seed & 0xFFFFFFFF) ^ jnp.uint32(0x9E3779B9))
                  + step * jnp.uint32(0x85EBCA6B) + jnp.uint32((index * 0xC2B2AE35) & 0xFFFFFFFF))
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = pos + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[d]
    bits = _hash32(_hash32(pos ^ key) + key)
    return (bits >> 16).astype(jnp.uint16)


def stochastic_rounding(tx, seed: int = 0):
    """Wraps an optax transformation so that each bf16 parameter's update is rounded into bf16
    stochastically: up with probability equal to how far the exact value lies towards the
    next bf16, so that an update far below half an ulp moves the parameter in expectation
    (torchao's and llm.c's bf16 training). No state beside the parameter but a step count;
    the random bits are a counter-based hash of ``seed``, the step, the leaf and the element's
    position: the same on every backend and sharding, and a run is reproducible.

    Args:
      tx: an ``optax.GradientTransformation``.
      seed: the seed of the rounding's random bits.

    Returns:
      An ``optax.GradientTransformation`` whose state is a `StochasticRoundingState`. Leaves
      other than bf16 take ``tx``'s own updates (fp16 and float32 are rounded as
      ``optax.apply_updates`` rounds them).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, hifigrad as hg
      >>> p = {"w": jnp.ones(1000, jnp.bfloat16)}
      >>> tx = hg.optim.stochastic_rounding(optax.sgd(1e-3), seed=0)
      >>> state = tx.init(p)
      >>> with jax.numpy_dtype_promotion("standard"):
      ...     for _ in range(10):
      ...         u, state = tx.update({"w": jnp.ones(1000, jnp.float32)}, state, p)
      ...         p = optax.apply_updates(p, u)
      >>> round(float(p["w"].astype(jnp.float32).mean()), 2)   # 1 - 10 * 1e-3, on average
      0.99
    """
    optax = _optax()
    _check_tx("stochastic_rounding", tx)

    def init(params):
        return StochasticRoundingState(count=jnp.zeros((), jnp.uint32), inner=tx.init(params))

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.stochastic_rounding: update needs the current "
                             "parameters, tx.update(grads, state, params).")
        inner_updates, inner = tx.update(grads, state.inner, jax.tree.map(_to_f32, params),
                                         **extra_args)
        leaves, tree = jax.tree.flatten(params)
        ups = tree.flatten_up_to(inner_updates)
        out = []
        for i, (p, u) in enumerate(zip(leaves, ups)):
            if jnp.result_type(p) != jnp.bfloat16:
                out.append(u)
                continue
            p32 = jnp.asarray(p, jnp.float32)
            new = round_to_bf16(p32 + jnp.asarray(u, jnp.float32), "stochastic",
                                _leaf_bits(seed, state.count, i, np.shape(p)))
            out.append(new.astype(jnp.float32) - p32)
        return (jax.tree.unflatten(tree, out),
                StochasticRoundingState(count=state.count + 1, inner=inner))

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------ compact Adam moments

_MOMENTS = ("float32", "fp16", "bf16", "8bit")
# 8-bit moments: each block of this many consecutive elements of a leaf's last axis shares
# one float32 scale (a last axis that does not divide evenly is one block).
_BLOCK = 128


class AdamState(NamedTuple):
    """The state of `scale_by_adam`.

    Attributes:
      count: the steps taken.
      mu, nu: the first moment and (float32, bf16) the second or (float16, 8-bit codes) its
        square root, as stored: see `scale_by_adam`.
      mu_scale, nu_scale: the float16 or 8-bit codes' float32 scales, one per block of 128
        elements along the last axis (empty otherwise).

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> state = hg.optim.scale_by_adam(moments="fp16").init({"w": jnp.zeros((2, 256))})
      >>> state.mu["w"].dtype, state.nu_scale["w"].shape
      (dtype('float16'), (2, 2))
    """

    count: Any
    mu: Any
    nu: Any
    mu_scale: Any
    nu_scale: Any


def _blocks(shape) -> tuple[int, int]:
    """(number of blocks along the last axis, block length) of an 8-bit moment."""
    last = shape[-1] if shape else 1
    block = _BLOCK if last % _BLOCK == 0 else last
    return last // block, block


def _blocked(x):
    shape = np.shape(x)
    nb, b = _blocks(shape)
    return jnp.reshape(x, (*shape[:-1], nb, b)) if shape else jnp.reshape(x, (1, 1))


def _unblocked(x, shape):
    return jnp.reshape(x, shape)


def _encode8(x, bits):
    """8-bit codes of ``x`` (float32), one float32 scale (the largest magnitude) per block
    along the last axis. A code is a small float relative to its block's scale: a sign bit,
    4 exponent bits (2**-14 to 1) and 3 mantissa bits, rounded stochastically (unbiased):
    each element keeps about 3 bits of its own relative precision over 14 binary orders of
    magnitude below its block's largest, where a linear 8-bit code would round the small
    elements of a block to 0 or 1 step. Below 2**-14 of the block's largest, an element
    rounds stochastically to 0 or 2**-14."""
    shape = np.shape(x)
    xb = _blocked(x)
    top = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scale = jnp.where(top > 0, top, 1.0)
    y = jnp.abs(xb) / scale                                  # in [0, 1]
    r = _blocked(jnp.asarray(bits, jnp.uint32))
    # normal range: add 16 random bits under the 3 kept mantissa bits, then truncate
    u = lax.bitcast_convert_type(y, jnp.uint32)
    u = (u + (r << 4)) & jnp.uint32(0xFFF00000)
    e = (u >> 23).astype(jnp.int32) - 112                    # 1..15 for 2**-14 .. 1
    m = ((u >> 20) & 7).astype(jnp.int32)
    # below 2**-14: 0 or 2**-14, up with probability y / 2**-14
    tiny = y < 2.0 ** -14
    up = (r.astype(jnp.float32) * (2.0 ** -16)) < y * (2.0 ** 14)
    e = jnp.where(tiny, jnp.where(up, 1, 0), jnp.clip(e, 0, 15))
    m = jnp.where(tiny, 0, m)
    code = (e << 3) | m | jnp.where(xb < 0, 128, 0)
    return _unblocked(code.astype(jnp.uint8), shape), scale[..., 0]


def _decode8(codes, scale):
    shape = np.shape(codes)
    c = _blocked(codes).astype(jnp.int32)
    e, m = (c >> 3) & 15, c & 7
    mag = jnp.exp2((e - 15).astype(jnp.float32)) * (1 + m.astype(jnp.float32) / 8)
    mag = jnp.where(e == 0, 0.0, mag)
    val = jnp.where(c >= 128, -mag, mag) * scale[..., None]
    return _unblocked(val, shape)


def _encode16(x, bits):
    """float16 codes of ``x`` (float32) relative to one float32 scale (the largest magnitude)
    per block along the last axis, rounded stochastically (unbiased). Relative to its block's
    largest, an element keeps float16's 11 significant bits down to 2**-14 and an absolute
    step of 2**-24 below that, where a bf16 keeps 8 bits."""
    shape = np.shape(x)
    xb = _blocked(x)
    top = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    scale = jnp.where(top > 0, top, 1.0)
    y = jnp.abs(xb) / scale                                  # in [0, 1]
    r = _blocked(jnp.asarray(bits, jnp.uint32))
    # float16's normal range: add 13 random bits under its 10 mantissa bits, then truncate
    u = lax.bitcast_convert_type(y, jnp.uint32)
    normal = lax.bitcast_convert_type((u + (r >> 3)) & jnp.uint32(0xFFFFE000), jnp.float32)
    # its subnormal range: a multiple of 2**-24, up with probability of the remainder
    sub = jnp.floor(y * 2.0 ** 24 + r.astype(jnp.float32) * 2.0 ** -16) * 2.0 ** -24
    q = jnp.where(y < 2.0 ** -14, sub, normal)
    q = jnp.where(xb < 0, -q, q).astype(jnp.float16)        # exact: q is a float16 value
    return _unblocked(q, shape), scale[..., 0]


def _decode16(codes, scale):
    return _unblocked(_blocked(codes).astype(jnp.float32) * scale[..., None], np.shape(codes))


_BLOCKED = {"fp16": (_encode16, _decode16), "8bit": (_encode8, _decode8)}


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  moments: str = "float32", seed: int = 0):
    """Adam's scaling (as ``optax.scale_by_adam``) with its moments stored compactly.

    ``moments="float32"``: as optax (8 bytes per parameter). ``"fp16"``: the first moment and
    the square root of the second as float16, relative to one float32 scale per block of
    128 elements along the last axis, rounded stochastically (about 4.06 bytes): 11
    significant bits over 14 binary orders of magnitude below the block's largest, so that its
    updates stay within about 0.1% of float32 moments' (norm-wise; tests/test_optim.py).
    ``"bf16"``: both moments in bf16, rounded stochastically (4 bytes; 8 significant bits:
    about 0.6%). ``"8bit"``: the same two as 8-bit codes, each a small float (sign, 4 exponent
    bits, 3 mantissa bits) relative to the block's scale, rounded stochastically (about 2.06
    bytes; bitsandbytes' 8-bit Adam also keeps a nonlinear code per block). 8 bits is lossy:
    the rounding noise adds up over the moments' memory, 10 to 15% of the update's norm on
    that test; the guide's loss curves show what it costs a model. Each step decodes the
    moments to float32, updates them in float32 and stores them again; the second moment used
    is at least the step's own ``(1 - b2) * g**2`` (as it is exactly), so that an element whose
    code rounded to zero in its block still takes a bounded step.

    Args:
      b1: the first moment's decay rate.
      b2: the second moment's decay rate.
      eps: added to the second moment's square root in the denominator.
      moments: ``"float32"``, ``"fp16"``, ``"bf16"`` or ``"8bit"``.
      seed: the seed of the stochastic rounding's random bits (a counter-based hash: the same
        on every backend).

    Returns:
      An ``optax.GradientTransformation`` whose state is an `AdamState`.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> tx = hg.optim.scale_by_adam(moments="8bit")
      >>> state = tx.init({"w": jnp.zeros((4, 256), jnp.bfloat16)})
      >>> state.mu["w"].dtype, state.nu["w"].dtype, state.mu_scale["w"].shape
      (dtype('uint8'), dtype('uint8'), (4, 2))
    """
    optax = _optax()
    if moments not in _MOMENTS:
        raise ValueError(f"hifigrad.optim.scale_by_adam: moments must be one of {_MOMENTS}; "
                         f"got {moments!r}.")

    def zeros(p):
        shape = np.shape(p)
        if moments == "float32":
            return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), (), ()
        if moments == "bf16":
            return jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16), (), ()
        nb, _ = _blocks(shape)
        sc = jnp.ones((*shape[:-1], nb) if shape else (1,), jnp.float32)
        code = jnp.float16 if moments == "fp16" else jnp.uint8
        return jnp.zeros(shape, code), jnp.zeros(shape, code), sc, sc

    def init(params):
        leaves, tree = jax.tree.flatten(params)
        z = [zeros(p) for p in leaves]
        return AdamState(count=jnp.zeros((), jnp.int32),
                         mu=jax.tree.unflatten(tree, [a for a, *_ in z]),
                         nu=jax.tree.unflatten(tree, [b for _, b, *_ in z]),
                         mu_scale=jax.tree.unflatten(tree, [c for *_, c, _ in z]),
                         nu_scale=jax.tree.unflatten(tree, [d for *_, d in z]))

    def update(updates, state, params=None):
        del params
        leaves, tree = jax.tree.flatten(updates)
        count = state.count + 1
        c1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count.astype(jnp.float32)
        c2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
        mus, nus = tree.flatten_up_to(state.mu), tree.flatten_up_to(state.nu)
        mss, nss = tree.flatten_up_to(state.mu_scale), tree.flatten_up_to(state.nu_scale)
        out, new_mu, new_nu, new_ms, new_ns = [], [], [], [], []
        for i, (g, m, v, ms, ns) in enumerate(zip(leaves, mus, nus, mss, nss)):
            g = jnp.asarray(g, jnp.float32)
            if moments in _BLOCKED:
                decode = _BLOCKED[moments][1]
                m = decode(m, ms)
                v = jnp.square(decode(v, ns))
            m = b1 * jnp.asarray(m, jnp.float32) + (1 - b1) * g
            v = b2 * jnp.asarray(v, jnp.float32) + (1 - b2) * jnp.square(g)
            shape = np.shape(g)
            if moments == "float32":
                sm, sv, ms2, ns2 = m, v, ms, ns
            elif moments == "bf16":
                sm = round_to_bf16(m, "stochastic", _leaf_bits(seed, 2 * count, i, shape))
                sv = round_to_bf16(v, "stochastic", _leaf_bits(seed, 2 * count + 1, i, shape))
                ms2, ns2 = ms, ns
                m, v = sm.astype(jnp.float32), sv.astype(jnp.float32)
            else:
                encode, decode = _BLOCKED[moments]
                sm, ms2 = encode(m, _leaf_bits(seed, 2 * count, i, shape))
                sv, ns2 = encode(jnp.sqrt(v), _leaf_bits(seed, 2 * count + 1, i, shape))
                m = decode(sm, ms2)
                # exact v_t >= (1 - b2) g_t**2: an element whose code rounded to 0 in its
                # block still divides by its own gradient's size
                v = jnp.maximum(jnp.square(decode(sv, ns2)), (1 - b2) * jnp.square(g))
            out.append((m / c1) / (jnp.sqrt(v / c2) + eps))
            new_mu.append(sm)
            new_nu.append(sv)
            new_ms.append(ms2)
            new_ns.append(ns2)
        unf = functools.partial(jax.tree.unflatten, tree)
        return unf(out), AdamState(count=count, mu=unf(new_mu), nu=unf(new_nu),
                                   mu_scale=unf(new_ms), nu_scale=unf(new_ns))

    return optax.GradientTransformation(init, update)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask=None, *, moments: str = "float32", seed: int = 0):
    """AdamW (``optax.adamw``) with its moments stored as `scale_by_adam` says: ``"float32"``,
    ``"fp16"`` (block-scaled float16), ``"bf16"`` or ``"8bit"`` (block-scaled 8-bit codes), all
    rounded stochastically. Combine it with `master_weights`, `kahan` or
    `stochastic_rounding` for the parameters themselves.

    Args:
      learning_rate: a float or an optax schedule.
      b1: the first moment's decay rate.
      b2: the second moment's decay rate.
      eps: added to the second moment's square root in the denominator.
      weight_decay: decoupled weight decay (optax's ``add_decayed_weights``).
      mask: which leaves weight decay applies to (as optax's ``mask``).
      moments: ``"float32"``, ``"fp16"``, ``"bf16"`` or ``"8bit"``.
      seed: the seed of the moments' stochastic rounding.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> tx = hg.optim.master_weights(hg.optim.adamw(1e-3, moments="8bit"), master="split")
      >>> state = tx.init({"w": jnp.zeros((8, 128), jnp.bfloat16)})
      >>> state.master["w"].dtype, state.inner[0].mu["w"].dtype   # 2 + 1 + 1 bytes
      (dtype('uint16'), dtype('uint8'))
    """
    optax = _optax()
    return optax.chain(scale_by_adam(b1, b2, eps, moments=moments, seed=seed),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def _check_tx(where: str, tx) -> None:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"hifigrad.optim.{where}: expected an optax GradientTransformation "
                        f"(with init and update), got {type(tx).__name__}: wrap the optimizer "
                        f"itself, e.g. {where}(optax.adamw(1e-3)).")
