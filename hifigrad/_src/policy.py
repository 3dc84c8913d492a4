"""`Policy`: how hifigrad runs a backward pass."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

__all__ = ["Policy", "resolve_policy"]

_MATMUL = ("exact", "fast")
_UNSUPPORTED = ("fallback", "error")
_COEFFICIENTS = ("forward", "tangent")


@dataclasses.dataclass(frozen=True)
class Policy:
    """How hifigrad runs a backward pass.

    Attributes:
      tangent_dtype: the dtype every cotangent-derived value is held in when the primal is less
        precise (default float32).
      matmul: ``'exact'`` runs backward `dot_general`/`conv` in ``tangent_dtype`` (residual
        operands up-cast); ``'fast'`` keeps low-precision operands (the cotangent rounded to the
        residual's dtype) and accumulates in ``tangent_dtype`` via ``preferred_element_type``: the
        tensor-core path on GPUs.
      unsupported: what to do with a cotangent-carrying primitive that cannot run promoted (no
        rule names it and the evidence that re-binding it at promoted dtypes is exact is
        missing; see `hifigrad._src.rules`): ``'fallback'`` (default) runs it at its own dtype
        with casts at its edges and warns once per primitive
        (`hifigrad.PrecisionFallbackWarning`); ``'error'`` raises `UnsupportedPrimitiveError`
        naming the primitive, for users who want every low-precision path to stop them.
      coefficients: ``'forward'`` uses derivative coefficients as JAX computes them in the forward
        (for example ``1 - tanh(x)**2`` saved in bf16); ``'tangent'`` recomputes the coefficients
        of elementwise transcendental ops in ``tangent_dtype`` in the backward, from the saved
        primal values. The forward's values are unchanged either way.
    """

    tangent_dtype: Any = jnp.float32
    matmul: Literal["exact", "fast"] = "exact"
    unsupported: Literal["fallback", "error"] = "fallback"
    coefficients: Literal["forward", "tangent"] = "forward"

    def __post_init__(self):
        try:
            dt = np.dtype(self.tangent_dtype)
        except TypeError as e:
            raise ValueError(
                f"tangent_dtype must be a real floating dtype such as jnp.float32; got "
                f"{self.tangent_dtype!r}") from e
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"tangent_dtype must be a real floating dtype such as jnp.float32; got {dt}. "
                f"Cotangents are held in this dtype, so it cannot be integer, bool or complex.")
        object.__setattr__(self, "tangent_dtype", dt)
        for name, value, allowed in (("matmul", self.matmul, _MATMUL),
                                     ("unsupported", self.unsupported, _UNSUPPORTED),
                                     ("coefficients", self.coefficients, _COEFFICIENTS)):
            if value not in allowed:
                raise ValueError(f"Policy.{name} must be one of {allowed}; got {value!r}.")


def resolve_policy(policy: Policy | None, tangent_dtype: Any = None) -> Policy:
    """Combines the ``policy`` and ``tangent_dtype`` arguments of the public API."""
    if policy is None:
        return Policy() if tangent_dtype is None else Policy(tangent_dtype=tangent_dtype)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a hifigrad.Policy; got {type(policy).__name__}.")
    if tangent_dtype is not None and np.dtype(tangent_dtype) != policy.tangent_dtype:
        raise ValueError(
            f"tangent_dtype={np.dtype(tangent_dtype)} conflicts with "
            f"policy.tangent_dtype={policy.tangent_dtype}; pass one of them.")
    return policy
