"""benchmarks/gpu_bench.py at a tiny size on CPU: both models' tables are written (markdown and
JSON), every row of each ends with a number or an explicit error / skip, the references are
bitwise their own, and the cuDNN rows say why they cannot run off a CUDA GPU."""

import json
import math
import os
import sys

import jax
import pytest

import hifigrad as hg

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
import gpu_bench  # noqa: E402

TINY = ["--small", "--blocks", "1", "--d", "32", "--heads", "2", "--vocab", "64", "--batch", "1",
        "--seq", "16", "--mlp-blocks", "2", "--mlp-d", "32", "--mlp-hidden", "64", "--tokens",
        "32", "--steps", "1", "--compile-threads", "2"]


# One row of each kind (the reference always runs): about 10 compiles, within a minute on 2 CPU
# cores; test_all_rows runs every row. The tests of the tables are `slow`, run by CI's slow lane
# on every run: they check the benchmark script's bookkeeping (its rows, tables and error
# reports), not hifigrad on a JAX release, which every lane's own tests do.
ROWS = ["jax.grad bf16", "hg.grad bf16 default", "hg.grad bf16 exact", "hg.grad bf16 fast",
        "jax.grad hg.scan int4", "jax.grad hg.scan residuals fp8_e4m3",
        "hg.grad hg.scan fp8_e4m3", "jax.grad bf16 cudnn attention",
        "hg.grad bf16 cudnn attention", "bf16 remat scan", "jax.grad hg.scan int8",
        "hg.grad hg.scan residuals int2", "broken build", "broken trace"]


def _broken_rows(cfg):
    """The MLP's rows plus two that fail (at build and while tracing): the others still run."""
    def bad_trace():
        def g(params, x):
            raise ValueError("deliberately broken row")
        return g

    def bad_build():
        raise RuntimeError("cannot build this row")

    return _mlp_rows(cfg) + [gpu_bench.Row("broken build", bad_build, "fails to build"),
                             gpu_bench.Row("broken trace", bad_trace, "fails to trace")]


_mlp_rows = gpu_bench.mlp_rows


def run_bench(out, args):
    # The benchmark runs models as their users write them (standard promotion), not under the
    # suite's strict modes; it is the bench's own program, checked here for its bookkeeping.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return gpu_bench.main(TINY + args + ["--out-dir", str(out)])


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench")
    mp = pytest.MonkeyPatch()
    mp.setattr(gpu_bench, "mlp_rows", _broken_rows)
    try:
        summary = run_bench(out, ["--tag", "test", "--rows", ",".join(ROWS)])
    finally:
        mp.undo()
    return out, summary


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_tables_written_and_every_row_accounted_for(tables, model):
    out, summary = tables
    md = (out / f"{model}_test.md").read_text()
    data = json.loads((out / f"{model}_test.json").read_text())
    rows = data["rows"]
    assert [r["name"] for r in rows] == list(summary[model])
    assert len(rows) >= 5
    for r in rows:
        s = r["status"]
        assert r["name"] in md
        if s == "ok":
            assert isinstance(r["step_s"], float) and r["step_s"] > 0, r
            assert r["grad_dtypes"] == ["float32"], r
            assert r["temp_bytes"] is not None
            assert r["sqnr_db"] == "reference" or isinstance(r["sqnr_db"], (float, str)), r
        elif s.startswith("same program as"):
            assert "step_s" in r, r
        else:
            # an explicit reason, never a silent gap
            assert s.startswith(("skipped:", "cannot build:", "build error:", "compile error:",
                                 "run error:", "sqnr error:")), r
    assert rows[0]["sqnr_db"] == "reference"
    assert data["env"]["jax"] == jax.__version__ and data["device"]["driver"]
    for field in ("date", "command", "python", "jaxlib"):
        assert data["env"][field]


@pytest.mark.slow
def test_expected_rows_ran(tables):
    _, summary = tables
    gpt, mlp = summary["gpt"], summary["mlp"]
    for name in ("jax.grad f32 highest", "jax.grad bf16", "jax.grad hg.scan int4",
                 "jax.grad hg.scan residuals fp8_e4m3", "hg.grad hg.scan fp8_e4m3"):
        assert gpt[name] == "ok", (name, gpt[name])
    # The default policy's 'auto' is 'exact' on CPU and 'fast' (bf16 matmuls) elsewhere: there
    # the fast row is the default row's program, which gpu_bench measures once.
    fast = ("ok" if hg.Policy().resolved_matmul() == "exact"
            else "same program as 'hg.grad bf16 default' (not recompiled)")
    assert gpt["hg.grad bf16 fast"] == fast, gpt["hg.grad bf16 fast"]
    for name in ("bf16 remat scan", "jax.grad hg.scan int8", "hg.grad hg.scan residuals int2"):
        assert mlp[name] == "ok", (name, mlp[name])
    if jax.default_backend() != "gpu":
        assert gpt["jax.grad bf16 cudnn attention"] == "skipped: cuDNN needs a CUDA GPU"
        assert gpt["hg.grad bf16 cudnn attention"] == "skipped: cuDNN needs a CUDA GPU"


@pytest.mark.slow
def test_sqnr_and_ratio_columns(tables):
    out, _ = tables
    data = json.loads((out / "mlp_test.json").read_text())
    by = {r["name"]: r for r in data["rows"]}
    assert by["bf16 remat scan"]["ratio_vs_baseline"] == 1.0
    s = by["jax.grad hg.scan int8"]["sqnr_db"]
    assert isinstance(s, float) and math.isfinite(s) and s > 10


@pytest.mark.slow
def test_failing_rows_report_their_error(tables):
    _, summary = tables
    assert summary["mlp"]["broken build"] == "build error: RuntimeError: cannot build this row"
    assert summary["mlp"]["broken trace"] == (
        "compile error: ValueError: deliberately broken row")


def test_budget_skips_rows_explicitly(tmp_path):
    summary = run_bench(tmp_path, ["--models", "mlp", "--budget-s", "0", "--tag", "budget"])
    statuses = list(summary["mlp"].values())
    assert statuses[0] == "ok"  # the reference always runs
    assert all(s.startswith("skipped: --budget-s") for s in statuses[1:]), statuses


@pytest.mark.slow
def test_all_rows(tmp_path):
    """Every row of both tables (about 45 compiles: minutes on 2 CPU cores)."""
    summary = run_bench(tmp_path, ["--tag", "all"])
    for model in ("gpt", "mlp"):
        for name, s in summary[model].items():
            assert s == "ok" or s.startswith(("same program as", "skipped: cuDNN")), (name, s)
