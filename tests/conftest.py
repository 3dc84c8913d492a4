"""Test configuration: strict dtype promotion and rank-promotion errors for every test.

Both are set with JAX's context managers around each test, so no global config is changed.
"""

import os

import jax
import pytest
from lanes import in_turn

# bf16 numerics on CPU depend on fusion unless excess precision is disabled; tests that
# compare bf16 values bit for bit rely on this. Set before any backend initialises.
if "--xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    ).strip()


@pytest.fixture(scope="session", autouse=True)
def _children_off_the_tpu():
    """On a TPU the suite's own subprocesses (the demo, examples/, fresh-interpreter checks) run
    on the CPU: one program at a time can hold a TPU chip, and this one already does (a second
    stops with libtpu's "multi-process lockfile" error). JAX read JAX_PLATFORMS when it was
    imported above, so this changes only the children's platform. (A fixture, not
    pytest_configure: an xdist controller runs no tests and must not open a device.)"""
    if os.environ.get("JAX_PLATFORMS", "") == "" and jax.default_backend() == "tpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        # JAX's start-up advice about the host's kernel (jax/_src/cloud_tpu_init.py), which a
        # TPU host's children print to the stderr some tests compare: not about this code.
        ignore = "ignore:Transparent hugepages are not enabled:UserWarning"
        os.environ["PYTHONWARNINGS"] = ",".join(
            w for w in (os.environ.get("PYTHONWARNINGS", ""), ignore) if w)
    yield


def _chunk(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"HIFIGRAD_TEST_CHUNK must be i/n with 1 <= i <= n, got {spec!r}")
    return i, n


def _is_eager(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and (callspec.params.get("maybe_jit") is False
                                     or callspec.params.get("jit") is False)


# Modules whose eager cases (`maybe_jit`'s eager variant, or a ``jit=False`` parameter) run one in
# `n` in the default suite, taken in turn along the module in collection order, which one of
# each `n` depending on the lane (tests/lanes.py: each JAX release's full lane runs others); the
# others are marked `slow` (CI's slow lane runs them on every run). Every jitted case stays. The
# eager path differs from the jitted one only in running the same traced backward op by op
# (hifigrad traces one backward program either way: `api._backward`), and these modules' eager
# cases were a large part of their time (measured with --durations: test_checkpoint 120 of
# 255 s, test_compress 71 of 180 s on jax 0.10.2, 2 cores; test_rules' eager cases 367 of 446 s).
# Issue 48 (the default suite in 15 minutes per release) widened the turns: the eager cases were
# 189 of the default suite's 1242 s on jax 0.12.1 (2 cores, 2 lanes side by side), then 279 of
# 2276 s on jax 0.10.2 (its `--durations`, lanes side by side), and the turns doubled again.
_EAGER_IN_TURN_MODULES = {"test_checkpoint": 10, "test_compress": 10, "test_attention": 10,
                          "test_rules": 10, "test_separable": 8, "test_codecs": 8, "test_api": 6,
                          "test_coefficients": 6, "test_optim": 6, "test_report": 6,
                          "test_interpreter": 6, "test_build": 4, "test_flax": 6,
                          "test_equinox": 6, "test_bad_inputs": 4}


def _eager_in_turn(items):
    """Of each `_EAGER_IN_TURN_MODULES` module's eager cases still in the default suite, in
    collection order, the first of every `n` stays and the others are marked `slow`."""
    seen: dict = {}
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        n = _EAGER_IN_TURN_MODULES.get(module)
        if n is None or not _is_eager(item):
            continue
        if item.get_closest_marker("slow") or item.get_closest_marker("sweep"):
            continue  # already out of the default suite: not counted in the turn
        i = seen[module] = seen.get(module, -1) + 1
        if not in_turn(i, n):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Marks the eager cases `_eager_in_turn` moves to the `slow` tier before `-m` selects, then
    keeps the ``HIFIGRAD_TEST_CHUNK`` chunk (`_keep_chunk`) of what `-m` / `-k` selected."""
    _eager_in_turn(items)
    yield
    _keep_turns(config, items)
    _keep_chunk(config, items)
    _longest_modules_first(items)


# The modules that take longest, longest first (pytest --junitxml of the default suite, jax
# 0.10.2, 2 processes on 2 cores: 139 s for test_checkpoint down to 46 s for test_attention; the
# others took 31 s or less).
_LONGEST_MODULES = ("test_checkpoint", "test_optim", "test_compress", "test_separable",
                    "test_distributed", "test_demo", "test_third_party", "test_docs",
                    "test_census", "test_rules", "test_attention")


def _longest_modules_first(items):
    """In a pytest-xdist worker (`make test` runs 2, `--dist loadfile --no-loadscope-reorder`:
    whole modules, in collection order, to whichever process is free), the longest modules
    first, so that the run does not end on one of them with the other process idle. A stable
    sort: each module's tests keep their order; one process (no xdist) keeps pytest's order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {m: i for i, m in enumerate(_LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1],
                                         len(rank)))


