"""Which dtype a cotangent is held in."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["promoted_dtype", "covers", "is_real_float", "is_extended", "check_primal_dtypes",
           "check_tangent_dtype_enabled"]


def is_extended(dtype) -> bool:
    """True for JAX's extended dtypes (typed PRNG keys): they have no NumPy dtype, are never
    differentiated and never promoted."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def is_real_float(dtype) -> bool:
    return not is_extended(dtype) and jnp.issubdtype(dtype, jnp.floating)


@functools.cache
def covers(wide, narrow) -> bool:
    """True when every value of `narrow` is exactly representable in `wide` (both real floats)."""
    wide, narrow = np.dtype(wide), np.dtype(narrow)
    if wide == narrow:
        return True
    fw, fn = jnp.finfo(wide), jnp.finfo(narrow)
    if fw.nmant < fn.nmant or fw.maxexp < fn.maxexp:
        return False
    # Every `narrow` value is a multiple of its smallest positive value; `wide` holds it exactly
    # when its own smallest step (a subnormal) divides it: float8_e8m0fnu's 2**-127 is a float32
    # subnormal, so float32 covers e8m0 although e8m0's normal range starts below float32's.
    return fw.minexp <= fn.minexp or float(fw.smallest_subnormal) <= float(fn.smallest_subnormal)


@functools.cache
def promoted_dtype(dtype, tangent_dtype):
    """The dtype a cotangent of a `dtype` value is held in, for a given tangent dtype.

    Non-float dtypes (ints, bool, complex, float0) are unchanged. A real float at least as precise
    as `tangent_dtype` is unchanged; a less precise one (bf16, fp16, fp8 under float32) becomes
    the narrowest of (tangent_dtype, float32, float64) that holds both exactly.
    """
    if is_extended(dtype):
        return dtype
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
        if is_extended(d):
            continue
        d = np.dtype(d)
        if is_real_float(d) and not covers(tangent_dtype, d):
            raise ValueError(
                f"tangent_dtype {np.dtype(tangent_dtype)} is less precise than a primal of dtype "
                f"{d}: hifigrad holds cotangents in a dtype at least as precise as the primals. "
                f"Pass tangent_dtype={d} or wider (for example jnp.float32 for bf16/fp16/fp8 "
                f"primals, jnp.float64 for float64 primals).")


def check_tangent_dtype_enabled(tangent_dtype) -> None:
    """Raises ValueError if JAX cannot make arrays of `tangent_dtype` here (float64 with 64-bit
    mode off): JAX would silently truncate every cotangent to float32."""
    dt = np.dtype(tangent_dtype)
    if np.dtype(jax.dtypes.canonicalize_dtype(dt)) != dt:
        raise ValueError(
            f"tangent_dtype {dt} needs JAX's 64-bit mode, which is off: JAX would truncate "
            f"every {dt} cotangent to {np.dtype(jax.dtypes.canonicalize_dtype(dt))}. Enable it "
            f"(`jax.config.update('jax_enable_x64', True)` at startup, or run the call inside "
            f"`with jax.enable_x64(True):`), or use tangent_dtype=jnp.float32.")
