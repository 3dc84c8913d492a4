"""Optimizer helpers for low-precision parameters (needs optax, imported when first used).

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MasterWeightsState", "master_weights"]

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


class MasterWeightsState(NamedTuple):
    """The state of a `master_weights` transformation.

    Attributes:
      master: the float32 master copy of the parameters (float32 leaves of the parameters'
        pytree; leaves that are not low-precision floats are kept as they are). Evaluate or
        checkpoint the model from it when the rounded parameters are not enough.
      inner: the wrapped transformation's state, created from (and updated against) the
        master copy, so its float moments are float32.

    Examples:
      >>> import jax.numpy as jnp, optax, hifigrad as hg
      >>> state = hg.optim.master_weights(optax.adam(1e-3)).init(
      ...     {"w": jnp.zeros(3, jnp.bfloat16)})
      >>> state.master["w"].dtype, state.inner[0].mu["w"].dtype
      (dtype('float32'), dtype('float32'))
    """

    master: Any
    inner: Any


def master_weights(tx):
    """Wraps an optax transformation to train low-precision parameters through a float32
    master copy.

    ``init(params)`` keeps a float32 copy of ``params`` (bf16 / fp16 leaves upcast, others as
    they are) and initializes ``tx`` on it. ``update(grads, state, params)`` casts low-precision
    gradients to float32 (hifigrad's already are), runs ``tx.update`` on the master copy, applies
    the result to it in float32, and returns updates that turn ``params`` into the new master
    copy rounded to each parameter's dtype: ``optax.apply_updates(params, updates)`` (or
    ``nnx.Optimizer.update``) then gives exactly ``new_master.astype(param.dtype)``. The updates
    of bf16 / fp16 parameters are float32 (``optax.apply_updates`` adds in float32 and casts
    back, under JAX's default ``standard`` dtype promotion, which optax needs anyway); those of
    float32 parameters are ``tx``'s own, so a float32 model trains as with ``tx`` alone.

    Args:
      tx: an ``optax.GradientTransformation`` (e.g. ``optax.adamw(1e-3)``, a chain with
        clipping, a schedule).

    Returns:
      An ``optax.GradientTransformation`` whose state is a `MasterWeightsState`.

    Raises:
      ImportError: optax is not installed (the message says how to install it).
      TypeError: ``tx`` is not an optax transformation (no ``init`` / ``update``).
      ValueError: (from ``update``) called without ``params``, which the updates are computed
        against.

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
    """
    optax = _optax()
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"hifigrad.optim.master_weights: expected an optax "
                        f"GradientTransformation (with init and update), got "
                        f"{type(tx).__name__}: wrap the optimizer itself, e.g. "
                        f"master_weights(optax.adamw(1e-3)).")

    def init(params):
        master = jax.tree.map(_to_f32, params)
        return MasterWeightsState(master=master, inner=tx.init(master))

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("hifigrad.optim.master_weights: update needs the current "
                             "parameters, tx.update(grads, state, params): the updates it "
                             "returns turn them into the rounded float32 master copy.")
        grads = jax.tree.map(_to_f32, grads)
        inner_updates, inner = tx.update(grads, state.inner, state.master, **extra_args)
        master = optax.apply_updates(state.master, inner_updates)

        def to_param(p, new, u):
            if not _is_low_precision(p):
                return u  # a float32 (or integer) parameter: tx's own update
            # Both terms are values of p's dtype, so their float32 difference is exact (unless
            # their exponents are over 15 apart), and p + it, added in float32, is the
            # rounded master value exactly.
            return new.astype(p.dtype).astype(jnp.float32) - jnp.asarray(p, jnp.float32)

        updates = jax.tree.map(to_param, params, master, inner_updates)
        return updates, MasterWeightsState(master=master, inner=inner)

    return optax.GradientTransformationExtraArgs(init, update)
