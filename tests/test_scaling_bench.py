"""benchmarks/scaling_bench.py's helpers at a tiny size on CPU: the growth-exponent fit, the HLO
instruction count, one measured row in this process, and a report over two depths."""

import math
import os
import sys

import jax
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
import scaling_bench  # noqa: E402


def test_growth_exponent_recovers_a_power_law():
    ns = [4, 8, 16, 32]
    assert math.isclose(scaling_bench.growth_exponent(ns, [3.0 * n ** 2 for n in ns]), 2.0,
                        rel_tol=1e-9)
    assert math.isclose(scaling_bench.growth_exponent(ns, [5.0 for _ in ns]), 0.0, abs_tol=1e-9)
    assert scaling_bench.growth_exponent([4], [1.0]) is None


def test_count_instructions_counts_every_computation():
    text = jax.jit(lambda x: jax.numpy.sin(x) * 2).lower(np.ones(3, np.float32)).compile()
    n = scaling_bench.count_instructions(text.as_text())
    assert n >= 3  # at least a parameter, the sine and the multiply
    assert scaling_bench.count_instructions("ENTRY e {\n  %p = f32[] parameter(0)\n"
                                            "  ROOT %n = f32[] negate(%p)\n}") == 2


@pytest.mark.slow  # eight compiles: about 30 s alone on 2 cores, minutes when they are shared
def test_rows_and_report_at_tiny_size():
    rows = [scaling_bench.measure(m, layout, n, reps=1, d=8, seq=4, batch=1, heads=2)
            for m in scaling_bench.METHODS for layout in scaling_bench.LAYOUTS for n in (1, 2)]
    for r in rows:
        assert all(r[k] > 0 for k in scaling_bench.METRICS), r
    ratios = scaling_bench.ratios(rows)
    assert {(r["layout"], r["n"]) for r in ratios} == {(lay, n) for lay in scaling_bench.LAYOUTS
                                                       for n in (1, 2)}
    exps = scaling_bench.exponents(rows)
    assert len(exps) == 4
    text = scaling_bench.report(rows, {"jax": jax.__version__, "command": "test", "cpu": "cpu"})
    assert "## Growth exponents" in text and "hg.grad / jax.grad" in text


def test_split_blocks_is_exact():
    x = jax.random.normal(jax.random.key(0), (4, 8), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(scaling_bench.split_blocks)(x)),
                                  np.asarray(x))


@pytest.mark.slow  # traces and un-jitted calls of a one-block model: about a minute when shared
def test_trace_and_eager_measurements_at_tiny_size():
    t = scaling_bench.trace_times(1, reps=1)
    assert t["jax.grad trace_s"] > 0 and t["hg.grad trace_s"] > 0 and t["ratio"] > 0
    cases = scaling_bench.eager_times(1, reps=1)
    assert [c["case"] for c in cases] == ["grad", "value_and_grad", "reused vjp_fn",
                                          "jax.grad(precise_backward(f))"]
    assert all(c["jax_ms"] > 0 and c["hg_ms"] > 0 for c in cases)
