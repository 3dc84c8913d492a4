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

NNX gradients: `grad` and `value_and_grad` are `nnx.grad` and `nnx.value_and_grad` with the
backward pass in float32 (``tangent_dtype``/``policy`` as in `hifigrad.grad`). They take the same
``argnums`` (ints and ``nnx.DiffState`` filters), ``has_aux``, ``allow_int``, ``graph`` and
``graph_updates``, return gradients as ``nnx.State``, and propagate the updates made inside the
function (BatchNorm statistics, RNG counts, any ``nnx.Variable``) to the caller's objects, with
NNX's own split/merge machinery: only the differentiation itself is hifigrad's.

    >>> model = nnx.Linear(8, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 8), jnp.bfloat16)
    >>> g = hg.flax.grad(lambda m, x: m(x).astype(jnp.float32).sum())(model, x)
    >>> g["kernel"][...].dtype
    dtype('float32')

Linen needs nothing new: ``hg.grad(lambda p, x: loss(model.apply(p, x)))(params, x)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.tree_util import tree_flatten, tree_leaves

from ._src.checkpoint import check_save, checkpoint_call, is_float_array
from ._src.codecs import get_codec
from ._src.policy import Policy, resolve_checkpoint_policy, resolve_policy

__all__ = ["grad", "remat_scan", "scan_layers", "value_and_grad"]


def _check_policy(policy) -> Policy:
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            "hifigrad.flax.remat_scan: `policy` is a hifigrad.Policy for the recomputed "
            "backward; a jax.checkpoint policy does not apply (every block is recomputed from "
            f"its encoded input). Got {policy!r}.")
    return resolve_checkpoint_policy(policy)


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
        encode = [i >= n_fixed and is_float_array(x) for i, x in enumerate(flat)]
        return checkpoint_call(f, flat, in_tree, encode, codec, policy, save)

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
      variable_broadcast: as in ``nn.remat_scan``.
      variable_carry: as in ``nn.remat_scan``.
      variable_axes: as in ``nn.remat_scan`` (default ``{True: 0}``).
      split_rngs: as in ``nn.remat_scan`` (default ``{True: True}``).
      codec: a codec or its name ("fp8_e4m3", "int8", "int4", ...).
      save: ``"inputs"`` (each block's input carry saved encoded, the block recomputed from
        it) or ``"residuals"`` (the residuals of each block's backward that derive from the
        carry saved encoded, ReLU masks bit-packed; no recomputation from lossy data): see
        `hifigrad.checkpoint`.

    Returns:
      A Module class, as ``nn.remat_scan`` returns: its ``__call__(carry)`` applies the
      ``prod(lengths)`` blocks in turn.

    Raises:
      ValueError: ``lengths`` is empty; an unknown codec name or ``save`` mode.
      TypeError: ``policy`` is not a `hifigrad.Policy` (a `jax.checkpoint` policy does not
        apply: every block is recomputed from its encoded input).

    Examples:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, hifigrad as hg
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return jnp.tanh(nn.Dense(8)(x))
      >>> Stack = hg.flax.remat_scan(Block, lengths=(3,), codec="int8",
      ...                            variable_axes={"params": 0}, split_rngs={"params": True})
      >>> x = jnp.ones((2, 8))
      >>> params = Stack().init(jax.random.key(0), x)
      >>> g = jax.grad(lambda p: Stack().apply(p, x).sum())(params)
      >>> g["params"]["Dense_0"]["kernel"].shape     # stacked: one kernel per block
      (3, 8, 8)
    """
    from flax.linen import transforms

    codec = get_codec(codec)
    policy = _check_policy(policy)
    save = check_save(save)
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

    Args:
      blocks: an NNX module whose state has a leading layer axis (made with ``nnx.vmap``).
      x: the input of the first layer (the carry).
      codec: a codec or its name ("fp8_e4m3", "int8", "int4", ...).
      policy: a `hifigrad.Policy` for the recomputed backward (float32 by default).
      reverse: apply the layers last to first.
      activation: a function applied to each layer's output, or None.
      save: ``"inputs"`` or ``"residuals"``, as in `hifigrad.checkpoint`.

    Returns:
      The last layer's output.

    Raises:
      ValueError: an unknown codec name or ``save`` mode.
      TypeError: ``codec`` is neither a name nor a codec.

    Examples:
      >>> import jax, jax.numpy as jnp, hifigrad as hg
      >>> from flax import nnx
      >>> @nnx.vmap(in_axes=0, out_axes=0)
      ... def make_blocks(key):
      ...     return nnx.Linear(8, 8, rngs=nnx.Rngs(key))
      >>> blocks = make_blocks(jax.random.split(jax.random.key(0), 4))
      >>> y = hg.flax.scan_layers(blocks, jnp.ones((2, 8)), codec="int8", activation=jnp.tanh)
      >>> y.shape
      (2, 8)
    """
    from flax import nnx

    from ._src.checkpoint import scan as hg_scan

    graphdef, state = nnx.split(blocks)

    def body(carry, layer_state):
        out = nnx.merge(graphdef, layer_state)(carry)
        return (out if activation is None else activation(out)), None

    return hg_scan(body, x, state, codec=codec, policy=policy, reverse=reverse, save=save)[0]



