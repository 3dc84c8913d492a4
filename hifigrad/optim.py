"""Optimizer state for low-precision parameters (needs optax, imported when first used).

What a training step keeps besides the activations is the parameters and the optimizer's
state. With bf16 parameters and Adam that is, per parameter:

| transformation | state beside the bf16 parameter | bytes in all |
|---|---|---|
| `master_weights(adamw)` | float32 master, float32 moments | 14 |
| `master_weights(adamw, master="split")` | the master's low 16 bits, float32 moments | 12 |
| `master_weights(adamw(moments="fp16"), master="split")` | low 16 bits, float16 moments | 8 |
| `master_weights(adamw(moments="8bit"), master="split")` | low 16 bits, 8-bit moments | 6 |
| `master_weights(adamw(moments="8bit"), master="split8")` | 8 more bits, 8-bit moments | 5 |
| `master_weights(adamw(moments="4bit"), master="split8")` | 8 more bits, 4-bit moments | 4 |
| `kahan(adamw(moments="bf16"))` | a bf16 compensation, bf16 moments | 8 |
| `stochastic_rounding(adamw(moments="8bit"))` | 8-bit moments | 4 |
| `stochastic_rounding(adamw(moments="4bit"))` | 4-bit moments | 3 |
| plain `optax.adamw` on bf16 parameters | bf16 moments; updates under half an ulp lost | 6 |

(``adamw`` is `hifigrad.optim.adamw`; the block-coded moments' scales live in their codes'
spare sign bits, so these bytes are exact.)

Every one wraps (or is) an optax transformation, works under `jax.jit`, keeps a parameter's
sharding in its state (per-leaf state of the parameter's shape; compact moments blocked
within the trailing axes), can be donated to a jitted step with the parameters, and takes
the float32 gradients `hifigrad.grad` gives. The guide
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

from ._src import optim_codes as _codes

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
    u = _codes.f32_bits(x)
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
    u = _codes.f32_bits(master)
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
        leaves; other leaves: as with ``"float32"``), or, with ``master="split8"``, the next
        8 bits of their 24-bit masters (uint8 leaves). Evaluate or checkpoint the model from
        the master (`master_weights` ``.master_params(params, state)``) when the rounded
        parameters are not enough.
      inner: the wrapped transformation's state, created from (and updated against) the
        float32 master, so its float moments are float32 (unless the wrapped transformation
        keeps them otherwise, as `adamw`'s ``moments=`` does).
      count: with ``master="split8"``, the steps taken (what the stochastic rounding's bits
        are drawn from, with the seed); empty otherwise.

    Examples:
      >>> import jax.numpy as jnp, optax, hifigrad as hg
      >>> state = hg.optim.master_weights(optax.adam(1e-3)).init(
      ...     {"w": jnp.zeros(3, jnp.bfloat16)})
      >>> state.master["w"].dtype, state.inner[0].mu["w"].dtype
      (dtype('float32'), dtype('float32'))
    """

    master: Any
    inner: Any
    count: Any = ()


_MASTERS = ("float32", "split", "split8")


def _own_buffers(state, params):
    """`state` with each array leaf its own buffer: a leaf that is (the same object as) a leaf
    of `params` or an earlier leaf of `state` is copied. A jitted step can then donate both
    the parameters and the state (JAX refuses to donate one buffer twice, and a state that
    held a parameter itself would have its donation delete the caller's parameter)."""
    seen = {id(x) for x in jax.tree.leaves(params)}

    def own(x):
        if isinstance(x, jax.Array) and id(x) in seen:
            return jnp.copy(x)
        seen.add(id(x))
        return x

    return jax.tree.map(own, state)


def _round_to_24_bits(master, bits):
    """``master`` (float32) rounded stochastically to its top 24 bits (16 significant bits):
    ``bits`` (uint32, 8 of them used) added under them, the rest dropped; inf and NaN kept."""
    u = _codes.f32_bits(master)
    rounded = (u + (bits & 0xFF)) & jnp.uint32(0xFFFFFF00)
    return lax.bitcast_convert_type(jnp.where(_special(u >> 16), u, rounded), jnp.float32)


