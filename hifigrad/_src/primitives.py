"""hifigrad's own primitives.

`upcast_p` converts a low-precision residual to the tangent dtype where a cotangent meets it. It
computes exactly what `convert_element_type` computes, but partial evaluation always stages it:
when JAX transposes the promoted linear program (and, inside a scan, splits its body), the cast
lands in the backward next to its consumer, and what is saved or stacked is the residual in its
own low-precision dtype. A plain convert would be hoisted into the forward sweep, and a scan would
stack a full float32 copy of every low-precision residual.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from . import compat

__all__ = ["upcast", "upcast_p"]

upcast_p = compat.new_primitive("hifigrad_upcast")


def _upcast_impl(x, *, new_dtype):
    return lax.convert_element_type(x, new_dtype)


def _upcast_abstract_eval(x, *, new_dtype):
    return x.update(dtype=np.dtype(new_dtype), weak_type=False)


compat.register_impl_and_lowering(upcast_p, _upcast_impl, _upcast_abstract_eval)


def _upcast_jvp(primals, tangents, *, new_dtype):
    (x,), (t,) = primals, tangents
    # The primal is a plain convert: staging it would leave a linearized primal unknown (this
    # rule runs when a backward program that holds up-casts is itself differentiated).
    out = lax.convert_element_type(x, new_dtype)
    if type(t).__name__ == "Zero":
        return out, compat._ad.Zero(out.aval.to_tangent_aval())  # noqa: SLF001
    return out, upcast_p.bind(t, new_dtype=new_dtype)


def _upcast_transpose(ct, x, *, new_dtype):
    del new_dtype
    if type(ct).__name__ == "Zero":
        return [None]
    return [lax.convert_element_type(ct, x.aval.dtype)]


def _upcast_batch(args, dims, *, new_dtype):
    (x,), (d,) = args, dims
    return upcast_p.bind(x, new_dtype=new_dtype), d


compat.register_jvp(upcast_p, _upcast_jvp)
compat.register_transpose(upcast_p, _upcast_transpose)
compat.register_batching(upcast_p, _upcast_batch)
compat.register_staged_partial_eval(upcast_p)


def upcast(x, dtype):
    """Casts `x` to `dtype` with a cast that is staged into the backward (see module doc)."""
    if np.dtype(x.dtype) == np.dtype(dtype):
        return x
    return upcast_p.bind(x, new_dtype=np.dtype(dtype))
