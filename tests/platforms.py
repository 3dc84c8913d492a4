"""What the suite knows about the platform it runs on: the one place for it.

Named `platforms` (not `platform`): tests/ is on `sys.path`, and a `platform.py` there would
shadow the standard library module that JAX and NumPy import.

* `on_cpu()`, `on_cuda()`, `on_tpu()`: the backend the tests run on (`jax.default_backend()`).
* `cpu_only(reason)`: a marker (``pytest.mark.cpu_only``, registered in pyproject.toml) for a
  test whose claim holds only on XLA:CPU; `conftest.py` skips it elsewhere, with the reason. Each
  module that uses it lists its cases, with the reason, in one table in its docstring.
* `cuda_only(reason)`: the converse, for tests of NVIDIA-only kernels (cuDNN).
* `tpu_only(reason)`: likewise for tests that need a TPU (Pallas TPU kernels).
* `matmul_rtol(dtype, precision=None)`: the relative rounding of one float32 matmul's operands.

Why claims differ between XLA:CPU and an NVIDIA GPU:

* **TF32.** On NVIDIA GPUs (Ampere and later) a float32 `dot_general` / `conv` at JAX's default
  precision runs on TF32 tensor cores: each operand is rounded to 10 explicit mantissa bits
  (relative error up to 2**-11, spacing 2**-10) and the products are accumulated in float32.
  XLA:CPU multiplies float32 exactly at every precision. So a claim "this float32 backward is
  within k * eps(float32) of a float64 reference" holds on CPU; on a GPU it holds only at
  ``precision='highest'`` (`highest_precision()`, a context manager for the test), otherwise the
  tolerance is `matmul_rtol(float32)`, TF32's 2**-10, times the same k.
* **bf16 passes on a TPU.** On a TPU a float32 `dot_general` / `conv` at JAX's default precision
  is one pass of the MXU on operands rounded to bfloat16 (8 significant bits: relative error up
  to 2**-8, spacing 2**-7), with float32 accumulation; 'high' is three such passes, 'highest'
  six (float32-like). So there too a float32-vs-float64 claim holds at ``precision='highest'``
  (`highest_precision()`), otherwise with `matmul_rtol(float32)` = bfloat16's eps 2**-7. A TPU
  also evaluates float32 transcendentals (exp, log, tanh, erf) and divisions to a few ulps
  rather than XLA:CPU's correctly rounded-or-nearly results.
* **Excess precision.** `conftest.py` sets ``--xla_allow_excess_precision=false``, which XLA:CPU
  honours: every bf16/fp16 op rounds its result, so two differently fused programs give bitwise
  the same low-precision values. XLA:GPU may keep an f32 intermediate inside a fusion regardless,
  so bitwise equality of bf16/fp16 values between two different programs is a CPU-only claim
  (found on CPU by running with ``XLA_FLAGS=--xla_allow_excess_precision=true``).
* **`lax.platform_dependent`.** hifigrad's ``Policy(matmul='fast')`` multiplies the rounded
  operands in float32 on CPU and as bf16/fp16 operands with f32 accumulation elsewhere (`fast.py`):
  the same products, but a GPU's low-precision dot may accumulate in another order (and in
  blocks), so only the rounding of the operands (one eps of the low dtype) is common to both.
* **Memory figures.** `memory_analysis()` reports what XLA:CPU allocates (it converts bf16 for
  most ops); another backend's temp buffers differ, so exact byte counts are CPU facts.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

__all__ = ["BF16_PASS_EPS", "TF32_EPS", "cpu_only", "cuda_only", "highest_precision",
           "matmul_rtol", "on_cpu", "on_cuda", "on_tpu", "tpu_only"]

# TF32: 10 explicit mantissa bits, so the spacing of values in [1, 2) is 2**-10.
TF32_EPS = 2.0 ** -10
# A TPU's default float32 matmul: one MXU pass on bfloat16-rounded operands (7 explicit bits).
BF16_PASS_EPS = 2.0 ** -7


@functools.cache
def _backend() -> str:
    return jax.default_backend()


def on_cpu() -> bool:
    """True when the tests run on XLA:CPU."""
    return _backend() == "cpu"


@functools.cache
def on_cuda() -> bool:
    """True when the tests run on an NVIDIA GPU (CUDA)."""
    if _backend() != "gpu":
        return False
    return "cuda" in jax.devices()[0].client.platform_version.lower()


def on_tpu() -> bool:
    """True when the tests run on a TPU."""
    return _backend() == "tpu"


def cpu_only(reason: str):
    """Marks a test whose claim holds only on XLA:CPU (`reason` says why); skipped elsewhere."""
    return pytest.mark.cpu_only(reason=reason)


def cuda_only(reason: str):
    """Marks a test that needs an NVIDIA GPU (`reason` says why); skipped elsewhere."""
    return pytest.mark.cuda_only(reason=reason)


def tpu_only(reason: str):
    """Marks a test that needs a TPU (`reason` says why); skipped elsewhere."""
    return pytest.mark.tpu_only(reason=reason)


def matmul_rtol(dtype=np.float32, precision=None) -> float:
    """The relative rounding of one matmul's operands at `dtype` and `precision`.

    float32 at JAX's default precision (``precision`` None or 'default'/'high', or
    `jax.default_matmul_precision` unset) is TF32 on NVIDIA GPUs: 2**-10 (TF32's eps, the spacing
    at 1; twice its unit roundoff, as float32's eps is twice 2**-24); on a TPU, at the default
    and at 'high' precision, bfloat16's eps 2**-7 (one or three bf16 passes: bounded by the
    one-pass rounding). On CPU, and at 'highest', it is float32's eps. Other dtypes: their own
    eps (bf16/fp16 operands are not rounded further).
    """
    dt = np.dtype(dtype)
    eps = float(np.finfo(dt).eps) if dt.kind == "f" else float(jax.numpy.finfo(dt).eps)
    if dt != np.float32 or on_cpu():
        return eps
    prec = precision if precision is not None else jax.config.jax_default_matmul_precision
    if prec is not None and str(prec).lower() in ("highest", "float32", "precision.highest"):
        return eps
    return max(eps, BF16_PASS_EPS if on_tpu() else TF32_EPS)


def highest_precision():
    """`jax.default_matmul_precision('highest')` as a context manager for one test: float32
    matmuls multiply in float32 on every platform (no TF32, no single bf16 pass on a TPU), as
    they do on CPU at any precision.
    On CPU it changes nothing, so a test inside it proves there what it proved before."""
    return jax.default_matmul_precision("highest")
