"""Which dtype a cotangent is held in."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

__all__ = ["promoted_dtype", "covers", "is_real_float", "check_primal_dtypes"]


def is_real_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@functools.cache
def covers(wide, narrow) -> bool:
    """True when every value of `narrow` is exactly representable in `wide` (both real floats)."""
    wide, narrow = np.dtype(wide), np.dtype(narrow)
    if wide == narrow:
        return True
    fw, fn = jnp.finfo(wide), jnp.finfo(narrow)
    return (fw.nmant >= fn.nmant and fw.maxexp >= fn.maxexp and fw.minexp <= fn.minexp)


@functools.cache
def promoted_dtype(dtype, tangent_dtype):
    """The dtype a cotangent of a `dtype` value is held in, for a given tangent dtype.

    Non-float dtypes (ints, bool, complex, float0) are unchanged. A real float at least as precise
    as `tangent_dtype` is unchanged; a less precise one (bf16, fp16, fp8 under float32) becomes
    the narrowest of (tangent_dtype, float32, float64) that holds both exactly.
    """
    dtype = np.dtype(dtype)
    if not is_real_float(dtype) or covers(dtype, tangent_dtype):
        return dtype
    for cand in (np.dtype(tangent_dtype), np.dtype(jnp.float32), np.dtype(jnp.float64)):
        if covers(cand, dtype) and covers(cand, tangent_dtype):
            return cand
    return np.dtype(jnp.float64)  # pragma: no cover


def check_primal_dtypes(dtypes, tangent_dtype) -> None:
    """Raises ValueError if `tangent_dtype` is less precise than a floating primal's dtype."""
    for d in dtypes:
        d = np.dtype(d)
        if is_real_float(d) and not covers(tangent_dtype, d):
            raise ValueError(
                f"tangent_dtype {np.dtype(tangent_dtype)} is less precise than a primal of dtype "
                f"{d}: hifigrad holds cotangents in a dtype at least as precise as the primals. "
                f"Pass tangent_dtype={d} or wider (for example jnp.float32 for bf16/fp16/fp8 "
                f"primals, jnp.float64 for float64 primals).")