# ------------------------------------------------------------------------------ NNX grad

def grad(f: Callable | None = None, *, argnums=0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, graph: bool | None = None,
         graph_updates: bool | None = None, tangent_dtype=None, policy: Policy | None = None):
    """`flax.nnx.grad` with the backward pass in ``tangent_dtype`` (default float32).

    Same arguments and results as ``nnx.grad``: NNX objects at ``argnums`` are differentiated
    with respect to their ``nnx.Param`` Variables (or the filter of an ``nnx.DiffState``), the
    gradient of an NNX object is an ``nnx.State``, and Variables updated inside `f` (BatchNorm
    statistics, RNG counts, ...) are updated in the caller's objects, as ``nnx.grad`` does. A
    bf16 parameter's gradient is float32. Works eagerly and inside ``nnx.jit``; usable as a
    decorator, ``@hg.flax.grad(has_aux=True)``.

    Args:
      f: the function to differentiate; it returns a scalar loss (or ``(loss, aux)``).
      argnums: an int, an ``nnx.DiffState(argnum, filter)``, or a sequence of them.
      has_aux: whether `f` returns ``(loss, aux)``.
      holomorphic: not supported (hifigrad differentiates real floating values).
      allow_int: as in ``jax.grad``.
      graph: as in ``nnx.grad`` (default: NNX's current setting).
      graph_updates: as in ``nnx.grad`` (default: NNX's current setting).
      tangent_dtype: as in `hifigrad.grad` (default float32).
      policy: as in `hifigrad.grad`.

    Returns:
      A function with `f`'s signature returning the gradients (``(grads, aux)`` with
      ``has_aux=True``), or, called without `f`, a decorator.

    Raises:
      ImportError: Flax is not installed.
      NotImplementedError: ``holomorphic=True``.
      TypeError: `f` is not callable; (when called) `f` does not return a real scalar loss (or
        ``(loss, aux)`` with ``has_aux=True``).
      ValueError: ``argnums`` is empty or repeats a position.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((1, 4), jnp.bfloat16)
      >>> g = hg.flax.grad(lambda m, x: m(x).astype(jnp.float32).sum())(model, x)
      >>> g["kernel"][...].dtype, type(g).__name__
      (dtype('float32'), 'State')
    """
    kw = dict(argnums=argnums, has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int,
              graph=graph, graph_updates=graph_updates, tangent_dtype=tangent_dtype,
              policy=policy)
    if f is None:
        return functools.partial(grad, **kw)
    return _nnx_grad_general(f, return_value=False, **kw)