def master_weights(tx, *, master: str = "float32", param_rounding: str | None = None,
                   seed: int = 0):
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
    ``master="float32"``. Over `hifigrad.optim.adamw` with block-coded moments, on a TPU (one
    device), each bf16 leaf that its Pallas kernel takes is updated in that kernel, the moments
    and the split master in one pass (no float32 direction between them; ``"split8"`` too),
    bit for bit the unfused update (a TPU flushes a subnormal parameter to zero there).

    ``master="split8"`` keeps only the next 8 bits (1 byte beside the bf16 parameter): a
    24-bit master of 16 significant bits, which each update rounds stochastically (unbiased;
    the bits are a counter-based hash of ``seed``, the step, the leaf and the element, as
    `stochastic_rounding`'s). Its spacing is 2**-8 of the parameter's, so an update far below
    half a bf16 ulp still moves the master by many of its steps, where `stochastic_rounding`
    alone moves the parameter by a whole ulp or nothing.

    Args:
      tx: an ``optax.GradientTransformation`` (e.g. ``optax.adamw(1e-3)``, a chain with
        clipping, a schedule, `hifigrad.optim.adamw`).
      master: ``"float32"`` (default), ``"split"`` or ``"split8"``.
      param_rounding: how a low-precision parameter is made from its master:
        ``"nearest_even"`` (``astype``; the default with ``master="float32"``),
        ``"nearest_away"`` (the default with the split masters) or ``"truncate"``.
      seed: with ``master="split8"``, the seed of the stochastic rounding's bits.

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
        param_rounding = "nearest_even" if master == "float32" else "nearest_away"
    if param_rounding not in _ROUNDINGS:
        raise ValueError(f"hifigrad.optim.master_weights: param_rounding must be one of "
                         f"{_ROUNDINGS}; got {param_rounding!r}.")
    if master != "float32" and param_rounding == "nearest_even":
        raise ValueError(f"hifigrad.optim.master_weights: master={master!r} keeps the master's "
                         f"other bits, which a tie rounded to even would overflow: use "
                         f"param_rounding='nearest_away' (the default) or 'truncate'.")
    split = master != "float32"
    split8 = master == "split8"

    def is_split(p) -> bool:
        return split and jnp.result_type(p) == jnp.bfloat16

    def to_master(p, stored):
        if not is_split(p):
            return stored
        low = stored.astype(jnp.uint32) << 8 if split8 else stored
        return _join(p, low, param_rounding)

    def store(p, m):
        """What the state keeps of master value `m` of parameter `p`."""
        if not is_split(p):
            return m
        low = _split(m, param_rounding)[1]
        return (low >> 8).astype(jnp.uint8) if split8 else low

    def master_params(params, state):
        """The float32 master of `params` (as they are after the last update)."""
        return jax.tree.map(to_master, params, state.master)

    def round_param(new, p):
        if jnp.result_type(p) == jnp.bfloat16:
            return round_to_bf16(new, param_rounding)
        return new.astype(p.dtype)

    def init(params):
        full = jax.tree.map(_to_f32, params)
        state = MasterWeightsState(master=jax.tree.map(store, params, full),
                                   inner=tx.init(full),
                                   count=jnp.zeros((), jnp.uint32) if split8 else ())
        return _own_buffers(state, params)

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.master_weights: update needs the current "
                             "parameters, tx.update(grads, state, params): the updates it "
                             "returns turn them into the rounded float32 master copy.")
        grads = jax.tree.map(_to_f32, grads)
        full = master_params(params, state)
        inner_updates, inner = tx.update(grads, state.inner, full, **extra_args)
        new_master = optax.apply_updates(full, inner_updates)
        keys = None
        if split8:  # the 24-bit masters, rounded stochastically
            leaves, tree = jax.tree.flatten(params)
            news = tree.flatten_up_to(new_master)
            keys = _codes.step_keys(seed, state.count, len(leaves))
            new_master = jax.tree.unflatten(tree, [
                _round_to_24_bits(m, _codes.leaf_bits32(k, np.shape(p)))
                if is_split(p) else m for k, p, m in zip(keys, leaves, news)])

        def to_param(p, new, u):
            if not _is_low_precision(p):
                return u  # a float32 (or integer) parameter: tx's own update
            # Both terms are values of p's dtype, so their float32 difference is exact (unless
            # their exponents are over 15 apart), and p + it, added in float32, is the
            # rounded master value exactly.
            return round_param(new, p).astype(jnp.float32) - jnp.asarray(p, jnp.float32)

        updates = jax.tree.map(to_param, params, new_master, inner_updates)
        stored = jax.tree.map(store, params, new_master)
        fused = getattr(tx, "_split_master_step", None)
        if split and fused is not None and not extra_args:
            # hifigrad's adamw with block-coded moments: on a TPU, the leaves its Pallas kernel
            # takes are updated there, the split master with the moments (bit for bit this)
            updates, stored, inner = fused(grads, state.inner, inner, params, state.master,
                                           full, updates, stored, param_rounding,
                                           master_keys=keys)
        count = state.count + 1 if split8 else ()
        return updates, MasterWeightsState(master=stored, inner=inner, count=count)

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
        return _own_buffers(KahanState(compensation=jax.tree.map(_low_precision_zeros, params),
                                       inner=tx.init(params)), params)

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


