"""`hg.fidelity_report`: per-leaf gradient fidelity of a user's model, checked against SQNRs
computed independently (float64 NumPy over gradients taken here), on a plain pytree, a Flax
linen model, an NNX model and an equinox module, plus its bad-input errors."""

from __future__ import annotations

import io
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import hifigrad as hg


def _sqnr_db(g, ref) -> float:
    g = np.asarray(g, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    return 10 * math.log10(np.sum(ref**2) / np.sum((g - ref) ** 2))


def _jit_flag(maybe_jit) -> bool:
    return maybe_jit is jax.jit


# ------------------------------------------------------------------------------ plain pytree

T, D = 512, 32


def _accumulate_loss(p, xs):
    """sum_t <w, x_t> + 0.5 |b|^2, with the sum over t in a `lax.scan`: d/dw = sum_t x_t, an
    accumulation over T steps that jax.grad keeps in the compute dtype."""
    def body(c, x):
        return c + jnp.sum(p["w"] * x), None

    s, _ = lax.scan(body, jnp.zeros((), p["w"].dtype), xs)
    return s.astype(jnp.float32) + 0.5 * jnp.sum(jnp.square(p["b"].astype(jnp.float32)))


def _accumulate_inputs():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((T, D)).astype(np.float32)
    params = {"w": jnp.zeros((D,), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((D,)).astype(np.float32))}
    return params, jnp.asarray(xs)


def test_plain_pytree_sqnr_matches_an_independent_float64_computation(maybe_jit):
    params, xs = _accumulate_inputs()
    r = hg.fidelity_report(_accumulate_loss, params, xs, jit=_jit_flag(maybe_jit), show=False)
    by = {leaf.path: leaf for leaf in r.leaves}
    assert set(by) == {"w", "b"} and r.dtype == "bfloat16"

    # The exact gradient of w is sum_t x_t, in float64 here. hg.grad's float32 backward sums
    # the bf16-rounded inputs the forward used, so its SQNR must be that of the rounding alone:
    x64 = np.asarray(xs, np.float64)
    exact = x64.sum(0)
    rounded = np.asarray(xs).astype(ml_dtypes.bfloat16).astype(np.float64).sum(0)
    expected = _sqnr_db(rounded, exact)
    # Tolerance: the report's reference and hg.grad both sum 512 terms in float32, an error of
    # at most T * eps_f32 ~ 3e-5 of sum|x| per entry, against the bf16 rounding error of
    # ~sqrt(T) * eps_bf16 / 4 ~ 4e-2 of |x|; that moves the SQNR by well under 0.05 dB.
    assert by["w"].hg.sqnr_db == pytest.approx(expected, abs=0.05)
    # b's gradient is b itself, rounded to bf16 by the forward: both methods give bf16(b).
    b = np.asarray(params["b"], np.float64)
    b_bf16 = np.asarray(params["b"]).astype(ml_dtypes.bfloat16).astype(np.float64)
    for m in ("jax", "hg"):
        assert getattr(by["b"], m).sqnr_db == pytest.approx(_sqnr_db(b_bf16, b), abs=1e-6)

    # jax.grad's SQNR against the same formula over a gradient taken here.
    g_jax = maybe_jit(jax.grad(_accumulate_loss))(
        jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), xs.astype(jnp.bfloat16))
    g_ref = maybe_jit(jax.grad(_accumulate_loss))(params, xs)
    assert by["w"].jax.sqnr_db == pytest.approx(
        _sqnr_db(np.asarray(g_jax["w"], np.float32), g_ref["w"]), abs=1e-9)
    # The bf16 accumulator of 512 steps loses far more than the rounding of the inputs: bf16
    # keeps 8 significant bits, so once the running sum is ~16x an addend (sqrt(512) ~ 23),
    # each addition loses several of the addend's bits.
    assert by["w"].hg.sqnr_db > by["w"].jax.sqnr_db + 10
    assert r.leaves[0].path == "w"  # sorted worst (lowest jax.grad SQNR) first
    assert "w" in r.verdict and "hg.grad" in r.verdict

    total_ref = np.concatenate([np.asarray(g_ref["b"]), np.asarray(g_ref["w"])])
    total_jax = np.concatenate([np.asarray(g_jax["b"], np.float32),
                                np.asarray(g_jax["w"], np.float32)])
    assert r.total.jax.sqnr_db == pytest.approx(_sqnr_db(total_jax, total_ref), abs=1e-9)
    assert r.total.shape == (2 * D,)
    assert r.loss["f32"] == pytest.approx(float(_accumulate_loss(params, xs)), rel=1e-6)


