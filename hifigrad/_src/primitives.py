"""hifigrad's own primitives, each with every rule it needs, declared where it is defined.

A primitive hifigrad binds can end up anywhere a JAX program goes: in a forward that is
linearized, in a backward that is transposed, vmapped, differentiated again, sliced along the
batch (`separable.py`) or promoted (`rules.py`). So each one is defined here with all of its
rules at once, as JAX's own `lax.py` fills every registry beside each `Primitive(...)`:

- evaluation: ``impl`` (eager), abstract evaluation, and the MLIR lowering;
- autodiff: the JVP rule, and the transpose rule where the primitive is linear;
- ``vmap``: the batching rule;
- the batch-slicing analysis (`separable.RULES`): how batched operands type its outputs, how a
  sum over the batch passes through it, and which params hold its output's shape;
- promotion (`rules.PROMOTE`): how it runs when a cotangent reaches it (`Declared.promote`,
  which `rules.py` reads when it builds the table).

`compat.new_primitive` is the one constructor: it records every primitive the package makes,
and tests/test_primitives.py checks each one against every registry above.

The primitives:

`upcast_p` converts a low-precision residual to the tangent dtype where a cotangent meets it. It
computes exactly what `convert_element_type` computes, but partial evaluation always stages it:
when JAX transposes the promoted linear program (and, inside a scan, splits its body), the cast
lands in the backward next to its consumer, and what is saved or stacked is the residual in its
own low-precision dtype. A plain convert would be hoisted into the forward sweep, and a scan would
stack a full float32 copy of every low-precision residual.

`coef_mul_p` multiplies a tangent by the derivative coefficient of an elementwise op, computed
from the op's saved primal values *at the tangent's dtype* (``Policy(coefficients='tangent')``,
`coefficients.py`): linear in the tangent, elementwise.

`pin_p` is the identity on values, materialized once: an `optimization_barrier`, so XLA cannot
fuse a copy of the computation that makes it into each consumer. A reduction that chooses
(`reduce_max`, `reduce_min`) has a JVP that compares its operand with its result
(``operand == max``: JAX's `_reduce_chooser_jvp_rule`); when XLA duplicates the operand's
elementwise producer into the reduction's fusion and into the comparison's, the two copies need
not be bitwise equal (XLA:CPU from jaxlib 0.12 on contracts multiply-adds differently in
differently vectorized fusions), the comparison finds no maximum, and the gradient through it
is silently dropped. `pinned_choosers` (`api.py`) pins the operand of every such reduction
whose result is differentiated: both then read one buffer. Its JVP leaves tangents alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from . import compat, separable

__all__ = ["Declared", "PRIMITIVES", "coef_mul_p", "pin", "pin_p", "upcast", "upcast_p"]


class Declared(NamedTuple):
    """What a hifigrad primitive declares about itself for the registries kept elsewhere.

    ``promote``: its promotion rule, by kind (``'rebind'``: `rules.promote_rule`, re-bound at
    promoted input dtypes: the primitive is polymorphic in dtype). ``linear``: the operands it
    is linear in (it has a transpose rule for them; empty when it is not linear)."""

    promote: str
    linear: tuple[int, ...]


# Every primitive defined here, with its declarations (tests check each against every registry).
PRIMITIVES: dict = {}


def _declare(p, *, promote: str, linear: tuple[int, ...], types, sum_rule=None, resize=None):
    separable.register([p], types, sum_rule, resize)
    PRIMITIVES[p] = Declared(promote, linear)


def _is_zero(t) -> bool:
    return type(t).__name__ == "Zero"


# ------------------------------------------------------------------------------ upcast

upcast_p = compat.new_primitive("hifigrad_upcast")


def _upcast_impl(x, *, new_dtype):
    return lax.convert_element_type(x, new_dtype)


def _upcast_abstract_eval(x, *, new_dtype):
    return x.update(dtype=np.dtype(new_dtype), weak_type=False)


def _upcast_jvp(primals, tangents, *, new_dtype):
    (x,), (t,) = primals, tangents
    # The primal is a plain convert: staging it would leave a linearized primal unknown (this
    # rule runs when a backward program that holds up-casts is itself differentiated).
    out = lax.convert_element_type(x, new_dtype)
    if _is_zero(t):
        return out, compat._ad.Zero(out.aval.to_tangent_aval())  # noqa: SLF001
    return out, upcast_p.bind(t, new_dtype=new_dtype)


def _upcast_transpose(ct, x, *, new_dtype):
    del new_dtype
    if _is_zero(ct):
        return [None]
    return [lax.convert_element_type(ct, x.aval.dtype)]


def _upcast_batch(args, dims, *, new_dtype):
    (x,), (d,) = args, dims
    return upcast_p.bind(x, new_dtype=new_dtype), d


compat.register_impl_and_lowering(upcast_p, _upcast_impl, _upcast_abstract_eval)
compat.register_jvp(upcast_p, _upcast_jvp)
compat.register_transpose(upcast_p, _upcast_transpose)
compat.register_batching(upcast_p, _upcast_batch)
compat.register_staged_partial_eval(upcast_p)
# Elementwise; a sum over the batch stays one (a cast between float dtypes).
_declare(upcast_p, promote="rebind", linear=(0,), types=separable.broadcasting_types,
         sum_rule=separable.linear_unary)


def upcast(x, dtype):
    """Casts `x` to `dtype` with a cast that is staged into the backward (see module doc)."""
    if np.dtype(x.dtype) == np.dtype(dtype):
        return x
    return upcast_p.bind(x, new_dtype=np.dtype(dtype))


# ------------------------------------------------------------------------------ coef_mul

# coefficient(kind)(*saved) -> d(primal op)/dx, evaluated at the tangent's dtype.
_COEF = {
    "tanh": lambda y: 1 - y * y,
    "logistic": lambda y: y * (1 - y),
    "exp": lambda y: y,
    "expm1": lambda y: y + 1,
    "log": lambda x: 1 / x,
    "log2": lambda x: 1 / (x * np.log(2)),  # a primitive of its own on jax >= 0.12
    "exp2": lambda y: y * np.log(2),
    "log1p": lambda x: 1 / (1 + x),
    "sin": lambda x: lax.cos(x),
    "cos": lambda x: -lax.sin(x),
    "sqrt": lambda y: 0.5 / y,
    "rsqrt": lambda x: -0.5 * lax.rsqrt(x) / x,
    "erf": lambda x: (2 / np.sqrt(np.pi)) * lax.exp(-x * x),
}


def coefficient(kind, *saved):
    """The derivative coefficient of the op `kind`, from its saved primal values."""
    if kind.startswith("integer_pow:"):
        n = int(kind.split(":")[1])
        (x,) = saved
        # As JAX's own rule: x**0 is constant, so its derivative is 0 everywhere (not
        # 0 * x**-1, which is 0 * inf = NaN at x = 0).
        if n == 0:
            return lax.full_like(x, 0)
        return n * lax.integer_pow(x, n - 1) if n != 1 else lax.full_like(x, 1)
    if kind == "div_rhs":
        x, y = saved
        return -x / (y * y)
    return _COEF[kind](*saved)


coef_mul_p = compat.new_primitive("hifigrad_coef_mul")


def _coef_mul_impl(t, *saved, kind):
    saved = [lax.convert_element_type(s, t.dtype) for s in saved]
    c = coefficient(kind, *saved)
    return t * lax.convert_element_type(c, t.dtype)


def _coef_mul_abstract(t, *saved, kind):
    del saved, kind
    return t.update(weak_type=False)


def _coef_mul_jvp(primals, tangents, *, kind):
    # jax.jvp wants primals and tangents as the same container type (JAX passes a tuple
    # and a list here).
    tangents = tuple(compat.instantiate_zeros(t) for t in tangents)
    return jax.jvp(lambda *a: _coef_mul_impl(*a, kind=kind), tuple(primals), tangents)


def _coef_mul_transpose(ct, t, *saved, kind):
    if _is_zero(ct):
        return [None] * (1 + len(saved))
    assert compat.is_undefined_primal(t) and not any(
        compat.is_undefined_primal(s) for s in saved)
    return [coef_mul_p.bind(ct, *saved, kind=kind)] + [None] * len(saved)


def _coef_mul_batch(args, dims, *, kind):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [jax.numpy.moveaxis(a, d, 0) if d is not None else
             jax.numpy.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)]
    return coef_mul_p.bind(*moved, kind=kind), 0


compat.register_impl_and_lowering(coef_mul_p, _coef_mul_impl, _coef_mul_abstract)
compat.register_jvp(coef_mul_p, _coef_mul_jvp)
compat.register_transpose(coef_mul_p, _coef_mul_transpose)
compat.register_batching(coef_mul_p, _coef_mul_batch)
# Elementwise in the tangent and the saved values (all of one shape); linear in the tangent
# alone: a sum over the batch times unbatched coefficients stays one.
_declare(coef_mul_p, promote="rebind", linear=(0,), types=separable.broadcasting_types,
         sum_rule=separable.linear_unary)


# ------------------------------------------------------------------------------ pin

pin_p = compat.new_primitive("hifigrad_pin")


def _pin_impl(x):
    return lax.optimization_barrier(x)


def _pin_abstract_eval(x):
    return x


def _pin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return pin_p.bind(x), t


def _pin_transpose(ct, x):
    del x
    return [None if _is_zero(ct) else ct]


def _pin_batch(args, dims):
    (x,), (d,) = args, dims
    return pin_p.bind(x), d


compat.register_impl_and_lowering(pin_p, _pin_impl, _pin_abstract_eval)
compat.register_jvp(pin_p, _pin_jvp)
compat.register_transpose(pin_p, _pin_transpose)
compat.register_batching(pin_p, _pin_batch)
_declare(pin_p, promote="rebind", linear=(0,), types=separable.broadcasting_types,
         sum_rule=separable.linear_unary)


def pin(x):
    """`x`, computed once: every consumer reads the same buffer (see module doc)."""
    return pin_p.bind(x)
