"""Flax integration: compressed activation checkpoints for scanned layer stacks.

Linen: `remat_scan` is `flax.linen.remat_scan` with a `codec`: the carry between scanned blocks is
saved encoded (fp8, int8, int4, ...) and each block is recomputed from it in the backward, whose
gradients stay float32. Parameters are saved as they are.

NNX: `scan_layers(blocks, x, codec=...)` applies a stack of layers created with `nnx.vmap` (the
standard NNX scan-over-layers idiom) with `hifigrad.scan`:

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import hifigrad as hg
    >>> @nnx.vmap(in_axes=0, out_axes=0)
    ... def make_blocks(key):
    ...     return nnx.Linear(8, 8, rngs=nnx.Rngs(key))
    >>> blocks = make_blocks(jax.random.split(jax.random.key(0), 4))
    >>> def loss(blocks, x):
    ...     return hg.flax.scan_layers(blocks, x, codec="fp8_e4m3").sum()
    >>> grads = nnx.grad(loss)(blocks, jnp.ones((2, 8)))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.tree_util import tree_flatten, tree_leaves

from ._src.checkpoint import _check_save, _is_float, _run
from ._src.codecs import get_codec
from ._src.policy import Policy, resolve_policy

__all__ = ["remat_scan", "scan_layers"]


def _check_policy(policy) -> Policy:
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            "hifigrad.flax.remat_scan: `policy` is a hifigrad.Policy for the recomputed "
            "backward; a jax.checkpoint policy does not apply (every block is recomputed from "
            f"its encoded input). Got {policy!r}.")
    return resolve_policy(policy)


def _encoded_remat(fn: Callable, codec, policy: Policy, save: str):
    """A lifted (Flax core) checkpoint whose non-variable array inputs are saved encoded."""
    from flax.core import lift

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args):
        def f(variable_groups, rng_groups, *args):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args)
            return y, repack_fn(scope)

        full = (variable_groups, rng_groups, *args)
        n_fixed = len(tree_leaves((variable_groups, rng_groups)))
        flat, in_tree = tree_flatten(full)
        encode = [i >= n_fixed and _is_float(x) for i, x in enumerate(flat)]
        return _run(f, flat, in_tree, encode, codec, policy, save)

    return lift.pack(inner, (True,), (True,), (True,), name="hg_checkpoint")


def _lift_remat_scan(body_fn, lengths: Sequence[int], codec, policy, save, variable_broadcast,
                     variable_carry, variable_axes, split_rngs):
    from flax.core import lift

    scan_fn = functools.partial(lift.scan, variable_broadcast=variable_broadcast,
                                variable_carry=variable_carry, variable_axes=variable_axes,
                                split_rngs=split_rngs)
    if len(lengths) == 1:
        def wrapper(scope, carry):
            return body_fn(scope, carry), ()

        step = _encoded_remat(wrapper, codec, policy, save)
        return lambda scope, c: scan_fn(step, length=lengths[0])(scope, c)[0]

    def inner_loop(scope, carry):
        return _lift_remat_scan(body_fn, lengths[1:], codec, policy, save, variable_broadcast,
                                variable_carry, variable_axes, split_rngs)(scope, carry), ()

    return lambda scope, c: scan_fn(inner_loop, length=lengths[0])(scope, c)[0]


def remat_scan(target, lengths: Sequence[int] | None = (), policy: Policy | None = None,
               variable_broadcast: Any = False, variable_carry: Any = False,
               variable_axes: Mapping[Any, int] | None = None,
               split_rngs: Mapping[Any, bool] | None = None, *, codec, save: str = "inputs"):
    """`flax.linen.remat_scan` whose scanned carries are saved encoded with `codec`.

    Args:
      target: a Module class whose ``__call__(carry)`` returns the next carry.
      lengths: loop lengths (their product is the number of blocks), as in ``nn.remat_scan``.
      policy: a `hifigrad.Policy` for the recomputed backward (float32 by default).
      variable_broadcast, variable_carry, variable_axes, split_rngs: as in ``nn.remat_scan``.
      codec: a codec or its name ("fp8_e4m3", "int8", "int4", ...).
      save: ``"inputs"`` (each block's input carry saved encoded, the block recomputed from
        it) or ``"residuals"`` (the residuals of each block's backward that derive from the
        carry saved encoded, ReLU masks bit-packed; no recomputation from lossy data): see
        `hifigrad.checkpoint`.

    Example:
      ``Stack = hg.flax.remat_scan(Block, lengths=(12,), codec="fp8_e4m3",
      variable_axes={"params": 0}, split_rngs={"params": True})``
    """
    from flax.linen import transforms

    codec = get_codec(codec)
    policy = _check_policy(policy)
    save = _check_save(save)
    if not lengths:
        raise ValueError("remat_scan needs at least one loop length, e.g. lengths=(12,).")
    return transforms.lift_transform(
        _lift_remat_scan, target, lengths=tuple(lengths), codec=codec, policy=policy, save=save,
        variable_broadcast=variable_broadcast, variable_carry=variable_carry,
        variable_axes=dict(variable_axes) if variable_axes is not None else {True: 0},
        split_rngs=dict(split_rngs) if split_rngs is not None else {True: True})


def scan_layers(blocks, x, *, codec, policy: Policy | None = None, reverse: bool = False,
                activation: Callable | None = None, save: str = "inputs"):
    """Applies a stack of NNX layers (created with ``nnx.vmap``) to `x` with `hifigrad.scan`.

    Each layer's input is saved encoded with `codec` and each layer is recomputed in the
    backward (float32); ``save="residuals"`` saves the encoded residuals instead (see
    `hifigrad.checkpoint`). Layers must be pure functions of their input (no state updates such as
    BatchNorm statistics inside the stack). `activation`, if given, is applied after each layer.
    """
    from flax import nnx

    from ._src.checkpoint import scan as hg_scan

    graphdef, state = nnx.split(blocks)

    def body(carry, layer_state):
        out = nnx.merge(graphdef, layer_state)(carry)
        return (out if activation is None else activation(out)), None

    return hg_scan(body, x, state, codec=codec, policy=policy, reverse=reverse, save=save)[0]

