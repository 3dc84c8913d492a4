import jax.numpy as jnp
import numpy as np
import pytest

import hifigrad as hg
from hifigrad._src.policy import resolve_policy


def test_defaults_and_frozen():
    p = hg.Policy()
    assert p.tangent_dtype == np.dtype(jnp.float32) and p.matmul == "exact"
    assert p.unsupported == "fallback" and p.coefficients == "forward"
    with pytest.raises(AttributeError):
        p.matmul = "fast"  # type: ignore[misc]


@pytest.mark.parametrize("field,value", [("matmul", "tf32"), ("unsupported", "ignore"),
                                         ("coefficients", "exact")])
def test_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        hg.Policy(**{field: value})


def test_bad_tangent_dtype():
    with pytest.raises(ValueError, match="real floating"):
        hg.Policy(tangent_dtype=jnp.int8)
    with pytest.raises(ValueError, match="real floating"):
        hg.Policy(tangent_dtype="not a dtype")


def test_resolve_policy():
    assert resolve_policy(None, None) == hg.Policy()
    assert resolve_policy(None, jnp.float64).tangent_dtype == np.dtype(jnp.float64)
    with pytest.raises(TypeError, match="hifigrad.Policy"):
        resolve_policy({"matmul": "fast"})