def test_fp16_underflow_is_counted(maybe_jit):
    # d/dw of 1e-4 * sum(w * x) is 1e-4 * x: with |x| ~ 1e-4, 1e-8 is below fp16's smallest
    # subnormal (6e-8), so jax.grad's fp16 gradient is zero while hg.grad's float32 one is not.
    x = jnp.full((64,), 1e-4, jnp.float32)
    params = {"w": jnp.ones((64,), jnp.float32)}

    def loss(p, x):
        return (jnp.sum(p["w"] * x) * jnp.asarray(1e-4, x.dtype)).astype(jnp.float32)

    r = hg.fidelity_report(loss, params, x, dtype=jnp.float16, jit=_jit_flag(maybe_jit),
                           show=False)
    leaf = r.leaves[0]
    assert leaf.jax.underflow_frac == 1.0 and leaf.jax.zero_frac == 1.0
    assert leaf.hg.underflow_frac == 0.0
    # hg.grad's error is the fp16 rounding of 1e-4 (relative 2^-11 at most): SQNR > 60 dB.
    assert leaf.hg.sqnr_db > 60
    assert "underflowed" in r.verdict


# ------------------------------------------------------------------------------ Flax, equinox

def _independent_leaf_sqnrs(loss, params, *args, jit):
    """{path: (jax SQNR, hg SQNR)} from gradients taken here, path keys joined by '/'."""
    wrap = jax.jit if jit else (lambda f: f)
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    low_args = [a.astype(jnp.bfloat16) for a in args]
    ref = wrap(jax.grad(loss))(jax.tree.map(lambda a: a.astype(jnp.float32), params), *args)
    g_jax = wrap(jax.grad(loss))(low, *low_args)
    g_hg = wrap(hg.grad(loss))(low, *low_args)
    out = {}
    for (path, r), gj, gh in zip(jax.tree_util.tree_flatten_with_path(ref)[0],
                                 jax.tree.leaves(g_jax), jax.tree.leaves(g_hg)):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                        for k in path)
        if name.endswith("/value"):
            name = name[: -len("/value")]
        out[name] = (_sqnr_db(np.asarray(gj, np.float32), r), _sqnr_db(gh, r))
    return out


def test_linen_model(maybe_jit):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = jnp.tanh(nn.Dense(64)(x))
            return nn.Dense(4)(x)

    x = jax.random.normal(jax.random.key(1), (16, 32), jnp.float32)
    params = MLP().init(jax.random.key(0), x)["params"]

    def loss(params, x):
        return jnp.mean(jnp.square(MLP().apply({"params": params}, x).astype(jnp.float32)))

    jit = _jit_flag(maybe_jit)
    r = hg.fidelity_report(loss, params, x, jit=jit, show=False)
    expected = _independent_leaf_sqnrs(loss, params, x, jit=jit)
    assert {leaf.path for leaf in r.leaves} == set(expected)
    assert "Dense_0/kernel" in expected and len(expected) == 6
    for leaf in r.leaves:
        # Same gradients, the same formula: agreement to float64 rounding.
        assert (leaf.jax.sqnr_db, leaf.hg.sqnr_db) == pytest.approx(expected[leaf.path],
                                                                    abs=1e-9), leaf.path
        assert 0.99 < leaf.hg.cosine <= 1.0 + 1e-12
    sq = [leaf.jax.sqnr_db for leaf in r.leaves]
    assert sq == sorted(sq)