def value_and_grad(f: Callable | None = None, *, argnums=0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False,
                   graph: bool | None = None, graph_updates: bool | None = None,
                   tangent_dtype=None, policy: Policy | None = None):
    """`flax.nnx.value_and_grad` with the backward pass in ``tangent_dtype`` (default float32).

    Returns ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux=True``; the loss is
    `f`'s own output, bitwise. Otherwise as `grad`.

    Args:
      f: the function to differentiate; it returns a scalar loss (or ``(loss, aux)``).
      argnums: an int, an ``nnx.DiffState(argnum, filter)``, or a sequence of them.
      has_aux: whether `f` returns ``(loss, aux)``.
      holomorphic: not supported (hifigrad differentiates real floating values).
      allow_int: as in ``jax.grad``.
      graph: as in ``nnx.value_and_grad`` (default: NNX's current setting).
      graph_updates: as in ``nnx.value_and_grad`` (default: NNX's current setting).
      tangent_dtype: as in `hifigrad.grad` (default float32).
      policy: as in `hifigrad.grad`.

    Returns:
      A function with `f`'s signature returning ``(loss, grads)`` (``((loss, aux), grads)``
      with ``has_aux=True``), or, called without `f`, a decorator.

    Raises:
      ImportError: Flax is not installed.
      NotImplementedError: ``holomorphic=True``.
      TypeError: `f` is not callable; (when called) `f` does not return a real scalar loss (or
        ``(loss, aux)`` with ``has_aux=True``).
      ValueError: ``argnums`` is empty or repeats a position.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
      >>> l, g = nnx.jit(hg.flax.value_and_grad(loss))(model, jnp.ones((1, 4), jnp.bfloat16))
      >>> l.dtype, g["kernel"][...].dtype
      (dtype('float32'), dtype('float32'))
    """
    kw = dict(argnums=argnums, has_aux=has_aux, holomorphic=holomorphic, allow_int=allow_int,
              graph=graph, graph_updates=graph_updates, tangent_dtype=tangent_dtype,
              policy=policy)
    if f is None:
        return functools.partial(value_and_grad, **kw)
    return _nnx_grad_general(f, return_value=True, **kw)


def _check_loss(name: str, out, has_aux: bool):
    """Raises a clear error unless `out` is a scalar floating loss (or ``(loss, aux)``)."""
    import jax.numpy as jnp
    import numpy as np

    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{name}(..., has_aux=True): the function must return a pair (loss, aux); got "
                f"{type(out).__name__}. Return `loss, aux`, or drop has_aux=True.")
        out = out[0]
    elif isinstance(out, tuple):
        raise TypeError(
            f"{name}: the function returned a tuple of {len(out)} values, but it must return a "
            f"scalar loss. If the other values are auxiliary outputs, return `(loss, aux)` and "
            f"pass has_aux=True.")
    if not hasattr(out, "shape") and not isinstance(out, (int, float)):
        raise TypeError(
            f"{name}: the function must return a scalar loss (an array of shape ()); got "
            f"{type(out).__name__}.")
    if np.shape(out) != ():
        raise TypeError(
            f"{name}: the function must return a scalar loss, but it returned an array of "
            f"shape {np.shape(out)}; reduce it to a scalar, e.g. with `jnp.mean(loss)`.")
    dtype = jnp.result_type(out)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{name}: the loss must have a real floating dtype, but it has dtype {dtype}; "
            f"cast it, e.g. `loss.astype(jnp.float32)`.")


def _checked(f: Callable, name: str, has_aux: bool) -> Callable:
    @functools.wraps(f)
    def checked(*args, **kwargs):
        out = f(*args, **kwargs)
        _check_loss(name, out, has_aux)
        return out

    return checked


