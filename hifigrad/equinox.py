"""Equinox integration: `filter_grad` and `filter_value_and_grad` with a float32 backward.

They are ``eqx.filter_grad`` and ``eqx.filter_value_and_grad`` with `hifigrad.value_and_grad` as
the transform: the first argument is split with ``eqx.partition(x, eqx.is_inexact_array)``, its
inexact array leaves are differentiated, every other leaf (ints, functions, strings, static
fields) gets ``None`` as its gradient, and the backward runs in ``tangent_dtype`` (float32 by
default), so a bf16 module gets float32 gradients. Like Equinox's, the wrappers are
``eqx.Module``\\ s: they work under ``eqx.filter_jit`` and as methods.

    >>> import equinox as eqx, jax, jax.numpy as jnp
    >>> import hifigrad as hg
    >>> model = eqx.nn.Linear(4, 2, key=jax.random.key(0), dtype=jnp.bfloat16)
    >>> @eqx.filter_jit
    ... @hg.equinox.filter_grad
    ... def grads(model, x):
    ...     return jnp.sum(model(x).astype(jnp.float32) ** 2)
    >>> grads(model, jnp.ones(4, jnp.bfloat16)).weight.dtype
    dtype('float32')

This module needs Equinox (``pip install 'hifigrad[equinox]'``); ``import hifigrad`` does not
import it: ``hifigrad.equinox`` is loaded on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

try:
    import equinox as eqx
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hifigrad.equinox needs Equinox, an optional dependency: pip install "
        "'hifigrad[equinox]' (or pip install equinox).") from e

from ._src.api import value_and_grad as _hg_value_and_grad
from ._src.policy import Policy, resolve_policy

__all__ = ["filter_grad", "filter_value_and_grad"]


def _check_loss(name: str, out, has_aux: bool) -> None:
    from .flax import _check_loss as check  # no Flax import: a plain helper

    check(name, out, has_aux)


def _no_argnums(name: str, argnums) -> None:
    if argnums is not None:
        raise ValueError(
            f"hg.equinox.{name}: `argnums` is not accepted; the first argument is the one "
            f"differentiated. To differentiate several objects, pass them as a tuple in the "
            f"first argument: f((model, other), x).")


def _check_first(name: str, x) -> None:
    """The differentiated argument must be a module or a pytree of arrays."""
    if isinstance(x, type):
        raise TypeError(
            f"{name}: the first argument (the one differentiated) is the class {x.__name__}, "
            f"not an instance; create the module first, e.g. "
            f"{x.__name__}(..., key=jax.random.key(0)), and pass it.")
    if _is_nnx_module(x):
        raise TypeError(
            f"{name}: the first argument is an NNX module ({type(x).__name__}); differentiate "
            f"NNX modules with hg.flax.grad / hg.flax.value_and_grad, which propagate their "
            f"state updates as nnx.grad does.")
    if _is_linen_module(x):
        raise TypeError(
            f"{name}: the first argument is a Linen module ({type(x).__name__}), which holds no "
            f"parameters; differentiate its params with "
            f"hg.grad(lambda params, x: loss(model.apply(params, x)))(params, x).")
    leaves = jax.tree_util.tree_leaves(x)
    if len(leaves) == 1 and leaves[0] is x and callable(x) and not hasattr(x, "shape"):
        raise TypeError(
            f"{name}: the first argument is what is differentiated (an eqx.Module or a pytree "
            f"of arrays), but got the callable {x!r}. Pass the model first: "
            f"filter_grad(loss)(model, *inputs).")


def _is_nnx_module(x) -> bool:
    import sys

    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def _is_linen_module(x) -> bool:
    import sys

    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(x, linen.Module)


class _ValueAndGradWrapper(eqx.Module):
    _fun: Callable
    _has_aux: bool = eqx.field(static=True)
    _policy: Policy = eqx.field(static=True)
    _name: str = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        if not args:
            how = "by keyword" if kwargs else "at all"
            raise TypeError(
                f"{self._name}: the first argument (the one differentiated) must be passed by "
                f"position, but none was passed {how}; call f(model, *inputs).")
        x, *args = args
        _check_first(self._name, x)

        def fun_value_and_grad(_diff_x, _nondiff_x, *_args, **_kwargs):
            out = self._fun(eqx.combine(_diff_x, _nondiff_x), *_args, **_kwargs)
            _check_loss(self._name, out, self._has_aux)
            return out

        diff_x, nondiff_x = eqx.partition(x, eqx.is_inexact_array)
        vg = _hg_value_and_grad(fun_value_and_grad, has_aux=self._has_aux, policy=self._policy)
        return vg(diff_x, nondiff_x, *args, **kwargs)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


class _GradWrapper(eqx.Module):
    _fun_value_and_grad: _ValueAndGradWrapper
    _has_aux: bool = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun_value_and_grad.__wrapped__

    def __call__(self, *args, **kwargs):
        value, grad = self._fun_value_and_grad(*args, **kwargs)
        if self._has_aux:
            return grad, value[1]
        return grad

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return eqx.Partial(self, instance)


def filter_value_and_grad(fun: Callable | None = None, *, has_aux: bool = False,
                          tangent_dtype=None, policy: Policy | None = None, argnums=None):
    """``eqx.filter_value_and_grad`` with the backward pass in ``tangent_dtype`` (default f32).

    Differentiates `fun` with respect to the inexact (floating) array leaves of its first
    argument; other leaves get ``None``. Returns ``(value, grads)``, or ``((value, aux), grads)``
    with ``has_aux=True``; the value is `fun`'s own output, bitwise. A bf16 leaf's gradient is
    float32. Usable as a decorator, with or without arguments.

    Args:
      fun: the function; it returns a scalar loss (or ``(loss, aux)``).
      has_aux: whether `fun` returns ``(loss, aux)``.
      tangent_dtype: as in `hifigrad.grad` (default float32).
      policy: as in `hifigrad.grad`.
      argnums: not accepted (as in Equinox): the first argument is the one differentiated.

    Returns:
      An ``eqx.Module`` wrapping `fun` that returns ``(value, grads)`` (``((value, aux),
      grads)`` with ``has_aux=True``), or, called without `fun`, a decorator.

    Raises:
      ValueError: ``argnums`` is given.
      TypeError: `fun` is not callable; (when called) `fun` does not return a real scalar loss
        (or ``(loss, aux)`` with ``has_aux=True``).

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp, hifigrad as hg
      >>> model = eqx.nn.Linear(3, 1, key=jax.random.key(0), dtype=jnp.bfloat16)
      >>> loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
      >>> value, grads = hg.equinox.filter_value_and_grad(loss)(model, jnp.ones(3, jnp.bfloat16))
      >>> value.dtype, grads.weight.dtype
      (dtype('float32'), dtype('float32'))
    """
    _no_argnums("filter_value_and_grad", argnums)
    if fun is None:
        return functools.partial(filter_value_and_grad, has_aux=has_aux,
                                 tangent_dtype=tangent_dtype, policy=policy)
    if not callable(fun):
        raise TypeError(f"hg.equinox.filter_value_and_grad: expected a function; got {fun!r}.")
    policy = resolve_policy(policy, tangent_dtype)
    return eqx.module_update_wrapper(_ValueAndGradWrapper(
        fun, has_aux, policy, "hg.equinox.filter_value_and_grad"))


def filter_grad(fun: Callable | None = None, *, has_aux: bool = False, tangent_dtype=None,
                policy: Policy | None = None, argnums=None):
    """``eqx.filter_grad`` with the backward pass in ``tangent_dtype`` (default float32).

    Returns the gradient with respect to the first argument (``None`` for its leaves that are
    not inexact arrays), or ``(grads, aux)`` with ``has_aux=True``. See
    `filter_value_and_grad`.

    Args:
      fun: the function; it returns a scalar loss (or ``(loss, aux)``).
      has_aux: whether `fun` returns ``(loss, aux)``.
      tangent_dtype: as in `hifigrad.grad` (default float32).
      policy: as in `hifigrad.grad`.
      argnums: not accepted (as in Equinox): the first argument is the one differentiated.

    Returns:
      An ``eqx.Module`` wrapping `fun` that returns the gradients (``(grads, aux)`` with
      ``has_aux=True``), or, called without `fun`, a decorator.

    Raises:
      ValueError: ``argnums`` is given.
      TypeError: `fun` is not callable; (when called) `fun` does not return a real scalar loss
        (or ``(loss, aux)`` with ``has_aux=True``).

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp, hifigrad as hg
      >>> model = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(0), dtype=jnp.bfloat16)
      >>> @eqx.filter_jit
      ... @hg.equinox.filter_grad
      ... def grads(model, x):
      ...     return jnp.sum(model(x).astype(jnp.float32) ** 2)
      >>> g = grads(model, jnp.ones(3, jnp.bfloat16))
      >>> g.layers[0].weight.dtype, g.activation       # a non-array leaf gets None
      (dtype('float32'), None)
    """
    _no_argnums("filter_grad", argnums)
    if fun is None:
        return functools.partial(filter_grad, has_aux=has_aux, tangent_dtype=tangent_dtype,
                                 policy=policy)
    if not callable(fun):
        raise TypeError(f"hg.equinox.filter_grad: expected a function; got {fun!r}.")
    policy = resolve_policy(policy, tangent_dtype)
    vg = _ValueAndGradWrapper(fun, has_aux, policy, "hg.equinox.filter_grad")
    return eqx.module_update_wrapper(_GradWrapper(vg, has_aux))
