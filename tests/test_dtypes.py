import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hifigrad._src.dtypes import (
    check_primal_dtypes,
    check_tangent_dtype_enabled,
    covers,
    is_extended,
    is_real_float,
    promoted_dtype,
)

F32, F64 = np.dtype(jnp.float32), np.dtype(jnp.float64)


@pytest.mark.parametrize("dtype,want", [
    (jnp.bfloat16, F32), (jnp.float16, F32), (jnp.float8_e4m3fn, F32), (jnp.float8_e5m2, F32),
    (jnp.float32, F32), (jnp.float64, F64), (jnp.int32, np.dtype(jnp.int32)),
    (jnp.bool_, np.dtype(bool)), (jnp.complex64, np.dtype(jnp.complex64)),
])
def test_promoted_dtype_under_f32(dtype, want):
    assert promoted_dtype(np.dtype(dtype), F32) == want


def test_promoted_dtype_under_f16_tangent():
    # bf16 and f16 do not cover each other: the narrowest float holding both is f32.
    assert promoted_dtype(np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) == F32
    assert promoted_dtype(np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float16)) == np.dtype(
        jnp.float16)


def test_covers():
    assert covers(F32, np.dtype(jnp.bfloat16)) and not covers(np.dtype(jnp.bfloat16), F32)
    assert not covers(np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def test_check_primal_dtypes_names_both():
    with pytest.raises(ValueError, match="float16.*bfloat16"):
        check_primal_dtypes([np.dtype(jnp.bfloat16)], np.dtype(jnp.float16))
    check_primal_dtypes([np.dtype(jnp.int32), np.dtype(jnp.bfloat16)], F32)


def test_typed_key_dtypes_are_never_promoted_or_checked():
    key_dtype = jax.random.key(0).dtype
    assert promoted_dtype(key_dtype, F32) == key_dtype
    check_primal_dtypes([key_dtype, np.dtype(jnp.bfloat16)], F32)  # no error
    assert not is_real_float(key_dtype) and is_extended(key_dtype)
    assert not is_extended(jax.dtypes.float0) and not is_real_float(jax.dtypes.float0)


def test_float32_covers_e8m0_through_its_subnormals():
    """float8_e8m0fnu holds 2**-127 .. 2**127: below float32's normal range, but a float32
    subnormal, so every e8m0 value is exact in float32 (and in bfloat16), not in float16."""
    e8m0 = np.dtype(jnp.float8_e8m0fnu)
    assert covers(F32, e8m0) and covers(np.dtype(jnp.bfloat16), e8m0)
    assert not covers(np.dtype(jnp.float16), e8m0)
    vals = np.array([2.0 ** -127, 2.0 ** -100, 1.0, 2.0 ** 127], np.float64).astype(e8m0)
    np.testing.assert_array_equal(vals.astype(np.float32).astype(np.float64),
                                  vals.astype(np.float64))
    assert promoted_dtype(e8m0, F32) == F32
    check_primal_dtypes([e8m0], F32)  # no error (it named float32 while rejecting it)
    for d in (jnp.float8_e3m4, jnp.float8_e4m3, jnp.float4_e2m1fn):
        assert covers(F32, np.dtype(d)) and promoted_dtype(np.dtype(d), F32) == F32


def test_float64_tangent_dtype_needs_x64():
    with pytest.raises(ValueError, match="64-bit mode.*enable_x64"):
        check_tangent_dtype_enabled(F64)
    with jax.enable_x64(True):
        check_tangent_dtype_enabled(F64)
    check_tangent_dtype_enabled(F32)
