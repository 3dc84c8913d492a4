"""`make tpu-check`'s pieces on CPU: HIFIGRAD_TEST_CHUNK=i/n splits the selected tests into n
contiguous slices, each test in exactly one; benchmarks/tpu_bench.py runs at a tiny size and
writes its tables."""

import json
import os
import subprocess
import sys

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


def test_chunks_partition_the_selected_tests():
    _, full = _collect()
    assert len(full) > 5
    parts = [_collect(f"{i}/3")[1] for i in (1, 2, 3)]
    assert sum(parts, []) == full  # contiguous, in order, each test once
    assert all(parts)


def test_a_bad_chunk_is_a_usage_error():
    proc, _ = _collect("4/3")
    assert proc.returncode != 0 and "HIFIGRAD_TEST_CHUNK" in proc.stdout + proc.stderr


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