def _nnx_argnums(name: str, argnums):
    """Validates ``argnums`` (ints and ``nnx.DiffState``s) before NNX reads it."""
    from flax.nnx.transforms.autodiff import DiffState

    items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
    if not items:
        raise ValueError(f"{name}: argnums is empty; pass at least one argument index, e.g. 0.")
    out = []
    for a in items:
        index = a.argnum if isinstance(a, DiffState) else a
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(
                f"{name}: argnums must be an int, an nnx.DiffState(argnum, filter), or a "
                f"sequence of them; got {a!r}.")
        if index < 0:
            raise ValueError(
                f"{name}: argnums must be non-negative argument positions; got {index}. "
                f"Count positions from 0 (the first argument).")
        out.append((index, a))
    if len({i for i, _ in out}) != len(out):
        raise ValueError(f"{name}: argnums {argnums!r} repeats an argument position; list each "
                         f"argument once.")
    return out


def _check_nnx_args(name: str, args: tuple, items) -> None:
    from flax import linen
    from flax.nnx import graphlib, variablelib
    from flax.nnx.transforms.autodiff import DiffState

    for index, a in items:
        if index >= len(args):
            raise IndexError(
                f"{name}: argnums refers to argument {index}, but the function was called with "
                f"{len(args)} positional argument(s); pass argnums < {len(args)} or pass the "
                f"argument positionally.")
        arg = args[index]
        if isinstance(arg, linen.Module):
            raise TypeError(
                f"{name}: argument {index} is a Linen module ({type(arg).__name__}), which holds "
                f"no parameters. Differentiate its parameters instead: "
                f"hg.grad(lambda params, x: loss(model.apply(params, x)))(params, x).")
        if isinstance(arg, type):
            raise TypeError(
                f"{name}: argument {index} is the class {arg.__name__}, not an instance; "
                f"create the module first, e.g. {arg.__name__}(..., rngs=nnx.Rngs(0)).")
        if isinstance(a, DiffState) and not (
                graphlib.is_graph_node(arg) or isinstance(arg, variablelib.Variable)):
            raise TypeError(
                f"{name}: argnums has nnx.DiffState({index}, ...), whose filter selects the "
                f"Variables of an NNX module, but argument {index} is a "
                f"{type(arg).__name__}, not an nnx.Module. Pass the module at position "
                f"{index}, or use a plain int argnum ({index}) to differentiate an array.")


