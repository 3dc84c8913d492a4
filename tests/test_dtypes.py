import jax.numpy as jnp
import numpy as np
import pytest

from hifigrad._src.dtypes import check_primal_dtypes, covers, promoted_dtype

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
