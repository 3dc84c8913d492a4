"""Training state at float32 quality without float32 copies: `hifigrad.optim`'s
configurations trained side by side on two language models (CPU), against float32 master
weights and naive bf16 AdamW.

Models (bf16 parameters, bf16 compute, float32 gradients from `hg.grad`, the same seeds,
data and steps for every configuration):

* ``demo``: the demo's GPT (`hifigrad.demo.model`: 4 pre-LN blocks, d_model 64, byte-level,
  64-byte context, batch 16) on the demo's corpus (the Python standard library's source);
* ``flax``: a Flax linen Transformer LM (4 blocks of `nn.SelfAttention` with a causal mask and
  an `nn.Dense` GELU MLP, d_model 64, RMS-free LayerNorm) on the same corpus.

AdamW (lr 3e-3 with 20 warm-up steps and cosine decay to 3e-5, weight decay 0.1, b2 0.99),
``--steps`` steps. Configurations (state beside the bf16 parameter; bytes per parameter in
all, parameters included, are *measured*: the compiled train step's
``memory_analysis().argument_size_in_bytes`` less the batch's, over the parameter count):

* ``f32-master``: `master_weights(optax.adamw)`: float32 master and moments (the reference,
  trained with ``--seeds`` seeds for the seed-to-seed spread);
* ``naive-bf16``: plain ``optax.adamw`` on the bf16 parameters with ``jax.grad``'s bf16
  gradients and bf16 moments: updates under half an ulp are lost (the failing baseline);
* ``split``: `master_weights(optax.adamw, master="split")`: the master's low 16 bits;
* ``split+fp16``, ``split+8bit``: the same with `adamw(moments="fp16")` (block-scaled
  float16 moments) or ``moments="8bit"``;
* ``kahan+fp16``, ``kahan+bf16``, ``kahan+8bit``: `kahan(adamw(moments=...))`: a bf16
  compensation beside each parameter;
* ``sr+bf16``: `stochastic_rounding(adamw(moments="bf16"))`: nothing beside the parameter.

Then the *late phase*: from the float32 master's trained parameters, every configuration
trains ``--late-steps`` more steps at a constant learning rate of 1e-5 (no weight decay, a
fresh optimizer state, the same batches), where most updates are under half a bf16 ulp.

Run from the repository root (about 30 minutes on 2 CPU cores)::

    PYTHONPATH=. python benchmarks/optim_bench.py

It writes ``benchmarks/results/optim_cpu.md``, ``.json`` and ``optim_curves.png`` (the loss
curves, also the guide's figure: ``docs/img/optim_curves.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import env_info, md_table, write_json  # noqa: E402

import hifigrad as hg  # noqa: E402
from hifigrad.demo import data as D  # noqa: E402
from hifigrad.demo import model as M  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = jnp.bfloat16
SEQ, BATCH, D_MODEL, LAYERS, HEADS = 64, 16, 64, 4, 4
LR, WARMUP, FINAL_LR, WD, B2 = 3e-3, 20, 3e-5, 0.1, 0.99
TARGET_BYTES = 8.0
LATE_LR, LATE_DATA_SEED = 1e-5, 777


def schedule(steps):
    return optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, steps, FINAL_LR)


def configs(steps, lr=None, wd=WD) -> dict:
    lr = schedule(steps) if lr is None else lr
    kw = dict(b2=B2, weight_decay=wd)
    return {
        "f32-master": lambda: hg.optim.master_weights(optax.adamw(lr, **kw)),
        "naive-bf16": lambda: optax.adamw(lr, mu_dtype=BF16, **kw),
        "split": lambda: hg.optim.master_weights(optax.adamw(lr, **kw), master="split"),
        "split+fp16": lambda: hg.optim.master_weights(
            hg.optim.adamw(lr, moments="fp16", **kw), master="split"),
        "split+8bit": lambda: hg.optim.master_weights(
            hg.optim.adamw(lr, moments="8bit", **kw), master="split"),
        "kahan+fp16": lambda: hg.optim.kahan(hg.optim.adamw(lr, moments="fp16", **kw)),
        "kahan+bf16": lambda: hg.optim.kahan(hg.optim.adamw(lr, moments="bf16", **kw)),
        "kahan+8bit": lambda: hg.optim.kahan(hg.optim.adamw(lr, moments="8bit", **kw)),
        "sr+bf16": lambda: hg.optim.stochastic_rounding(
            hg.optim.adamw(lr, moments="bf16", **kw)),
    }


# ------------------------------------------------------------------ the models

def demo_model(seed):
    cfg = M.ModelConfig(n_layers=LAYERS, d_model=D_MODEL, n_heads=HEADS, seq_len=SEQ)
    params = jax.tree.map(lambda a: jnp.asarray(a, BF16), M.init_params(seed, cfg))

    def loss(params, batch):
        return M.loss_fn(cfg, params, batch, BF16)

    return params, loss


def flax_model(seed):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            h = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(x)
            x = x + nn.SelfAttention(num_heads=HEADS, dtype=BF16, param_dtype=BF16)(h, mask)
            h = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(x)
            h = nn.gelu(nn.Dense(4 * D_MODEL, dtype=BF16, param_dtype=BF16)(h))
            return x + nn.Dense(D_MODEL, dtype=BF16, param_dtype=BF16)(h)

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(256, D_MODEL, dtype=BF16, param_dtype=BF16)(tokens)
            pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D_MODEL), BF16)
            x = x + pos[None, : tokens.shape[1]]
            for _ in range(LAYERS):
                x = Block()(x)
            x = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(x)
            return nn.Dense(256, dtype=BF16, param_dtype=BF16)(x)

    lm = LM()
    params = lm.init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))

    def loss(params, batch):
        logits = lm.apply(params, batch[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], -1))

    return params, loss


MODELS = {"demo": demo_model, "flax": flax_model}


# ------------------------------------------------------------------ training

def n_params(params) -> int:
    return sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(params))


def train(model, config, seed, steps, corpus, val_batch, start=None, lr=None, wd=WD,
          data_seed=None):
    """One run; from `start` (parameters) with a constant `lr` for the late phase."""
    params, loss = MODELS[model](seed)
    if start is not None:
        params = start
    tx = configs(steps, lr, wd)[config]()
    state = tx.init(params)
    batches = D.sample_batches(corpus.train, steps, BATCH, SEQ,
                               seed if data_seed is None else data_seed)

    naive = config == "naive-bf16"

    @jax.jit
    def step(params, state, batch):
        if naive:  # what a bf16 user has: jax.grad's bf16 gradients, bf16 moments
            value, grads = jax.value_and_grad(loss)(params, batch)
        else:
            value, grads = hg.value_and_grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    compiled = step.lower(params, state, batches[0]).compile()
    mem = compiled.memory_analysis()
    batch_bytes = batches[0].nbytes
    n = n_params(params)
    state_bytes = (mem.argument_size_in_bytes - batch_bytes) / n if mem else None
    evaluate = jax.jit(loss)
    val0 = float(evaluate(params, val_batch))
    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        params, state, value = compiled(params, state, batches[i])
        losses.append(float(value))
    val = float(evaluate(params, val_batch))
    moved = float(np.mean([np.mean(np.asarray(a) != np.asarray(b)) for a, b in
                           zip(jax.tree.leaves(params), jax.tree.leaves(start))])) \
        if start is not None else None
    return {"losses": losses, "final_train": float(np.mean(losses[-20:])), "val": val,
            "val_start": val0, "moved": moved, "bytes_per_param": state_bytes, "n_params": n,
            "train_s": time.perf_counter() - t0, "params": params}


# ------------------------------------------------------------------ the update's cost

UPDATE_SHAPES = [(1024, 4096)] * 4 + [(4096, 1024)] * 4 + [(4096,)] * 8  # ~33.6M parameters


def update_cost(argv, repeats: int = 7) -> dict:
    """The optimizer update alone (``tx.update`` and ``optax.apply_updates`` on bf16
    parameters and float32 gradients, jitted, parameters and state donated as a training step
    does): time of each configuration as a ratio to ``f32-master``'s, measured side by side
    (each configuration's step timed in turn, ``repeats`` rounds, the median of each), and its
    compiled temp memory (bytes per parameter) from ``memory_analysis()``."""
    rng = np.random.default_rng(0)
    params = {f"p{i}": jnp.asarray(rng.normal(size=s) * 0.02, BF16)
              for i, s in enumerate(UPDATE_SHAPES)}
    grads = {k: jnp.asarray(rng.normal(size=v.shape) * 1e-3, jnp.float32)
             for k, v in params.items()}
    n = n_params(params)
    steps, mem, times = {}, {}, {}
    with jax.numpy_dtype_promotion("standard"):
        for config, make in configs(1000).items():
            tx = make()

            def step(params, state, grads, tx=tx):
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            # naive bf16 gets what jax.grad gives a bf16 model: bf16 gradients
            g = jax.tree.map(lambda a: a.astype(BF16), grads) if config == "naive-bf16" \
                else grads
            state = tx.init(params)
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, g).compile()
            ma = compiled.memory_analysis()
            mem[config] = ma.temp_size_in_bytes / n if ma else None
            # donated: every leaf its own buffer (init may share one zero among leaves)
            p, st = compiled(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state),
                             g)   # warm
            jax.block_until_ready(p)
            steps[config] = [compiled, p, st, g]
            times[config] = []
        for _ in range(repeats):
            for config, entry in steps.items():
                compiled, p, st, g = entry
                t0 = time.perf_counter()
                p, st = compiled(p, st, g)
                jax.block_until_ready((p, st))
                times[config].append(time.perf_counter() - t0)
                entry[1], entry[2] = p, st
    base = float(np.median(times["f32-master"]))
    rows = {c: {"time_ratio": float(np.median(t)) / base, "temp_bytes_per_param": mem[c]}
            for c, t in times.items()}
    for c, r in rows.items():
        print(f"update {c:16s} {r['time_ratio']:.2f}x time, temp "
              f"{r['temp_bytes_per_param']:.2f} B/param", flush=True)
    return {"env": env_info(sys.argv if argv is None else argv), "n_params": n,
            "repeats": repeats, "rows": rows}


def write_update_cost(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "optim_update_cpu")
    write_json(base + ".json", result)
    lines = ["# The optimizer update's cost: hifigrad.optim's configurations (CPU)", "",
             "Written by `PYTHONPATH=. python benchmarks/optim_bench.py --update-cost`: the "
             f"update alone on {result['n_params'] / 1e6:.1f}M bf16 parameters with float32 "
             "gradients (`tx.update` + `optax.apply_updates`, jitted, parameters and state "
             "donated). *time*: median of each configuration's step over "
             f"{result['repeats']} interleaved rounds, as a ratio to f32-master's (CPU ratios: "
             "the cores are shared, read them to about 10%); *temp*: the compiled update's "
             "temp allocation per parameter (`memory_analysis()`), on top of the state.", "",
             md_table(["configuration", "time / f32-master's", "temp B/param"],
                      [[c, f"{r['time_ratio']:.2f}x", f"{r['temp_bytes_per_param']:.2f}"]
                       for c, r in result["rows"].items()]), ""]
    env = result["env"]
    lines.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", base + ".md")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--late-steps", type=int, default=300)
    ap.add_argument("--models", default="demo,flax")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--update-cost", action="store_true",
                    help="measure the optimizer update alone (time ratios, temp memory)")
    args = ap.parse_args(argv)
    if args.update_cost:
        write_update_cost(update_cost(argv), args.out)
        return
    corpus = D.load_corpus(2_000_000)
    val_batch = jnp.asarray(D.sample_batches(corpus.val, 1, 64, SEQ, 12345)[0])
    result = {"env": env_info(sys.argv if argv is None else argv), "steps": args.steps,
              "late_steps": args.late_steps, "late_lr": LATE_LR,
              "models": {}}
    with jax.numpy_dtype_promotion("standard"):
        for model in args.models.split(","):
            runs = {}
            for config in configs(args.steps):
                seeds = range(args.seeds) if config == "f32-master" else range(1)
                runs[config] = [train(model, config, s, args.steps, corpus, val_batch)
                                for s in seeds]
                r = runs[config][0]
                print(f"{model:5s} {config:16s} val {r['val']:.4f} train {r['final_train']:.4f} "
                      f"{r['bytes_per_param']:.2f} B/param ({r['train_s']:.0f} s)", flush=True)
            # the late phase: from the float32 master's trained parameters (seed 0), every
            # configuration with a fresh state, a small constant learning rate, the same batches
            start = runs["f32-master"][0]["params"]
            late = {}
            for config in configs(args.late_steps):
                late[config] = train(model, config, 0, args.late_steps, corpus, val_batch,
                                     start=start, lr=LATE_LR, wd=0.0, data_seed=LATE_DATA_SEED)
                r = late[config]
                print(f"{model:5s} late {config:16s} val {r['val_start']:.4f} -> {r['val']:.4f} "
                      f"moved {r['moved']:.3f}", flush=True)
            for rs in list(runs.values()) + [[r] for r in late.values()]:
                for r in rs:
                    r.pop("params")
            result["models"][model] = runs
            result.setdefault("late", {})[model] = late
    write(result, args.out)


def spread(runs) -> tuple[float, float]:
    vals = [r["val"] for r in runs]
    return min(vals), max(vals)


def write(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "optim_cpu")
    write_json(base + ".json", result)
    lines = ["# Training state: hifigrad.optim's configurations on two language models (CPU)",
             "", "Written by `PYTHONPATH=. python benchmarks/optim_bench.py` (see its docstring "
             f"for the models and the schedule; {result['steps']} steps). *val*: validation "
             "loss (nats per byte) after training; *B/param*: bytes of parameters and "
             "optimizer state per parameter, from the compiled step's "
             "`memory_analysis().argument_size_in_bytes` less the batch's. f32-master: the "
             "mean over its seeds, and their spread.", ""]
    checks = []
    for model, runs in result["models"].items():
        lo, hi = spread(runs["f32-master"])
        rows = []
        for config, rs in runs.items():
            r = rs[0]
            val = (f"{np.mean([x['val'] for x in rs]):.4f} ({lo:.4f}-{hi:.4f})"
                   if config == "f32-master" else f"{r['val']:.4f}")
            within = lo - 1e-9 <= r["val"] <= hi + 1e-9 if config != "f32-master" else True
            rows.append([config, f"{r['bytes_per_param']:.2f}", val,
                         f"{r['final_train']:.4f}",
                         "yes" if within else ("above" if r["val"] > hi else "below")])
            if config != "f32-master" and r["bytes_per_param"] <= TARGET_BYTES + 0.1:
                checks.append((model, config, r["bytes_per_param"], within))
        lines += [f"## {model}", "", md_table(
            ["configuration", "B/param", "val loss", "train loss (last 20)",
             "within f32-master's spread"], rows), ""]
    if result.get("late"):
        lines += [f"## The late phase: {result['late_steps']} steps at a constant learning rate "
                  f"of {result['late_lr']:g}", "",
                  "From the float32 master's trained parameters (seed 0), each configuration "
                  "with a fresh optimizer state, no weight decay and the same batches: where "
                  "updates are smaller than half a bf16 ulp of their parameters (Adam's steps "
                  "are about the learning rate: 1e-5 against half-ulps of 6e-5 at |w| = 0.02). "
                  "*moved*: the fraction of parameter elements that changed.", ""]
        for model, late in result["late"].items():
            ref = late["f32-master"]
            gain_ref = ref["val_start"] - ref["val"]
            rows = [[config, f"{r['val_start']:.4f}", f"{r['val']:.4f}",
                     f"{r['val_start'] - r['val']:+.4f}",
                     f"{(r['val_start'] - r['val']) / gain_ref:.2f}" if gain_ref > 0 else "-",
                     f"{r['moved']:.3f}"] for config, r in late.items()]
            lines += [f"### {model}", "", md_table(
                ["configuration", "val before", "val after", "gain", "gain / f32-master's",
                 "moved"], rows), ""]
    ok = [c for c in checks if c[3]]
    lines += [f"Configurations at most {TARGET_BYTES:g} bytes per parameter whose validation "
              f"loss is within the float32 master's seed-to-seed spread: " + (
                  ", ".join(f"{m} {c} ({b:.2f} B)" for m, c, b, _ in ok) or "none") + ".", ""]
    plot(result, os.path.join(out_dir, "optim_curves.png"))
    lines += ["![loss curves](optim_curves.png)", ""]
    lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in result["env"].items()), ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", base + ".md")


def _plot_deltas(ax, curves, ref, title, k: int = 25):
    """Each configuration's loss curve minus `ref`, smoothed over `k` steps: ``curves`` maps a
    configuration to (its losses, its legend label)."""
    ref = np.asarray(ref)
    for config, (losses, label) in curves.items():
        y = np.convolve(np.asarray(losses) - ref, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(y)) + k, y, label=label,
                linewidth=2 if config in ("f32-master", "naive-bf16") else 1.2,
                linestyle="--" if config == "naive-bf16" else "-")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("Δ loss (nats per byte, smoothed)")
    ax.legend(fontsize=7)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    late = result.get("late", {})
    rows = 2 if late else 1
    fig, axes = plt.subplots(rows, len(models), figsize=(6 * len(models), 4.2 * rows),
                             squeeze=False)
    for ax, model in zip(axes[rows - 1], models if late else []):
        runs = late[model]
        _plot_deltas(ax, {c: (r["losses"], c) for c, r in runs.items()},
                     runs["f32-master"]["losses"],
                     f"{model}, late phase (lr {result['late_lr']:g}): loss minus f32-master's")
    for ax, model in zip(axes[0], models):
        runs = result["models"][model]
        _plot_deltas(ax, {c: (rs[0]["losses"], f"{c} ({rs[0]['bytes_per_param']:.1f} B)")
                          for c, rs in runs.items()},
                     np.mean([r["losses"] for r in runs["f32-master"]], axis=0),
                     f"{model}: training loss minus float32 master's (mean of seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
