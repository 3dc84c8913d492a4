"""How long `hifigrad.optim`'s training steps take to trace and compile, against optax's, on a
newcomer's own model (issue 49, item 6): a Flax NNX decoder of 6 unrolled ``nnx.remat``
blocks (``nnx.MultiHeadAttention`` with ``nnx.make_causal_mask``'s float32 mask, a GELU MLP,
d_model 256, 4 heads, bf16 parameters and compute), batch 8 x 256 tokens: 99 parameter leaves
of 8 shapes.

For each configuration, in one process and in the table's order: the seconds to trace and
lower (Python) and to compile (XLA) the jitted train step (gradient and update, parameters
and state donated), and the same for the update alone (``tx.update`` and
``optax.apply_updates`` on the gradients' shapes). ``optax`` is what the newcomer ran:
``jax.grad`` and ``optax.adamw`` on the bf16 parameters; the others take ``hg.grad``'s
float32 gradients.

Run from the repository root (about 5 minutes on 2 CPU cores: three runs, each in a fresh
process, the least of each time kept)::

    PYTHONPATH=. python benchmarks/optim_compile.py

It writes ``benchmarks/results/optim_compile_<backend>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import env_info, md_table, write_json  # noqa: E402

import hifigrad as hg  # noqa: E402

BF16 = jnp.bfloat16
D, HEADS, BLOCKS, BATCH, T = 256, 4, 6, 8, 256


def newcomer_model():
    """(params, loss): the newcomer's decoder as `nnx.split` state and a loss of it."""
    from flax import nnx
    kw = dict(dtype=BF16, param_dtype=BF16)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(D, rngs=rngs, **kw)
            self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                               rngs=rngs, **kw)
            self.ln2 = nnx.LayerNorm(D, rngs=rngs, **kw)
            self.up = nnx.Linear(D, 4 * D, rngs=rngs, **kw)
            self.down = nnx.Linear(4 * D, D, rngs=rngs, **kw)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(256, D, rngs=rngs, **kw)
            blocks = [Block(rngs) for _ in range(BLOCKS)]
            self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
            self.out = nnx.Linear(D, 256, rngs=rngs, **kw)

        def __call__(self, tokens):
            x = self.emb(tokens)
            mask = nnx.make_causal_mask(tokens)          # float32, as its docs make it
            for block in self.blocks:
                x = nnx.remat(lambda b, x: b(x, mask))(block, x)
            return self.out(x).astype(jnp.float32)

    graphdef, params = nnx.split(Decoder(nnx.Rngs(0)), nnx.Param)

    def loss(params, tokens):
        import optax
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return params, loss


def configs():
    import optax
    opt = hg.optim
    return {
        "optax": (jax.grad, lambda: optax.adamw(1e-3)),
        "f32-master": (hg.grad, lambda: opt.master_weights(optax.adamw(1e-3))),
        # the parameters' stochastic rounding alone, over optax's own float32 moments
        "sr": (hg.grad, lambda: opt.stochastic_rounding(optax.adamw(1e-3))),
        "sr+bf16": (hg.grad, lambda: opt.stochastic_rounding(opt.adamw(1e-3, moments="bf16"))),
        "sr+8bit": (hg.grad, lambda: opt.stochastic_rounding(opt.adamw(1e-3, moments="8bit"))),
        "sr+4bit": (hg.grad, lambda: opt.stochastic_rounding(opt.adamw(1e-3, moments="4bit"))),
        "split+fp16": (hg.grad, lambda: opt.master_weights(opt.adamw(1e-3, moments="fp16"),
                                                           master="split")),
        "split8+8bit": (hg.grad, lambda: opt.master_weights(opt.adamw(1e-3, moments="8bit"),
                                                            master="split8")),
    }


