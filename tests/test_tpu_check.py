"""`make tpu-check`'s pieces on CPU: HIFIGRAD_TEST_CHUNK=i/n splits the selected tests into n
contiguous slices, each test in exactly one; benchmarks/tpu_bench.py runs at a tiny size and
writes its tables. Also `make test-subset`'s HIFIGRAD_TURNS (tests/conftest.py): one in n of a
module's tests, each lane its own share; and the order `make test`'s pytest-xdist workers take
the modules in."""

import json
import os
import subprocess
import sys
import types

import conftest
import lanes
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _collect(chunk=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("HIFIGRAD_TEST_CHUNK", None)
    if chunk:
        env["HIFIGRAD_TEST_CHUNK"] = chunk
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", os.path.join(HERE, "test_policy.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, [ln for ln in proc.stdout.splitlines() if "::" in ln]


class _Config:
    """What the selection hooks use of pytest's config: the deselection hook."""

    def __init__(self):
        self.deselected = []
        self.hook = types.SimpleNamespace(
            pytest_deselected=lambda items: self.deselected.extend(items))


def _items(modules):
    return [types.SimpleNamespace(module=types.SimpleNamespace(__name__=f"tests.{m}"), i=i)
            for i, m in enumerate(modules)]


def _keep(keep, env, value, items):
    config, kept = _Config(), list(items)
    old = os.environ.get(env)
    os.environ[env] = value
    try:
        keep(config, kept)
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old
    assert sorted(x.i for x in kept + config.deselected) == [x.i for x in items]
    return kept


def test_chunks_partition_the_selected_tests():
    items = _items(["test_a"] * 7 + ["test_b"] * 4)
    for n in (1, 3, 11, 12):
        parts = [_keep(conftest._keep_chunk, "HIFIGRAD_TEST_CHUNK", f"{i}/{n}", items)
                 for i in range(1, n + 1)]
        assert sum(parts, []) == items  # contiguous, in order, each test once
        assert all(len(p) in (len(items) // n, -(-len(items) // n)) for p in parts)


def test_a_bad_chunk_is_a_usage_error():
    proc, _ = _collect("4/3")
    assert proc.returncode != 0 and "HIFIGRAD_TEST_CHUNK" in proc.stdout + proc.stderr


def test_turns_keep_one_in_n_of_the_named_modules(monkeypatch):
    """Each named module keeps one in n of its tests, in order; the lane seeds' n turns
    partition them; other modules keep every test."""
    items = _items(["test_a"] * 7 + ["test_b"] * 5 + ["test_c"] * 3)
    shares = []
    for seed in range(3):
        monkeypatch.setattr(lanes, "LANE_SEED", seed)
        kept = _keep(conftest._keep_turns, "HIFIGRAD_TURNS", "test_a=3,test_c=1", items)
        assert [x for x in kept if x.module.__name__ == "tests.test_b"] == items[7:12]
        assert items[12:] == [x for x in kept if x.module.__name__ == "tests.test_c"]
        a = [x.i for x in kept if x.module.__name__ == "tests.test_a"]
        assert len(a) in (2, 3) and all(j - i == 3 for i, j in zip(a, a[1:]))
        shares.append(a)
    assert sorted(sum(shares, [])) == list(range(7))


def test_a_bad_turn_is_a_usage_error():
    for spec in ("test_a", "test_a=0", "a=2", "test_a=x"):
        with pytest.raises(pytest.UsageError, match="HIFIGRAD_TURNS"):
            _keep(conftest._keep_turns, "HIFIGRAD_TURNS", spec, _items(["test_a"]))


def test_xdist_workers_take_the_longest_modules_first(monkeypatch):
    """In a pytest-xdist worker, the longest modules come first, in their listed order, each
    module's tests in their own order, the rest after them in collection order; one process
    keeps the collection order."""
    longest = conftest._LONGEST_MODULES
    items = _items(["test_a", "test_b", longest[2], "test_a", longest[0], longest[2]])
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    kept = list(items)
    conftest._longest_modules_first(kept)
    assert kept == items
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    conftest._longest_modules_first(kept)
    assert [x.i for x in kept] == [4, 2, 5, 0, 1, 3]


# The benchmark at a tiny size in a fresh interpreter (about a minute on 2 cores): `slow`, as the
# GPU benchmark's tables (tests/test_gpu_bench.py); CI's slow lane runs it on every run.
@pytest.mark.slow
def test_tpu_bench_tiny(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = ["--sections", "codecs,mlp,gpt", "--legacy", "--act-shape", "2x8x128", "--reps", "1",
            "--steps", "1", "--mlp-blocks", "2", "--mlp-d", "32", "--mlp-hidden", "64",
            "--tokens", "32", "--mlp-codecs", "int8,int4", "--gpt-blocks", "1",
            "--gpt-compress-blocks", "1", "--gpt-d", "32", "--gpt-heads", "2", "--vocab", "64",
            "--batch", "1", "--seq", "16", "--gpt-codecs", "int8", "--out-dir", str(tmp_path)]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tpu_bench.py"),
                           *argv], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "tpu_bench.json").read_text())
    secs = res["sections"]
    assert set(secs) == {"codecs", "mlp", "gpt", "gpt_compress"}
    for rows in secs.values():
        for row in rows:
            assert "status" not in row, row
    codecs = {r["codec"]: r for r in secs["codecs"]}
    # The stored bytes are what nbytes says; int4 stores about half of int8's.
    for r in codecs.values():
        assert r["nbytes MiB"] == pytest.approx(r["stored leaves MiB"])
    assert codecs["int4"]["stored leaves MiB"] < 0.6 * codecs["int8"]["stored leaves MiB"]
    assert "| codec |" in (tmp_path / "tpu_bench.md").read_text()
