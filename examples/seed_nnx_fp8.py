"""The seed issue's model in Flax NNX, with fp8 saved activations and float32 gradients.

The same network as `seed_flax_fp8.py` (10 scanned Dense + ReLU blocks, a 10-class head), in the
standard NNX scan-over-layers idiom: the blocks are created with `nnx.vmap` (one stacked
`nnx.Linear`), and `hg.flax.scan_layers` applies them with `hifigrad.scan`, saving each block's
activations in fp8 (`save="residuals"`: the fp8 input and a bit-packed ReLU mask per block).
Gradients are float32; `optax.adam` updates the parameters with `nnx.Optimizer`.

Run: python examples/seed_nnx_fp8.py [--steps 100] [--codec fp8_e4m3] [--save residuals]
"""

import argparse

import jax
import optax
from flax import nnx

import hifigrad as hg

EMB_DIM = 128
N_BLOCKS = 10
BATCH_SIZE = 64
N_CLASSES = 10


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, codec: str | None = "fp8_e4m3",
                 save: str = "residuals"):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_block(key):
            return nnx.Linear(EMB_DIM, EMB_DIM, rngs=nnx.Rngs(key))

        self.blocks = make_block(jax.random.split(rngs.params(), N_BLOCKS))
        self.head = nnx.Linear(EMB_DIM, N_CLASSES, rngs=rngs)
        self.codec, self.save = codec, save

    def __call__(self, x):
        if self.codec is None:  # the uncompressed reference: a plain scan over the blocks
            graphdef, state = nnx.split(self.blocks)
            x, _ = jax.lax.scan(lambda c, s: (nnx.relu(nnx.merge(graphdef, s)(c)), None),
                                x, state)
        else:
            x = hg.flax.scan_layers(self.blocks, x, codec=self.codec, save=self.save,
                                    activation=nnx.relu)
        return self.head(x)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss, grads


def train(steps: int, codec="fp8_e4m3", seed: int = 0, save: str = "residuals"):
    """Trains for `steps` steps; returns the losses and the first step's gradients."""
    key = jax.random.key(seed)
    x = jax.random.normal(key, (BATCH_SIZE, EMB_DIM))
    y = jax.random.randint(key, (BATCH_SIZE,), 0, N_CLASSES)
    model = Model(nnx.Rngs(seed), codec=codec, save=save)
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    losses, first_grads = [], None
    for _ in range(steps):
        loss, grads = train_step(model, optimizer, x, y)
        first_grads = nnx.state(grads) if first_grads is None else first_grads
        losses.append(float(loss))
    return losses, first_grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--codec", default="fp8_e4m3")
    ap.add_argument("--save", choices=("inputs", "residuals"), default="residuals")
    args = ap.parse_args()
    losses, grads = train(args.steps, codec=args.codec, save=args.save)
    dtypes = sorted({str(g.dtype) for g in jax.tree_util.tree_leaves(grads)})
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {i:4d} loss {losses[i]:.4f}")
    print(f"final loss {losses[-1]:.4f}; gradient dtypes {dtypes}")


if __name__ == "__main__":
    main()
