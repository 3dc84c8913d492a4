"""`Policy`: how hifigrad runs a backward pass."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["PLATFORM_ENV", "Policy", "auto_choices", "current_platform", "resolve_policy"]

_MATMUL = ("auto", "exact", "fast")
_PRECISION = (None, "default", "high", "highest")
# What `matmul='auto'` resolves to on each platform, by measurement (README, "Choosing a policy"):
# on CPU, 'exact' is as fast as 'fast' (XLA:CPU has no low-precision matmul units; 268.7 vs
# 269.9 ms per step, benchmarks/results/core_cpu.md) and 0.2 dB more precise; on a GPU, 'fast'
# costs 1.025x bf16 jax.grad's step and 'exact' 1.29x (H200, jax 0.11.2), for 0.4 dB.
_AUTO_MATMUL = {"cpu": "exact"}
_AUTO_MATMUL_DEFAULT = "fast"
_UNSUPPORTED = ("fallback", "error")
_COEFFICIENTS = ("auto", "forward", "tangent")
# What `coefficients='auto'` resolves to on each platform, by measurement: on a TPU v5e,
# 'tangent' ran a bf16 GPT's hg.grad step (12 blocks, d=1024, 8 x 512 tokens) in 1.018x bf16
# jax.grad's time against 'forward''s 1.054x, in 5698 MiB of temp against 6442 MiB
# (benchmarks/results/tpu_v5e.md). Elsewhere 'forward', as before.
_AUTO_COEFFICIENTS = {"tpu": "tangent"}
# How `compress_checkpoints` runs a scan over a transposed stack of weights (`nnx.scan` with
# ``in_axes=1``, MaxText's ``param_scan_axis=1``), by measurement: 'slices' reads each step's
# slice from the untransposed array (no transposed copy); 'as written' scans the transposed
# stack. XLA:CPU copies a transposed loop operand into the default layout: on real MaxText
# (llama2, 8 layers) the copies and their gradients' stacks were 32 MiB of the 71.0 MiB step,
# which 'slices' takes to 39.0 (MaxText's own bf16 step: 85.2). A TPU's layout assignment
# makes no copy (the bf16 step over a stack on axis 1 peaked lower than on axis 0), and there
# 'slices' peaked 3 MiB higher than 'as written' on a 3 x 8 MiB MLP (tpu v5e, jax 0.10.2).
# Not measured on a GPU: 'slices', XLA:GPU's default layouts being XLA:CPU's.
_AUTO_STACKS = {"tpu": "as written"}

# The platform whose choices 'auto' makes: `jax.default_backend()`, unless this environment
# variable names another (``cpu``, ``gpu`` or ``tpu``), so that a CPU runs a TPU's or a GPU's
# choices (tests, CI's lane of the TPU's choices). Only the policy's choices follow it: what
# XLA compiles for the device itself (`lax.platform_dependent` branches) is the real one's.
PLATFORM_ENV = "HIFIGRAD_PLATFORM"
PLATFORMS = ("cpu", "gpu", "tpu")


def current_platform() -> str:
    """The platform 'auto' resolves for: ``HIFIGRAD_PLATFORM`` when set, else
    `jax.default_backend()` (read at each call, so when the backward is traced).

    Raises:
      ValueError: ``HIFIGRAD_PLATFORM`` names no platform hifigrad knows.
    """
    env = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if env:
        if env not in PLATFORMS:
            raise ValueError(f"{PLATFORM_ENV}={env!r} is not a platform hifigrad makes choices "
                             f"for; use one of {PLATFORMS}, or unset it to use JAX's default "
                             f"backend ({jax.default_backend()}).")
        return env
    return jax.default_backend()


def auto_choices(platform: str) -> dict[str, str]:
    """What each ``'auto'`` field of `Policy` means on `platform` (``'cpu'``, ``'gpu'``,
    ``'tpu'``): the one place a default depends on the backend.

    ``'stacks'`` is not a `Policy` field: it is how `compress_checkpoints` runs a scan over a
    transposed stack of weights (``'slices'``: each step's slice read from the untransposed
    array; ``'as written'``).

    >>> from hifigrad._src.policy import auto_choices
    >>> auto_choices("tpu")
    {'matmul': 'fast', 'coefficients': 'tangent', 'stacks': 'as written'}
    """
    return {"matmul": _AUTO_MATMUL.get(platform, _AUTO_MATMUL_DEFAULT),
            "coefficients": _AUTO_COEFFICIENTS.get(platform, "forward"),
            "stacks": _AUTO_STACKS.get(platform, "slices")}


@dataclasses.dataclass(frozen=True)
class Policy:
    """How hifigrad runs a backward pass.

    Attributes:
      tangent_dtype: the dtype every cotangent-derived value is held in when the primal is less
        precise (default float32).
      matmul: how backward `dot_general` / `conv_general_dilated` ops multiply.
        ``'exact'`` runs them in ``tangent_dtype`` (residual operands up-cast): float32 x
        float32. ``'fast'`` keeps low-precision operands (the cotangent rounded to the residual's
        dtype) and accumulates in ``tangent_dtype`` via ``preferred_element_type``: the
        tensor-core path on GPUs. ``'auto'`` (default) is ``'exact'`` on CPU; on every other
        platform it is ``'fast'`` for matmuls whose low-precision operand is bfloat16 and
        ``'exact'`` for fp16 / fp8 ones (rounding a cotangent to those would flush small values
        to zero: their exponent range is float32's no more). Chosen by measurement: on CPU both
        modes run at the same speed and exact is more precise; on an NVIDIA H200 fast ran a
        bf16 model's step in 1.025x bf16 `jax.grad`'s time against exact's 1.29x, 0.4 dB of
        gradient SQNR apart. The platform is read when the backward is traced, from
        `jax.default_backend()` or the ``HIFIGRAD_PLATFORM`` environment variable
        (`Policy.resolved_matmul`). On a TPU, a float32 matmul at
        JAX's default precision is itself one bf16 pass: there 'exact' and 'fast' compute
        the same products ('fast' without float32 copies of the residuals), and only
        ``matmul_precision='highest'`` multiplies in float32.
      matmul_precision: the `lax.Precision` of the backward's float32 matmuls (``'exact'`` mode,
        and everything ``'auto'`` runs exact). ``None`` (default) keeps each op's own precision,
        so `jax.default_matmul_precision` applies as it does to `jax.grad`. On NVIDIA GPUs JAX's
        default precision runs a float32 matmul on TF32 tensor cores (10 mantissa bits), so
        "exact" there means float32 operands multiplied in TF32 unless this is ``'highest'``.
        ``'highest'`` makes them true float32 multiplies (slower on GPUs: an f32 model's step
        took 2.5x as long at 'highest' on an H200); ``'default'`` / ``'high'`` as in
        `lax.Precision`.
      unsupported: what to do with a cotangent-carrying primitive that cannot run promoted (no
        rule names it and the evidence that re-binding it at promoted dtypes is exact is
        missing; see `hifigrad._src.rules`): ``'fallback'`` (default) runs it at its own dtype
        with casts at its edges and warns once per primitive and differentiated function
        (`hifigrad.PrecisionFallbackWarning`); ``'error'`` raises `UnsupportedPrimitiveError`
        naming the primitive, for users who want every low-precision path to stop them.
      coefficients: ``'forward'`` uses derivative coefficients as JAX computes them in the forward
        (for example ``1 - tanh(x)**2`` saved in bf16); ``'tangent'`` recomputes the coefficients
        of elementwise transcendental ops in ``tangent_dtype`` in the backward, from the saved
        primal values (the function is traced abstractly for that, so Python control flow on
        array values is not possible). The forward's values are unchanged either way.
        ``'auto'`` (default) is ``'tangent'`` on a TPU, where it ran a bf16 GPT's step faster
        and in less memory (1.018x bf16 `jax.grad`'s time against 1.054x), falling back to
        ``'forward'`` for a function that cannot be traced abstractly; ``'forward'`` elsewhere
        (`Policy.resolved_coefficients`).
      check_slices: also run every checkpoint backward that runs in batch slices
        (``backward_slices``) at once, on the same inputs, and raise
        `hifigrad.SliceCheckError` naming the checkpoint's source line if the two differ
        beyond float rounding (`checkpoint.slice_tolerance`). It costs the unsliced backward
        (its time and memory) on top: turn it on for a step or two of a new model. The
        environment variable ``HIFIGRAD_CHECK_SLICES=1`` turns it on everywhere.

    Raises:
      ValueError: ``tangent_dtype`` is not a real floating dtype; a field has a value outside
        the ones listed above.

    Examples:
      >>> import jax.numpy as jnp, hifigrad as hg
      >>> policy = hg.Policy(matmul="exact", coefficients="tangent")
      >>> hg.grad(lambda w: jnp.sum(jnp.tanh(w)), policy=policy)(jnp.zeros(2, jnp.bfloat16))
      Array([1., 1.], dtype=float32)
      >>> hg.Policy().matmul, hg.Policy().resolved_matmul("cpu")
      ('auto', 'exact')
    """

    tangent_dtype: Any = jnp.float32
    matmul: Literal["auto", "exact", "fast"] = "auto"
    unsupported: Literal["fallback", "error"] = "fallback"
    coefficients: Literal["auto", "forward", "tangent"] = "auto"
    matmul_precision: Literal["default", "high", "highest"] | None = None
    check_slices: bool = False

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
        if not isinstance(self.check_slices, bool):
            raise ValueError(f"Policy.check_slices must be True or False; got "
                             f"{self.check_slices!r}.")
        prec = self.matmul_precision
        if isinstance(prec, lax.Precision):
            prec = prec.name.lower()
            object.__setattr__(self, "matmul_precision", prec)
        if prec not in _PRECISION:
            raise ValueError(
                f"Policy.matmul_precision must be one of {_PRECISION} or a jax.lax.Precision; "
                f"got {prec!r}.")

    def resolved_matmul(self, platform: str | None = None) -> str:
        """The matmul mode the backward runs: ``'exact'`` or ``'fast'``.

        ``'auto'`` resolves by platform (``platform``, default `current_platform`:
        ``HIFIGRAD_PLATFORM`` or `jax.default_backend()`): ``'exact'`` on CPU, ``'fast'``
        elsewhere (where it rewrites only the matmuls on bfloat16 operands; fp16 / fp8 ones
        stay exact).

        >>> import hifigrad as hg
        >>> hg.Policy().resolved_matmul("cpu"), hg.Policy().resolved_matmul("gpu")
        ('exact', 'fast')
        """
        if self.matmul != "auto":
            return self.matmul
        return auto_choices(current_platform() if platform is None else platform)["matmul"]

    def resolved_coefficients(self, platform: str | None = None) -> str:
        """Where the backward's derivative coefficients come from: ``'forward'`` or
        ``'tangent'``. ``'auto'`` resolves by platform (``platform``, default `current_platform`:
        ``HIFIGRAD_PLATFORM`` or `jax.default_backend()`): ``'tangent'`` on a TPU, ``'forward'``
        elsewhere.

        >>> import hifigrad as hg
        >>> hg.Policy().resolved_coefficients("cpu"), hg.Policy().resolved_coefficients("tpu")
        ('forward', 'tangent')
        """
        if self.coefficients != "auto":
            return self.coefficients
        return auto_choices(current_platform() if platform is None else platform)[
            "coefficients"]

    def lax_precision(self) -> lax.Precision | None:
        """`matmul_precision` as a `lax.Precision` (None when each op keeps its own)."""
        if self.matmul_precision is None:
            return None
        return lax.Precision[self.matmul_precision.upper()]


class _Inherited(Policy):
    """The policy of a checkpoint made without one (`INHERIT`): its backward runs under the
    policy of the hifigrad transform that differentiates it (`hg.grad(..., policy=...)`, a
    `precise_backward`), else the default one. A `Policy` whose fields are the defaults, of
    its own class (so it never equals an explicit ``Policy()`` in a cache key)."""


INHERIT = _Inherited()
# The policy of the hifigrad transform tracing now (`active_policy`), for `effective_policy`.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hifigrad_active_policy", default=None)


@contextlib.contextmanager
def active_policy(policy: Policy):
    """Within: `effective_policy(INHERIT)` is `policy` (hifigrad's transforms set it while they
    trace the function and its backward)."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def effective_policy(policy: Policy) -> Policy:
    """`policy`, or for `INHERIT` the active transform's policy (`active_policy`), else the
    default `Policy()`."""
    if policy is not INHERIT:
        return policy
    active = _ACTIVE.get()
    return Policy() if active is None or active is INHERIT else active


def resolve_checkpoint_policy(policy: Policy | None, tangent_dtype: Any = None) -> Policy:
    """`resolve_policy` for a checkpoint: with neither argument given, `INHERIT` (its backward
    runs under the enclosing hifigrad transform's policy: ``hg.grad(f, policy=Policy(
    matmul='fast'))`` reaches the checkpoints in ``f``)."""
    if policy is None and tangent_dtype is None:
        return INHERIT
    return resolve_policy(policy, tangent_dtype)


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