def _nnx_grad_general(f, *, argnums, has_aux, holomorphic, allow_int, graph, graph_updates,
                      tangent_dtype, policy, return_value):
    """``flax.nnx.transforms.autodiff._grad_general`` with `hifigrad.value_and_grad` (or
    `hifigrad.grad`) as the transform. The NNX side (`GradFn`, `SimpleGradFn`, the split into
    differentiated and non-differentiated states, the update context) is NNX's own."""
    import dataclasses
    from collections import deque

    try:
        import flax.nnx  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("hg.flax.grad / value_and_grad need Flax, an optional dependency: "
                          "pip install 'hifigrad[flax]' (or pip install flax).") from e
    from flax.nnx import extract, graphlib, variablelib
    from flax.nnx.transforms.autodiff import DiffState, GradFn, SimpleGradFn
    from flax.nnx.transforms.transforms import (
        _raise_bound_method_error,
        _resolve_bound_callable,
        resolve_kwargs,
    )

    from ._src.api import grad as hg_grad
    from ._src.api import value_and_grad as hg_value_and_grad

    name = "hg.flax.value_and_grad" if return_value else "hg.flax.grad"
    if holomorphic:
        raise NotImplementedError(
            f"{name}: holomorphic=True is not supported; hifigrad differentiates real floating "
            f"values. Use nnx.grad for complex holomorphic functions.")
    if not callable(f):
        raise TypeError(f"{name}: expected a function to differentiate; got {f!r}.")
    policy = resolve_policy(policy, tangent_dtype)
    items = _nnx_argnums(name, argnums)
    if graph is None:
        graph = graphlib.set_graph_mode.current_value()
    if graph_updates is None:
        graph_updates = graphlib.set_graph_updates.current_value()
    extract.check_prefix(argnums, "argnums", "grad", graph, graph_updates)
    f, _, was_bound = _resolve_bound_callable(f)
    if was_bound:
        _raise_bound_method_error("grad")
    f = _checked(f, name, has_aux)
    base = hg_value_and_grad if return_value else hg_grad

    def transform(fn, *, argnums, has_aux, allow_int):
        return base(fn, argnums=argnums, has_aux=has_aux, allow_int=allow_int, policy=policy)

    if not graph or not graph_updates:
        gradded_fn = transform(SimpleGradFn(f, has_aux, graph=graph), argnums=argnums,
                               has_aux=True, allow_int=allow_int)

        def tree_grad_wrapper(*args, **kwargs):
            _check_nnx_args(name, args, items)
            if graph:
                diff_argnums = (argnums,) if isinstance(argnums, int) else argnums
                args_prefix = tuple(i in diff_argnums for i in range(len(args)))
                args, kwargs = extract.to_tree2((args, kwargs), prefix=(args_prefix, False))
            variables = extract.check_no_aliases("grad", args=args, kwargs=kwargs)
            fn_out = gradded_fn(*args, **kwargs)
            if return_value:
                if has_aux:
                    (loss, (updates, aux)), grads = fn_out
                    if graph:
                        grads, aux = extract.from_tree2((grads, aux))
                    result = (loss, aux), grads
                else:
                    (loss, updates), grads = fn_out
                    if graph:
                        grads = extract.from_tree2(grads)
                    result = loss, grads
            else:
                if has_aux:
                    grads, (updates, aux) = fn_out
                    if graph:
                        grads, aux = extract.from_tree2((grads, aux))
                    result = grads, aux
                else:
                    grads, updates = fn_out
                    if graph:
                        grads = extract.from_tree2(grads)
                    result = grads
            extract.apply_updates(variables, updates)
            return result

        return tree_grad_wrapper

    jax_argnums = items[0][0] if not isinstance(argnums, (tuple, list)) else tuple(
        i for i, _ in items)
    index_filter = {
        i: dataclasses.replace(a, argnum=-1) if isinstance(a, DiffState)
        else DiffState(-1, variablelib.Param) for i, a in items}

    @graphlib.update_context("grad")
    def grad_wrapper(*args, **kwargs):
        args = resolve_kwargs(f, args, kwargs)
        del kwargs
        _check_nnx_args(name, args, items)
        nondiff_states: deque = deque()

        def _grad_split_fn(ctx, path, prefix, value):
            if prefix is None or (prefix.argnum == -1 and isinstance(value, variablelib.Variable)):
                nondiff_states.append(None)
                return extract.NodeStates.from_split(*ctx.split(value))
            graphdef, diff, nondiff = ctx.split(value, prefix.filter, ...)
            nondiff_states.append(nondiff)
            return extract.NodeStates.from_split(graphdef, diff)

        arg_filters = tuple(index_filter.get(i) for i in range(len(args)))
        pure_args = extract.to_tree(args, prefix=arg_filters, split_fn=_grad_split_fn,
                                    ctxtag="grad")
        gradded_fn = transform(GradFn(f, has_aux, nondiff_states), argnums=jax_argnums,
                               has_aux=True, allow_int=allow_int)
        fn_out = gradded_fn(*pure_args)

        def process_grads(grads):
            return jax.tree.map(lambda x: x.state if isinstance(x, extract.NodeStates) else x,
                                grads, is_leaf=lambda x: isinstance(x, extract.NodeStates))

        def process_out(pure_out):
            return extract.from_tree(pure_out, ctxtag="grad", is_inner=False)

        if return_value:
            if has_aux:
                (loss, (pure_args_out, pure_aux)), grads = fn_out
                _, aux = process_out((pure_args_out, pure_aux))
                return (loss, aux), process_grads(grads)
            (loss, pure_args_out), grads = fn_out
            process_out(pure_args_out)
            return loss, process_grads(grads)
        if has_aux:
            grads, (pure_args_out, pure_aux) = fn_out
            _, aux = process_out((pure_args_out, pure_aux))
            return process_grads(grads), aux
        grads, pure_args_out = fn_out
        process_out(pure_args_out)
        return process_grads(grads)

    return grad_wrapper
