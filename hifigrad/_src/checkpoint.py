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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.tree_util import tree_flatten, tree_unflatten

from .codecs import Codec, Encoded, get_codec
from .policy import Policy, resolve_policy

__all__ = ["checkpoint", "scan"]


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _check_encodable(x):
    if isinstance(x, Encoded):
        raise TypeError("hifigrad.checkpoint: an input is already an encoded (compressed) value; "
                        "decode it first, or pass the uncompressed array.")


def _encoded_call(fun_flat: Callable, codec: Codec, policy: Policy, encode: Sequence[bool],
                  args: Sequence, consts: Sequence):
    return _ckpt(fun_flat, codec, policy, tuple(encode), tuple(args), tuple(consts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ckpt(fun_flat, codec, policy, encode, args, consts):
    return fun_flat(*args, *consts)


def _ckpt_fwd(fun_flat, codec, policy, encode, args, consts):
    out = fun_flat(*args, *consts)
    saved = tuple(codec.encode(x) if e else x for x, e in zip(args, encode))
    dtypes = tuple(jnp.result_type(x) for x in args)
    return out, (saved, consts, _Dtypes(dtypes))


class _Dtypes:
    """Input dtypes carried through the residuals as static data."""

    def __init__(self, dtypes):
        self.dtypes = dtypes


jax.tree_util.register_pytree_node(_Dtypes, lambda d: ((), d.dtypes),
                                   lambda aux, _: _Dtypes(aux))


def _ckpt_bwd(fun_flat, codec, policy, encode, res, cts):
    from .api import _vjp
    from .rules import PROMOTE

    saved, consts, dtypes = res
    args = [codec.decode(s, dt) if e else s for s, e, dt in zip(saved, encode, dtypes.dtypes)]
    n = len(args)
    _, vjp_fn = _vjp(lambda *a: fun_flat(*a), (*args, *consts), False, policy, PROMOTE)
    cts_in = vjp_fn(cts)
    cast = [lax.convert_element_type(c, jnp.result_type(x)) if _is_float(x) else c
            for c, x in zip(cts_in, (*args, *consts))]
    return tuple(cast[:n]), tuple(cast[n:])


_ckpt.defvjp(_ckpt_fwd, _ckpt_bwd)


def _flat_closure(fun: Callable, args: tuple, in_tree):
    box: list = []

    def fun_flat(*xs):
        out = fun(*tree_unflatten(in_tree, list(xs)))
        flat, tree = tree_flatten(out)
        box.append(tree)
        return [jnp.asarray(o) for o in flat]

    return fun_flat, box


def checkpoint(fun: Callable, *, codec, policy: Policy | None = None,
               tangent_dtype=None) -> Callable:
    """Like `jax.checkpoint`, but saves `fun`'s float array inputs encoded with `codec`.

    Args:
      fun: the function to checkpoint.
      codec: a codec or its name ("none", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
        "int2").
      policy: a `hifigrad.Policy` for the recomputed backward (float32 by default).
      tangent_dtype: shorthand for ``Policy(tangent_dtype=...)``.

    Returns:
      A function with `fun`'s signature. Its forward is `fun` unchanged.

    >>> import jax, jax.numpy as jnp, hifigrad as hg
    >>> f = hg.checkpoint(lambda x: jnp.tanh(x) * 2, codec="int8")
    >>> jax.grad(lambda x: f(x).sum())(jnp.ones(4)).dtype
    dtype('float32')
    """
    codec = get_codec(codec)
    policy = resolve_policy(policy, tangent_dtype)

    @functools.wraps(fun)
    def wrapped(*args):
        for x in jax.tree_util.tree_leaves(args, is_leaf=lambda v: isinstance(v, Encoded)):
            _check_encodable(x)
        flat, in_tree = tree_flatten(args)
        flat = [jnp.asarray(x) for x in flat]
        encode = [_is_float(x) for x in flat]
        return _run(fun, flat, in_tree, encode, codec, policy)

    return wrapped


def _run(fun, flat, in_tree, encode, codec, policy):
    fun_flat, box = _flat_closure(fun, flat, in_tree)
    converted, consts = jax.closure_convert(fun_flat, *flat)
    out = _encoded_call(converted, codec, policy, encode, flat, consts)
    return tree_unflatten(box[-1], list(out))


def scan(f: Callable, init, xs=None, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1, *, codec, policy: Policy | None = None,
         tangent_dtype=None):
    """`lax.scan` whose steps save their carry encoded with `codec` and are recomputed in the
    backward (in tangent precision).

    The per-step inputs `xs` (for example stacked layer parameters) are saved as they are; the
    carry (the activations passed between steps) is what gets compressed.

    >>> import jax, jax.numpy as jnp, hifigrad as hg
    >>> def body(c, w):
    ...     return jnp.tanh(c @ w), None
    >>> ws = jnp.ones((3, 4, 4)) * 0.1
    >>> loss = lambda ws: hg.scan(body, jnp.ones((2, 4)), ws, codec="fp8_e4m3")[0].sum()
    >>> jax.grad(loss)(ws).shape
    (3, 4, 4)
    """
    codec = get_codec(codec)
    policy = resolve_policy(policy, tangent_dtype)
    for x in jax.tree_util.tree_leaves(init, is_leaf=lambda v: isinstance(v, Encoded)):
        _check_encodable(x)

    def step(carry, x):
        args = (carry, x)
        flat, in_tree = tree_flatten(args)
        flat = [jnp.asarray(a) for a in flat]
        n_carry = len(tree_flatten(carry)[0])
        encode = [i < n_carry and _is_float(a) for i, a in enumerate(flat)]
        return _run(f, flat, in_tree, encode, codec, policy)

    return lax.scan(step, init, xs, length=length, reverse=reverse, unroll=unroll)