def timed(fn, *args):
    """(seconds to trace and lower, seconds to compile) of jit(fn) donating args 0 and 1."""
    t0 = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):       # optax needs JAX's default promotion
        lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def _runs(args) -> dict:
    """Each configuration's times, the least of ``args.runs`` fresh processes' (this script
    with ``--runs 1``, into a temporary folder)."""
    import json
    import subprocess
    import tempfile

    best = {}
    for r in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.abspath(__file__), "--runs", "1", "--out", tmp]
            if args.configs:
                cmd += ["--configs", args.configs]
            subprocess.run(cmd, check=True)
            with open(os.path.join(tmp, f"optim_compile_{jax.default_backend()}.json")) as f:
                rows = json.load(f)["rows"]
        for name, row in rows.items():
            old = best.setdefault(name, dict(row))
            for k, v in row.items():
                old[k] = min(old[k], v)
        print(f"run {r + 1} of {args.runs} done", flush=True)
    return best


def main(argv=None):
    import optax
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--runs", type=int, default=3,
                    help="fresh processes, each measuring every configuration once; the "
                         "table keeps each time's minimum (compile times on shared cores vary "
                         "by 15%% from run to run)")
    args = ap.parse_args(argv)
    rows = _runs(args) if args.runs > 1 else {}
    params, loss = newcomer_model()
    leaves = jax.tree.leaves(params)
    tokens = jnp.zeros((BATCH, T + 1), jnp.int32)
    shapes = {tuple(x.shape) for x in leaves}
    print(f"{len(leaves)} leaves of {len(shapes)} shapes, "
          f"{sum(x.size for x in leaves) / 1e6:.2f}M parameters", flush=True)
    for name, (grad, make) in configs().items() if args.runs <= 1 else ():
        if args.configs and name not in args.configs.split(","):
            continue
        tx = make()

        def step(p, s, tokens, grad=grad, tx=tx):
            g = grad(loss)(p, tokens)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        def update(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        dtype = BF16 if name == "optax" else jnp.float32
        grads = jax.tree.map(lambda x, dtype=dtype: jnp.zeros(x.shape, dtype), params)
        step_lower, step_compile = timed(step, params, tx.init(params), tokens)
        up_lower, up_compile = timed(update, params, tx.init(params), grads)
        rows[name] = {"step_lower_s": step_lower, "step_compile_s": step_compile,
                      "update_lower_s": up_lower, "update_compile_s": up_compile}
        print(f"  {name:12s} step {step_lower:5.1f} + {step_compile:5.1f} s, update "
              f"{up_lower:5.1f} + {up_compile:5.1f} s", flush=True)
    base = rows.get("optax")
    result = {"env": env_info(sys.argv if argv is None else argv), "leaves": len(leaves),
              "shapes": len(shapes), "runs": args.runs, "rows": rows}
    backend = jax.default_backend()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"optim_compile_{backend}")
    write_json(path + ".json", result)

    def total(r, what):
        return r[f"{what}_lower_s"] + r[f"{what}_compile_s"]

    table = [[name, f"{r['step_lower_s']:.1f}", f"{r['step_compile_s']:.1f}",
              f"{total(r, 'step') / total(base, 'step'):.2f}x" if base else "-",
              f"{r['update_lower_s']:.1f}", f"{r['update_compile_s']:.1f}",
              f"{total(r, 'update') / total(base, 'update'):.2f}x" if base else "-"]
             for name, r in rows.items()]
    lines = [f"# Trace and compile time of hifigrad.optim's steps ({backend})", "",
             "Written by `PYTHONPATH=. python benchmarks/optim_compile.py`: "
             f"the newcomer's Flax NNX decoder ({BLOCKS} unrolled `nnx.remat` blocks, d_model "
             f"{D}, {HEADS} heads, bf16, batch {BATCH} x {T}; {len(leaves)} parameter leaves of "
             f"{len(shapes)} shapes). Seconds to trace and lower (Python) and to compile (XLA) "
             "the jitted train step (gradient and update) and the update alone, one process, "
             "in the table's order; *x optax*: trace, lower and compile together, as a ratio "
             "to optax's (jax.grad and optax.adamw on the bf16 parameters). Each time is the "
             f"least of {args.runs} runs, each in a fresh process.", "",
             md_table(["configuration", "step: trace+lower s", "step: compile s",
                       "step x optax", "update: trace+lower s", "update: compile s",
                       "update x optax"], table), "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in result["env"].items())]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path + ".md")


if __name__ == "__main__":
    main()