def _leaf_bits(key, shape):
    """uint16 random bits for a leaf, from its key (`_codes.step_keys`): the top half of
    `_codes.leaf_bits32` (a counter-based hash of each element's position, keyed by the seed,
    the step and the leaf: the same bits on every backend and under any sharding)."""
    return (_codes.leaf_bits32(key, shape) >> 16).astype(jnp.uint16)


@jax.jit
def _rounded_update(p, u, key):
    """The update that moves bf16 ``p`` to ``p + u`` rounded stochastically with the bits of
    ``key``: a nested jit, so that it is traced once per leaf shape (XLA inlines it)."""
    p32 = jnp.asarray(p, jnp.float32)
    new = round_to_bf16(p32 + u, "stochastic", _leaf_bits(key, np.shape(p)))
    return new.astype(jnp.float32) - p32


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
        return _own_buffers(StochasticRoundingState(count=jnp.zeros((), jnp.uint32),
                                                    inner=tx.init(params)), params)

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.stochastic_rounding: update needs the current "
                             "parameters, tx.update(grads, state, params).")
        inner_updates, inner = tx.update(grads, state.inner, jax.tree.map(_to_f32, params),
                                         **extra_args)
        leaves, tree = jax.tree.flatten(params)
        ups = tree.flatten_up_to(inner_updates)
        out = []
        keys = _codes.step_keys(seed, state.count, len(leaves))
        for key, p, u in zip(keys, leaves, ups):
            if jnp.result_type(p) != jnp.bfloat16:
                out.append(u)
                continue
            out.append(_rounded_update(p, jnp.asarray(u, jnp.float32), key))
        return (jax.tree.unflatten(tree, out),
                StochasticRoundingState(count=state.count + 1, inner=inner))

    return optax.GradientTransformationExtraArgs(init, update)


# ------------------------------------------------------------------ compact Adam moments

_MOMENTS = ("float32", "bf16", *_codes.KINDS)


class AdamState(NamedTuple):
    """The state of `scale_by_adam`.

    Attributes:
      count: the steps taken.
      mu: the first moment as stored: float32, bf16, or (``"fp16"``, ``"8bit"``) its codes;
        with ``"4bit"``, one byte per parameter holding the codes of both moments.
      nu: the second moment as stored: float32, bf16, or (``"fp16"``, ``"8bit"``) the codes of
        its square root, whose sign bits hold each block's two scales; empty with ``"4bit"``.
        A leaf of fewer than ``min_coded_size`` elements (`scale_by_adam`: 4096 by default)
        keeps float32 moments with every setting.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> state = hg.optim.scale_by_adam(moments="fp16").init({"w": jnp.zeros((16, 256))})
      >>> state.mu["w"].dtype, state.nu["w"].dtype    # 2 + 2 bytes, scales included
      (dtype('uint16'), dtype('uint16'))
    """

    count: Any
    mu: Any
    nu: Any


@jax.jit
def _bf16_moments(m, v, key):
    """Both moments rounded to bf16 stochastically with the bits of ``key`` (a nested jit:
    traced once per leaf shape)."""
    bits = _codes.leaf_bits32(key, np.shape(m))
    return (round_to_bf16(m, "stochastic", (bits & 0xFFFF).astype(jnp.uint16)),
            round_to_bf16(v, "stochastic", (bits >> 16).astype(jnp.uint16)))


