"""hifigrad.flax: linen remat_scan with a codec, NNX scan_layers; the seed's Flax example."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hifigrad as hg

_EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _load_example(name="seed_flax_fp8"):
    spec = importlib.util.spec_from_file_location(name, _EXAMPLES / f"{name}.py")
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
        return {
            "fp8": seed.train(20, codec="fp8_e4m3"),  # the example's default: save="residuals"
            "fp8-inputs": seed.train(1, codec="fp8_e4m3", save="inputs"),
            "int8-inputs": seed.train(1, codec="int8", save="inputs"),
            None: seed.train(1, codec=None),
        }


def test_seed_example_trains_with_fp8_activations(seed_runs):
    """Issue 3: 20 steps with fp8 saved activations and f32 gradients; the loss falls and the
    step-0 gradients have cosine >= 0.99 to the uncompressed model's. With save="residuals"
    the backward's ReLU gates are the forward's (bit-packed masks), so the only error is e4m3's
    rounding (2^-4 relative) of each block's saved input in the kernel gradients: measured
    0.9999."""
    losses, g_fp8 = seed_runs["fp8"]
    assert losses[-1] < losses[0]
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(g_fp8))
    assert _cos(g_fp8, seed_runs[None][1]) >= 0.99


def test_seed_example_fp8_recomputed_from_inputs(seed_runs):
    """save="inputs": each block is recomputed from its e4m3-decoded input, which flips about
    5% of the recomputed ReLU gates per block; this 10-block ReLU stack is so sensitive that
    2^-9 relative noise on its saved inputs alone (bf16) gives cosine 0.998. Measured 0.983;
    the bound is what e4m3's 3 mantissa bits allow here."""
    assert _cos(seed_runs["fp8-inputs"][1], seed_runs[None][1]) >= 0.98


def test_seed_example_int8_cosine(seed_runs):
    assert _cos(seed_runs["int8-inputs"][1], seed_runs[None][1]) >= 0.99


@pytest.mark.parametrize("save", ["inputs", "residuals"])
def test_remat_scan_saves_only_encoded_carries(seed, save):
    model = seed.Model(codec="int8", save=save)
    x = jnp.ones((4, seed.EMB_DIM))
    with jax.numpy_dtype_promotion("standard"):
        params = model.init(jax.random.key(0), x)
        _, f_vjp = jax.vjp(lambda p: model.apply(p, x), params)
    leaves = jax.tree_util.tree_leaves(f_vjp)
    stacked_f32 = [l for l in leaves if l.shape == (seed.N_BLOCKS, 4, seed.EMB_DIM)
                   and l.dtype == jnp.float32]
    assert not stacked_f32
    assert any(l.dtype == jnp.int8 for l in leaves)
    # The ReLU masks, bit-packed: one uint8 per 8 elements of each block's activation.
    mask_shape = (seed.N_BLOCKS, 4 * seed.EMB_DIM // 8)
    masks = [l for l in leaves if l.dtype == jnp.uint8 and l.shape == mask_shape]
    assert len(masks) == (save == "residuals"), [(l.shape, l.dtype) for l in leaves]


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


def test_nnx_seed_example_trains_with_fp8_activations():
    """The NNX version of the seed model (examples/seed_nnx_fp8.py): 20 steps with fp8 saved
    residuals, float32 gradients, the loss falls, and the step-0 gradients have cosine >= 0.99
    to the uncompressed model's (same init: the codec does not change the parameters)."""
    ex = _load_example("seed_nnx_fp8")
    with jax.numpy_dtype_promotion("standard"):  # Flax and optax mix dtypes implicitly
        losses, g = ex.train(20, codec="fp8_e4m3")
        _, g_ref = ex.train(1, codec=None)
    assert losses[-1] < losses[0]
    assert all(l.dtype == jnp.float32 for l in jax.tree_util.tree_leaves(g))
    assert _cos(g, g_ref) >= 0.99