def test_nnx_state(maybe_jit):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(32, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (16, 32), jnp.float32)

    def loss(state, x):
        return jnp.mean(jnp.square(nnx.merge(graphdef, state)(x).astype(jnp.float32)))

    jit = _jit_flag(maybe_jit)
    r = hg.fidelity_report(loss, state, x, jit=jit, show=False)
    assert {leaf.path for leaf in r.leaves} == {"l1/kernel", "l1/bias", "l2/kernel", "l2/bias"}
    expected = _independent_leaf_sqnrs(loss, state, x, jit=jit)
    for leaf in r.leaves:
        assert (leaf.jax.sqnr_db, leaf.hg.sqnr_db) == pytest.approx(expected[leaf.path],
                                                                    abs=1e-9), leaf.path


def test_equinox_module_keeps_non_array_leaves_fixed():
    eqx = pytest.importorskip("equinox")

    model = eqx.nn.MLP(8, 2, 16, 2, activation=jnp.tanh, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8,), jnp.float32)

    def loss(m, x):
        return jnp.sum(jnp.square(m(x).astype(jnp.float32)))

    r = hg.fidelity_report(loss, model, x, show=False)
    assert {leaf.path for leaf in r.leaves} == {f"layers/{i}/{n}" for i in range(3)
                                                for n in ("weight", "bias")}
    assert all(math.isfinite(leaf.hg.sqnr_db) for leaf in r.leaves)


# ------------------------------------------------------------------------------ output

def test_prints_a_table_sorted_worst_first_with_the_verdict():
    from rich.console import Console

    params, xs = _accumulate_inputs()
    buf = io.StringIO()
    r = hg.fidelity_report(_accumulate_loss, params, xs, console=Console(file=buf, width=250))
    text = buf.getvalue()
    assert "Gradient fidelity vs float32, bfloat16 forward" in text
    lines = text.splitlines()
    row_w = next(i for i, line in enumerate(lines) if line.lstrip("│ ").startswith("w "))
    row_b = next(i for i, line in enumerate(lines) if line.lstrip("│ ").startswith("b "))
    assert row_w < row_b  # worst leaf first
    assert "(all)" in text
    assert " ".join(r.verdict.split()[:6]) in " ".join(text.split())
    d = r.to_dict()
    assert d["leaves"][0]["path"] == "w" and set(d["loss"]) == {"f32", "jax", "hg"}


# ------------------------------------------------------------------------------ bad input

def _params():
    return {"w": jnp.ones((4,), jnp.float32)}


@pytest.mark.parametrize("loss, params, dtype, error, match", [
    (lambda p, x: jnp.sum(p["w"] * x), {"w": jnp.ones((4,)), "n": jnp.arange(4)},
     jnp.bfloat16, TypeError, "params leaf 'n' has dtype int32"),
    (lambda p, x: p["w"] * x, None, jnp.bfloat16, TypeError, r"real floating-point scalar; it "
                                                             r"returned float32\[4\]"),
    (lambda p, x: (jnp.sum(p["w"] * x), 0), None, jnp.bfloat16, TypeError,
     "must return a scalar array; it returned tuple"),
    (lambda p, x: jnp.sum(p["w"] * x), None, jnp.float32, ValueError,
     "less precise than float32"),
    (lambda p, x: jnp.sum(p["w"] * x), None, jnp.int8, ValueError, "floating dtype"),
    (lambda p, x: jnp.sum(p["w"] * x), {"n": jnp.arange(3)}, jnp.bfloat16, TypeError,
     "dtype int32"),
    (lambda p, x: jnp.sum(x), {"f": 1.0}, jnp.bfloat16, ValueError,
     "no floating-point array leaves"),
    # A model that mixes its (cast) inputs with a hard-coded float32 array: under the test
    # suite's strict promotion, bf16 * f32 is a TypeError, reported with the cast explained.
    (lambda p, x: jnp.sum(p["w"] * x * jnp.ones((4,), jnp.float32)), None, jnp.bfloat16,
     TypeError, "casts every float leaf"),
])
def test_bad_input_gets_a_clear_error(loss, params, dtype, error, match):
    with pytest.raises(error, match=match):
        hg.fidelity_report(loss, _params() if params is None else params,
                           jnp.ones((4,), jnp.float32), dtype=dtype, show=False)