def _adam_scalars(count, b1, b2, moments, seed, n):
    """`scale_by_adam`'s step: the new count, the bias corrections and the ``n`` leaves'
    random keys (none with float32 moments)."""
    count = count + 1
    c1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count.astype(jnp.float32)
    c2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
    keys = _codes.step_keys(seed, count, n) if moments != "float32" else ()
    return count, c1, c2, keys


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  moments: str = "float32", seed: int = 0,
                  min_coded_size: int | None = None):
    """Adam's scaling (as ``optax.scale_by_adam``) with its moments stored compactly.

    ``moments="float32"``: as optax (8 bytes per parameter). ``"bf16"``: both moments in
    bf16, rounded stochastically (4 bytes; 8 significant bits). The block-coded ones store
    the first moment and the square root of the second relative to one float32 scale per
    block of 128 consecutive elements of the leaf's trailing axes (of 64 to 256 where 128
    does not divide them; the block's largest magnitude), rounded stochastically (unbiased),
    with the block's two scales held in the sign bits of the second moment's codes (a square
    root is never negative), so that the bytes below are exact:

    * ``"fp16"`` (4 bytes): float16 codes (stored as their bits, uint16), the block's scale
      at 2**15: 11 significant bits down to 2**-29 of the block's largest; updates within
      about 0.1% of float32 moments' (norm-wise, on gradients spanning four decades in each
      block: tests/test_optim.py);
    * ``"8bit"`` (2 bytes): small floats of 4 exponent and 3 mantissa bits (and the first
      moment's sign), 14 binary orders of magnitude below the block's largest: lossy, about
      7% of the update's norm on that test;
    * ``"4bit"`` (1 byte, both moments in it): a sign and a 3-bit power of two for the first
      moment (2**-6 to 1, and 0), one of 8 levels half an octave apart for the second's root:
      noisier again (about 45% of the update's norm there); measure it on your model.

    The second moment's root is never stored as zero (below its code's lowest level it is
    stored as that level: an element's step can only be shortened by it). Each step computes
    a block's new moments in float32 from the stored ones, twice (once to find the block's
    new scales, once to encode them; on a TPU, once, in a Pallas kernel that gives the same
    bits), so no float32 moment is materialized; this step's update is computed from the new
    moments before they are rounded, and is at least bounded by the step's own
    ``(1 - b2) * g**2`` in the second moment.

    Leaves of fewer than ``min_coded_size`` elements (4096 by default, as bitsandbytes'
    ``min_8bit_size`` and torchao's low-bit optimizers: biases and norm scales) keep float32
    moments: their bytes are a small share of a model's, and each coded leaf is a program of
    its own for the compiler (about 650 operations after XLA's fusion, against about 80 for a
    float32 one), so a model of many small leaves compiled about 3x slower than optax's step.
    A state whose moments were coded (one made with a smaller ``min_coded_size``, or by an
    earlier version) keeps stepping as stored: each leaf is coded or not as its state is.

    Args:
      b1: the first moment's decay rate.
      b2: the second moment's decay rate.
      eps: added to the second moment's square root in the denominator.
      moments: ``"float32"``, ``"bf16"``, ``"fp16"``, ``"8bit"`` or ``"4bit"``.
      seed: the seed of the stochastic rounding's random bits (a counter-based hash: the same
        on every backend).
      min_coded_size: with ``"fp16"``, ``"8bit"`` or ``"4bit"``, leaves of fewer elements
        keep float32 moments; None: 4096 (64 at least: a block holds its scales in 64 sign
        bits). With ``optax.inject_hyperparams``, a number given here must be named in its
        ``static_args``.

    Returns:
      An ``optax.GradientTransformation`` whose state is an `AdamState`.

    Raises:
      ValueError: an unknown ``moments``, or a ``min_coded_size`` that is not a non-negative
        integer.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> tx = hg.optim.scale_by_adam(moments="8bit")
      >>> state = tx.init({"w": jnp.zeros((16, 256), jnp.bfloat16),
      ...                  "b": jnp.zeros(256, jnp.bfloat16)})
      >>> state.mu["w"].dtype, state.nu["w"].dtype      # one byte each, nothing beside
      (dtype('uint8'), dtype('uint8'))
      >>> state.mu["b"].dtype                           # fewer than 4096 elements
      dtype('float32')
    """
    optax = _optax()
    if moments not in _MOMENTS:
        raise ValueError(f"hifigrad.optim.scale_by_adam: moments must be one of {_MOMENTS}; "
                         f"got {moments!r}.")
    _check_min_coded_size("scale_by_adam", min_coded_size)
    min_size = _codes.MIN_CODED if min_coded_size is None else int(min_coded_size)

    def coded(shape) -> bool:
        return moments in _codes.KINDS and _codes.coded(shape, min_size)

    def zeros(p):
        shape = np.shape(p)
        if coded(shape):
            return _codes.zeros(moments, shape)
        dtype = jnp.bfloat16 if moments == "bf16" else jnp.float32
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def init(params):
        leaves, tree = jax.tree.flatten(params)
        z = [zeros(p) for p in leaves]
        return AdamState(count=jnp.zeros((), jnp.int32),
                         mu=jax.tree.unflatten(tree, [a for a, _ in z]),
                         nu=jax.tree.unflatten(tree, [b for _, b in z]))

    def update(updates, state, params=None):
        del params
        leaves, tree = jax.tree.flatten(updates)
        count, c1, c2, keys = _adam_scalars(state.count, b1, b2, moments, seed, len(leaves))
        mus, nus = tree.flatten_up_to(state.mu), tree.flatten_up_to(state.nu)
        out, new_mu, new_nu = [], [], []
        for i, (g, m, v) in enumerate(zip(leaves, mus, nus)):
            g = jnp.asarray(g, jnp.float32)
            if moments in _codes.KINDS and _codes.is_coded_state(m):   # as the state is
                # the new codes and this step's direction, from the moments before their
                # rounding (with the exact v_t >= (1 - b2) g_t**2: an element whose stored
                # code was rounded to 0 in its block still divides by its own gradient's
                # size); on a TPU one Pallas kernel per leaf (`_codes.leaf_step`)
                sm, sv, u = _codes.leaf_step(moments, g, m, v, keys[i], b1, b2, c1, c2, eps)
                out.append(u)
                new_mu.append(sm)
                new_nu.append(sv)
                continue
            m = b1 * jnp.asarray(m, jnp.float32) + (1 - b1) * g
            v = b2 * jnp.asarray(v, jnp.float32) + (1 - b2) * jnp.square(g)
            if moments == "bf16":
                sm, sv = _bf16_moments(m, v, keys[i])
            else:
                sm, sv = m, v
            # this step's update from its moments before they are rounded for storage
            out.append((m / c1) / (jnp.sqrt(v / c2) + eps))
            new_mu.append(sm)
            new_nu.append(sv)
        unf = functools.partial(jax.tree.unflatten, tree)
        return unf(out), AdamState(count=count, mu=unf(new_mu), nu=unf(new_nu))

    return optax.GradientTransformation(init, update)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4, mask=None, *, moments: str = "float32", seed: int = 0,
          min_coded_size: int | None = None):
    """AdamW (``optax.adamw``) with its moments stored as `scale_by_adam` says: ``"float32"``,
    ``"bf16"``, or block-coded ``"fp16"``, ``"8bit"`` or ``"4bit"`` (4, 2 or 1 bytes per
    parameter for both moments), all rounded stochastically. Combine it with
    `master_weights`, `kahan` or `stochastic_rounding` for the parameters themselves (with
    block-coded moments and `master_weights(..., master="split")`, a TPU updates the moments
    and the split master of a leaf in one Pallas kernel, bit for bit the chain's result, where
    the weight decay is a nonzero number and the mask, if any, is known at trace time).

    Args:
      learning_rate: a float or an optax schedule.
      b1: the first moment's decay rate.
      b2: the second moment's decay rate.
      eps: added to the second moment's square root in the denominator.
      weight_decay: decoupled weight decay (optax's ``add_decayed_weights``).
      mask: which leaves weight decay applies to (as optax's ``mask``).
      moments: ``"float32"``, ``"bf16"``, ``"fp16"``, ``"8bit"`` or ``"4bit"``.
      seed: the seed of the moments' stochastic rounding.
      min_coded_size: block-coded moments are kept for leaves of this many elements or more
        (None: 4096); smaller leaves keep float32 moments (`scale_by_adam`).

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> tx = hg.optim.master_weights(hg.optim.adamw(1e-3, moments="8bit"), master="split8")
      >>> state = tx.init({"w": jnp.zeros((32, 128), jnp.bfloat16)})
      >>> state.master["w"].dtype, state.inner[0].mu["w"].dtype   # 1 + 1 + 1 bytes
      (dtype('uint8'), dtype('uint8'))
    """
    optax = _optax()
    _check_min_coded_size("adamw", min_coded_size)
    tx = optax.chain(scale_by_adam(b1, b2, eps, moments=moments, seed=seed,
                                   min_coded_size=min_coded_size),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))
    if moments not in _codes.KINDS:
        return tx
    fused = functools.partial(_split_adamw_step, (b1, b2, eps, weight_decay, mask,
                                                  learning_rate, moments, seed))

    class AdamW(optax.GradientTransformationExtraArgs):
        # `master_weights(..., master="split")` updates each parameter the Pallas kernel takes
        # in that kernel, with its moments (`_split_adamw_step`)
        _split_master_step = staticmethod(fused)

    return AdamW(tx.init, tx.update)