def _turns(spec: str) -> dict:
    turns = {}
    for part in spec.replace(",", " ").split():
        module, _, n = part.partition("=")
        try:
            turns[module] = int(n)
        except ValueError:
            turns[module] = 0
        if not module.startswith("test_") or turns[module] < 1:
            raise pytest.UsageError(
                f"HIFIGRAD_TURNS must be 'test_module=n ...' with n >= 1, got {spec!r}")
    return turns


def _keep_turns(config, items):
    """``HIFIGRAD_TURNS="test_module=n ..."`` keeps one in `n` of each named module's selected
    tests, in collection order, which one of each `n` depending on the lane (tests/lanes.py:
    each JAX release keeps its own share, reproducibly). `make test-subset` uses it: CI runs the
    subset on four releases, so each of their cases runs on some of them, and every case on the
    releases tested in full."""
    spec = os.environ.get("HIFIGRAD_TURNS", "").strip()
    if not spec:
        return
    turns, seen, kept, deselected = _turns(spec), {}, [], []
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        n = turns.get(module)
        if n is None:
            kept.append(item)
            continue
        i = seen[module] = seen.get(module, -1) + 1
        (kept if in_turn(i, n) else deselected).append(item)
    items[:] = kept
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def _keep_chunk(config, items):
    """``HIFIGRAD_TEST_CHUNK=i/n`` keeps the i-th of n contiguous slices of the selected tests
    (in collection order, so a module's fixtures stay within few chunks): `make tpu-check` runs
    the suite on a TPU in calls of limited length, one chunk per call. Every test is in exactly
    one chunk, for any n."""
    spec = os.environ.get("HIFIGRAD_TEST_CHUNK", "").strip()
    if not spec:
        return
    i, n = _chunk(spec)
    lo, hi = len(items) * (i - 1) // n, len(items) * i // n
    deselected = items[:lo] + items[hi:]
    items[:] = items[lo:hi]
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def pytest_runtest_setup(item):
    """`cpu_only` / `cuda_only` / `tpu_only` tests (tests/platforms.py) are skipped elsewhere,
    with their reason."""
    from platforms import on_cpu, on_cuda, on_tpu

    where = {"cpu_only": "XLA:CPU", "cuda_only": "an NVIDIA GPU", "tpu_only": "a TPU"}
    for name, here in (("cpu_only", on_cpu), ("cuda_only", on_cuda), ("tpu_only", on_tpu)):
        mark = item.get_closest_marker(name)
        if mark is not None and not here():
            reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
            pytest.skip(f"holds only on {where[name]}: {reason}")


@pytest.fixture(autouse=True)
def _strict_numerics():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


# The modules whose checkpoints run their backward in slices, and check each sliced backward
# against the unsliced one as it runs (`hg.Policy(check_slices=True)`, through its environment
# switch): a wrong slicing fails the test that hit it, whatever that test asserts. Tests that
# measure buffers or count equations opt out (`@pytest.mark.no_slice_check`): the check runs
# the unsliced backward too.
_CHECK_SLICES_MODULES = ("test_checkpoint", "test_compress", "test_separable", "test_resize")


@pytest.fixture(autouse=True)
def _check_slices(request, monkeypatch):
    module = request.node.module.__name__.rsplit(".", 1)[-1]
    if module in _CHECK_SLICES_MODULES and request.node.get_closest_marker(
            "no_slice_check") is None:
        monkeypatch.setenv("HIFIGRAD_CHECK_SLICES", "1")
    yield


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test case both without and with `jax.jit`."""
    if request.param:
        return jax.jit
    return lambda f: f
