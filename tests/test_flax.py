"""hifigrad.flax: linen remat_scan with a codec, NNX scan_layers; the seed's Flax example."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hifigrad as hg

_EX = pathlib.Path(__file__).parent.parent / "examples" / "seed_flax_fp8.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("seed_flax_fp8", _EX)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cos(a, b):
    a = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(a)])
    b = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(b)])
    return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


@pytest.fixture(scope="module")
def seed():
    return _load_example()


@pytest.fixture(scope="module")
def seed_runs(seed):
    with jax.numpy_dtype_promotion("standard"):  # Flax and optax mix dtypes implicitly
        return {c: seed.train(20 if c == "fp8_e4m3" else 1, codec=c)
                for c in ("fp8_e4m3", "int8", None)}


def test_seed_example_trains_with_fp8_activations(seed_runs):
    losses, g_fp8 = seed_runs["fp8_e4m3"]
    assert losses[-1] < losses[0]
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(g_fp8))
    # Measured 0.983: this 10-layer ReLU stack is so sensitive that 2^-9 relative noise on its
    # activations alone moves the gradient to cosine 0.990; fp8 e4m3 (2^-4) flips ~5% of the
    # recomputed ReLU gates per block. Bound: what e4m3's 3 mantissa bits allow here.
    assert _cos(g_fp8, seed_runs[None][1]) >= 0.98


@pytest.mark.xfail(strict=True, reason="issue 3 asks cosine >= 0.99 for fp8 on the seed model; "
                   "recomputing blocks from e4m3-decoded inputs gives 0.983 (ReLU gate flips)")
def test_seed_example_fp8_cosine_meets_issue_target(seed_runs):
    assert _cos(seed_runs["fp8_e4m3"][1], seed_runs[None][1]) >= 0.99


def test_seed_example_int8_cosine(seed_runs):
    assert _cos(seed_runs["int8"][1], seed_runs[None][1]) >= 0.99


def test_remat_scan_saves_only_encoded_carries(seed):
    model = seed.Model(codec="int8")
    x = jnp.ones((4, seed.EMB_DIM))
    with jax.numpy_dtype_promotion("standard"):
        params = model.init(jax.random.key(0), x)
        _, f_vjp = jax.vjp(lambda p: model.apply(p, x), params)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    stacked_f32 = [l for l in leaves if l.shape == (seed.N_BLOCKS, 4, seed.EMB_DIM)
                   and l.dtype == jnp.float32]
    assert not stacked_f32
    assert any(l.dtype == jnp.int8 for l in leaves)


def test_jax_checkpoint_policy_is_rejected():
    import flax.linen as nn

    with pytest.raises(TypeError, match="hifigrad.Policy"):
        hg.flax.remat_scan(nn.Dense, lengths=(2,), codec="int8",
                           policy=jax.checkpoint_policies.nothing_saveable)


def test_nnx_scan_layers(maybe_jit):
    from flax import nnx

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_blocks(key):
        return nnx.Linear(16, 16, rngs=nnx.Rngs(key))

    blocks = make_blocks(jax.random.split(jax.random.key(0), 6))
    x = jax.random.normal(jax.random.key(1), (4, 16))

    def loss(blocks, codec):
        if codec is None:
            graphdef, state = nnx.split(blocks)
            out = jax.lax.scan(lambda c, s: (jnp.tanh(nnx.merge(graphdef, s)(c)), None), x,
                               state)[0]
        else:
            out = hg.flax.scan_layers(blocks, x, codec=codec, activation=jnp.tanh)
        return jnp.sum(out ** 2)

    g = maybe_jit(nnx.grad(lambda b: loss(b, "fp8_e4m3")))(blocks)
    ref = nnx.grad(lambda b: loss(b, None))(blocks)
    assert _cos(nnx.state(g), nnx.state(ref)) >= 0.99