def _flat_mask(mask, full, tree):
    """Per leaf of ``tree``, whether `optax.masked` (``add_decayed_weights(wd, mask)``) applies
    weight decay to it, as Python bools; None if that is not known at trace time."""
    if mask is None:
        return [True] * tree.num_leaves
    try:
        m = mask(full) if callable(mask) else mask
        flags = tree.flatten_up_to(jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: flag, sub), m, full))
        return [bool(f) for f in flags]
    except Exception:  # a traced or otherwise unusual mask: the unfused update
        return None


def _split_adamw_step(spec, grads, old_inner, inner, params, lows, full, updates, stored,
                      rounding, master_keys=None):
    """`master_weights(adamw(moments=...), master="split")`'s update of the leaves the Pallas
    kernel takes (a TPU), fused: each such leaf's moments and split master in one kernel
    (`optim_codes.split_leaf_step`), over what the unfused update computed (``inner``,
    ``updates``, ``stored``: the new inner state, the updates and the new low halves), which
    stays wherever the kernel does not run; bit for bit that update's result. The weight
    decay and the learning rate are applied as optax's chain does (``u + wd * master``, then
    ``step * u``, then ``master + u``); a weight decay other than a nonzero number, a mask
    or learning rate not known at trace time: nothing fused. ``master_keys``: with
    ``master="split8"``, each leaf's key of the 24-bit master's stochastic rounding (the
    kernel rounds it as `_round_to_24_bits` does)."""
    b1, b2, eps, wd, mask, lr, moments, seed = spec
    if isinstance(wd, bool) or not isinstance(wd, (int, float)) or wd == 0 or lr is None:
        return updates, stored, inner
    leaves, tree = jax.tree.flatten(params)
    decayed = _flat_mask(mask, full, tree)
    adam, old_adam = inner[0], old_inner[0]
    if decayed is None or not isinstance(adam, AdamState):
        return updates, stored, inner
    if callable(lr):   # optax.scale_by_schedule's step, from the chain's own count
        count = getattr(old_inner[2], "count", None)
        if count is None:
            return updates, stored, inner
        step = jnp.array(-1 * lr(count), dtype=jnp.float32)
    else:
        step = jnp.asarray(-1 * lr, jnp.float32)
    _, c1, c2, keys = _adam_scalars(old_adam.count, b1, b2, moments, seed, len(leaves))
    cols = [tree.flatten_up_to(t) for t in (grads, old_adam.mu, old_adam.nu, lows, adam.mu,
                                            adam.nu, stored, updates)]
    for i, (p, g, mu, nu, low, *fallback) in enumerate(zip(leaves, *cols)):
        if jnp.result_type(p) != jnp.bfloat16 or not _codes.is_coded_state(mu):
            continue
        out = _codes.split_leaf_step(moments, jnp.asarray(g, jnp.float32), mu, nu, keys[i],
                                     b1, b2, c1, c2, eps, p, low, step,
                                     wd if decayed[i] else None, rounding, fallback,
                                     None if master_keys is None else master_keys[i])
        for col, x in zip(cols[4:], out):
            col[i] = x
    new_mu, new_nu, stored, updates = (jax.tree.unflatten(tree, c) for c in cols[4:])
    adam = adam._replace(mu=new_mu, nu=new_nu)
    return updates, stored, (adam, *inner[1:])


def _check_min_coded_size(where: str, n) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"hifigrad.optim.{where}: min_coded_size must be a non-negative "
                         f"integer (the fewest elements a leaf's coded moments are kept for; "
                         f"with optax.inject_hyperparams, name it in static_args); got {n!r}.")


def _check_tx(where: str, tx) -> None:
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"hifigrad.optim.{where}: expected an optax GradientTransformation "
                        f"(with init and update), got {type(tx).__name__}: wrap the optimizer "
                        f"itself, e.g. {where}(optax.adamw(1e-3)).")
