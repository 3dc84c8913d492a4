"""Test configuration: strict dtype promotion and rank-promotion errors for every test.

Both are set with JAX's context managers around each test, so no global config is changed.
"""

import os

import jax
import pytest

# bf16 numerics on CPU depend on fusion unless excess precision is disabled; tests that
# compare bf16 values bit for bit rely on this. Set before any backend initialises.
if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    ).strip()


def pytest_runtest_setup(item):
    """`cpu_only` / `cuda_only` tests (tests/platforms.py) are skipped elsewhere, with their
    reason."""
    from platforms import on_cpu, on_cuda

    for name, here in (("cpu_only", on_cpu), ("cuda_only", on_cuda)):
        mark = item.get_closest_marker(name)
        if mark is not None and not here():
            reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
            where = "XLA:CPU" if name == "cpu_only" else "an NVIDIA GPU"
            pytest.skip(f"holds only on {where}: {reason}")


@pytest.fixture(autouse=True)
def _strict_numerics():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test case both without and with `jax.jit`."""
    if request.param:
        return jax.jit
    return lambda f: f
