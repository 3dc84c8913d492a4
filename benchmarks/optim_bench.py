"""Training state at float32 quality without float32 copies: `hifigrad.optim`'s
configurations trained side by side on two language models (CPU), against float32 master
weights and naive bf16 AdamW, and the update step's own cost.

Models (bf16 parameters, bf16 compute, float32 gradients from `hg.grad`, the same seeds,
data and steps for every configuration):

* ``demo``: the demo's GPT (`hifigrad.demo.model`: 4 pre-LN blocks, d_model 64, byte-level,
  64-byte context, batch 16) on the demo's corpus (the Python standard library's source);
* ``lm1b``: the Flax lm1b example's ``TransformerLM`` (examples/lm1b/models.py, written
  again here with its modules: ``nn.Embed``, sinusoidal positions, pre-LN
  ``EncoderDecoder1DBlock`` of ``nn.SelfAttention`` (no bias, causal and padding masks) and a
  ReLU ``MlpBlock``, dropout 0.1, ``encoderdecoder_norm``, a ``logitdense`` output), at 2
  layers, emb/qkv 128, MLP 512, 4 heads of 32 (the attention kernels' last axis is 32 wide),
  with ``param_dtype`` bf16, on the same corpus as bytes (vocabulary 256, 128-byte
  examples, batch 16).

Optimizer: AdamW as lm1b trains (b1 0.9, b2 0.98, eps 1e-9, weight decay 0.1), lr 3e-3 with
25 warm-up steps and cosine decay to 3e-5 over ``--steps`` steps, then a *late phase* of
``--late-steps`` more steps at a constant 3e-5, each configuration keeping its own parameters
and state (one run of ``--steps`` + ``--late-steps``). Most of Adam's steps there are under
half a bf16 ulp of their parameter. Configurations (bytes per parameter, parameters and
state, are *measured*: the compiled train step's ``memory_analysis().argument_size_in_bytes``
less the batch's and the dropout key's, over the parameter count):

* ``f32-master``: `master_weights(optax.adamw)` (the reference, ``--seeds`` seeds for the
  seed-to-seed spread);
* ``naive-bf16``: plain ``optax.adamw`` on the bf16 parameters with ``jax.grad``'s bf16
  gradients and bf16 moments (``mu_dtype``);
* ``split``, ``split+fp16``, ``split+8bit``: `master_weights(..., master="split")` (the
  master's low 16 bits) with float32, ``"fp16"`` or ``"8bit"`` moments (`hg.optim.adamw`);
* ``split8+8bit``, ``split8+4bit``: ``master="split8"`` (a 24-bit master: 8 bits beside the
  parameter, rounded stochastically) with 8-bit or 4-bit moments;
* ``kahan+bf16``: `kahan(adamw(moments="bf16"))`;
* ``sr+bf16``, ``sr+8bit``, ``sr+4bit``: `stochastic_rounding(adamw(moments=...))`.

Per configuration: validation loss after the main phase and after the late phase; the late
gain (the first minus the second) as a fraction of the float32 master's (its seed 0: the
same initialization and batches; and of its seeds' mean); whether the final loss lies within
the float32 master's seeds' spread; the fraction of parameter elements the late phase
changed.

Run from the repository root (about 45 minutes on 2 CPU cores)::

    PYTHONPATH=. python benchmarks/optim_bench.py

It writes ``benchmarks/results/optim_cpu.md``, ``.json`` and ``optim_curves.png`` (the loss
curves, also the guide's figure: ``docs/img/optim_curves.png``).

``--update-cost`` measures the update alone (``tx.update`` and ``optax.apply_updates``,
jitted, parameters and state donated) on ``--update-params`` synthetic bf16 parameters
(default 33.6M; ``--update-params 134e6`` for a 100M+ run on an accelerator) and on both
models' own parameters: each configuration's time as a ratio to the float32 master's,
measured side by side, and its arguments and temporaries from ``memory_analysis()``. It
writes ``optim_update_<backend><--out-suffix>.md`` and ``.json``. ``--configs`` takes a subset
(f32-master, the reference, always runs); ``--kernels auto,xla`` measures each block-coded
configuration twice, as it runs by default (on a TPU the Pallas kernel,
``hifigrad/_src/optim_pallas.py``) and on the XLA path, side by side; ``--compile-workers``
compiles that many configurations at a time (each traced and lowered in turn first; the
compile column is then each one's time among the others)::

    PYTHONPATH=. python benchmarks/optim_bench.py --update-cost --update-params 60e6 \
        --models '' --configs sr+8bit,sr+4bit,split+fp16 --kernels auto,xla --repeats 9 \
        --compile-workers 7 --out-suffix _pallas
"""

from __future__ import annotations

import argparse
import json
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
BATCH = 16
LR, WARMUP, LATE_LR = 3e-3, 25, 3e-5
B1, B2, EPS, WD = 0.9, 0.98, 1e-9, 0.1       # lm1b's AdamW
TARGET_BYTES = 4.0
A = hg.optim.adamw


def schedule(steps):
    """Warm-up and cosine decay to the late learning rate over `steps`, then constant."""
    return optax.join_schedules(
        [optax.warmup_cosine_decay_schedule(0.0, LR, min(WARMUP, steps // 2), steps, LATE_LR),
         optax.constant_schedule(LATE_LR)], [steps])


def configs(lr) -> dict:
    kw = dict(b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    mw = hg.optim.master_weights
    return {
        "f32-master": lambda: mw(optax.adamw(lr, **kw)),
        "naive-bf16": lambda: optax.adamw(lr, mu_dtype=BF16, **kw),
        "split": lambda: mw(optax.adamw(lr, **kw), master="split"),
        "split+fp16": lambda: mw(A(lr, moments="fp16", **kw), master="split"),
        "split+8bit": lambda: mw(A(lr, moments="8bit", **kw), master="split"),
        "split8+8bit": lambda: mw(A(lr, moments="8bit", **kw), master="split8"),
        "split8+4bit": lambda: mw(A(lr, moments="4bit", **kw), master="split8"),
        "kahan+bf16": lambda: hg.optim.kahan(A(lr, moments="bf16", **kw)),
        "sr+bf16": lambda: hg.optim.stochastic_rounding(A(lr, moments="bf16", **kw)),
        "sr+8bit": lambda: hg.optim.stochastic_rounding(A(lr, moments="8bit", **kw)),
        "sr+4bit": lambda: hg.optim.stochastic_rounding(A(lr, moments="4bit", **kw)),
    }


# ------------------------------------------------------------------ the models

def demo_model(seed):
    cfg = M.ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64)
    params = jax.tree.map(lambda a: jnp.asarray(a, BF16), M.init_params(seed, cfg))

    def loss(params, batch, rng):
        del rng
        return M.loss_fn(cfg, params, batch, BF16)

    return params, loss, cfg.seq_len


LM1B = dict(vocab=256, emb=128, qkv=128, mlp=512, heads=4, layers=2, seq=128, dropout=0.1)


def lm1b_model(seed):
    """The Flax lm1b example's TransformerLM (examples/lm1b/models.py), at the size above,
    with bf16 parameters (``param_dtype``) and compute (``dtype``)."""
    import flax.linen as nn

    c = LM1B
    kernel_init = nn.initializers.xavier_uniform()
    bias_init = nn.initializers.normal(stddev=1e-6)

    def sinusoidal(max_len, d):
        pe = np.zeros((max_len, d), np.float32)
        position = np.arange(max_len)[:, None]
        div = np.exp(np.arange(d // 2) * -np.log(10000.0) / (d // 2 - 1))
        pe[:, : d // 2] = np.sin(position * div)
        pe[:, d // 2: 2 * (d // 2)] = np.cos(position * div)
        return jnp.asarray(pe[None])

    class MlpBlock(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            out = x.shape[-1]
            x = nn.Dense(c["mlp"], dtype=BF16, param_dtype=BF16, kernel_init=kernel_init,
                         bias_init=bias_init)(x)
            x = nn.Dropout(c["dropout"])(nn.relu(x), deterministic=deterministic)
            x = nn.Dense(out, dtype=BF16, param_dtype=BF16, kernel_init=kernel_init,
                         bias_init=bias_init)(x)
            return nn.Dropout(c["dropout"])(x, deterministic=deterministic)

    class Block(nn.Module):   # EncoderDecoder1DBlock
        @nn.compact
        def __call__(self, inputs, mask, deterministic):
            x = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(inputs)
            x = nn.SelfAttention(num_heads=c["heads"], dtype=BF16, param_dtype=BF16,
                                 qkv_features=c["qkv"], kernel_init=kernel_init,
                                 bias_init=bias_init, use_bias=False, broadcast_dropout=False,
                                 dropout_rate=c["dropout"], deterministic=deterministic)(x, mask)
            x = nn.Dropout(c["dropout"])(x, deterministic=deterministic) + inputs
            z = nn.LayerNorm(dtype=BF16, param_dtype=BF16)(x)
            return x + MlpBlock()(z, deterministic)

    class TransformerLM(nn.Module):
        @nn.compact
        def __call__(self, inputs, deterministic):
            mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0, dtype=BF16),
                nn.make_causal_mask(inputs, dtype=BF16))
            y = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]             # shift_right
            y = nn.Embed(c["vocab"], c["emb"], param_dtype=BF16, dtype=BF16,
                         embedding_init=nn.initializers.normal(stddev=1.0))(y)
            y = y + sinusoidal(c["seq"], c["emb"])[:, : y.shape[1]].astype(BF16)
            y = nn.Dropout(c["dropout"])(y, deterministic=deterministic).astype(BF16)
            for i in range(c["layers"]):
                y = Block(name=f"encoderdecoderblock_{i}")(y, mask, deterministic)
            y = nn.LayerNorm(dtype=BF16, param_dtype=BF16, name="encoderdecoder_norm")(y)
            return nn.Dense(c["vocab"], dtype=BF16, param_dtype=BF16, kernel_init=kernel_init,
                            bias_init=bias_init, name="logitdense")(y)

    lm = TransformerLM()
    params = lm.init(jax.random.key(seed), jnp.ones((1, c["seq"]), jnp.int32), True)

    def loss(params, batch, rng):
        """lm1b's cross entropy (no label smoothing) over the non-padding tokens; dropout
        from `rng` (None: evaluation)."""
        inputs = batch[:, : c["seq"]]
        logits = lm.apply(params, inputs, rng is None,
                          rngs=None if rng is None else {"dropout": rng}).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, inputs[..., None], -1)[..., 0]
        weights = (inputs > 0).astype(jnp.float32)
        return jnp.sum(nll * weights) / jnp.sum(weights)

    return params, loss, c["seq"]


MODELS = {"demo": demo_model, "lm1b": lm1b_model}


# ------------------------------------------------------------------ training

def n_params(params) -> int:
    return sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(params))


def train(model, config, seed, steps, late_steps, corpus, val_batches):
    """One run: `steps` of warm-up and cosine decay, then `late_steps` at the late learning
    rate, keeping the configuration's own parameters and state throughout."""
    params, loss, length = MODELS[model](seed)
    tx = configs(schedule(steps))[config]()
    state = tx.init(params)
    total = steps + late_steps
    batches = D.sample_batches(corpus.train, total, BATCH, length, seed)
    key = jax.random.key(1000 + seed)
    naive = config == "naive-bf16"

    def step(params, state, batch, i):
        rng = jax.random.fold_in(key, i)
        if naive:  # what a bf16 user has: jax.grad's bf16 gradients, bf16 moments
            value, grads = jax.value_and_grad(loss)(params, batch, rng)
        else:
            value, grads = hg.value_and_grad(loss)(params, batch, rng)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, state, batches[0], jnp.int32(0)).compile()
    mem = compiled.memory_analysis()
    n = n_params(params)
    state_bytes = (mem.argument_size_in_bytes - batches[0].nbytes - 4) / n if mem else None
    evaluate = jax.jit(lambda p: jnp.mean(jnp.stack(
        [loss(p, b, None) for b in val_batches])))
    params = jax.tree.map(jnp.copy, params)
    losses, vals, t0 = [], {0: float(evaluate(params))}, time.perf_counter()
    start_late = None
    for i in range(total):
        if i == steps:
            vals[steps] = float(evaluate(params))
            start_late = jax.tree.map(np.asarray, params)
        params, state, value = compiled(params, state, batches[i], jnp.int32(i))
        losses.append(float(value))
    vals[total] = float(evaluate(params))
    moved = None
    if late_steps:
        moved = float(np.sum([np.sum(np.asarray(a) != b) for a, b in
                              zip(jax.tree.leaves(params), jax.tree.leaves(start_late))]) / n)
    return {"losses": losses, "val_main": vals[steps] if late_steps else vals[total],
            "val": vals[total], "val_start": vals[0], "moved": moved,
            "late_gain": vals[steps] - vals[total] if late_steps else None,
            "bytes_per_param": state_bytes, "n_params": n, "train_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ the update's cost

def synthetic_shapes(n_params: float):
    """Transformer-like leaves, ~`n_params` in all: (d, 4d) and (4d, d) matrices, attention
    kernels (d, d/64, 64), and (d,) vectors, d = 1024 (a multiple of 8 sets)."""
    d = 1024
    unit = [(d, 4 * d), (4 * d, d), (d, d // 64, 64), (d, d // 64, 64), (d,), (d,)]
    per = sum(int(np.prod(s)) for s in unit)
    return unit * max(1, int(round(n_params / per)))


def update_cost(params, grads, repeats: int, names=None, kernels=("auto",),
                compile_workers: int = 1) -> dict:
    """The optimizer update alone (``tx.update`` and ``optax.apply_updates`` on bf16
    parameters and float32 gradients, jitted, parameters and state donated as a training step
    does): time of each configuration as a ratio to ``f32-master``'s, measured side by side
    (each configuration's step timed in turn, ``repeats`` rounds, the median of each), and
    its compiled arguments and temporaries (bytes per parameter) from ``memory_analysis()``.
    Each configuration is traced and lowered in turn (the kernel mode is read while tracing),
    then compiled, ``compile_workers`` at a time (XLA compiles in threads of its own)."""
    from concurrent.futures import ThreadPoolExecutor

    from hifigrad._src import optim_codes

    n = n_params(params)
    steps, rows = {}, {}
    runs = []   # (row name, configuration, kernel mode)
    for config in configs(1e-3):
        if names and config not in names:
            continue
        coded = any(k in config for k in optim_codes.KINDS)
        for mode in (kernels if coded else ("auto",)):
            label = {"auto": "", "xla": " (xla)", "interpret": " (interpret)"}[mode]
            runs.append((config + (label if len(kernels) > 1 else ""), config, mode))
    pending = []   # (row, lowered, seconds to trace and lower, parameters, state, gradients)
    with jax.numpy_dtype_promotion("standard"):
        for row, config, mode in runs:
            tx = configs(1e-3)[config]()

            def step(params, state, grads, tx=tx):
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            # naive bf16 gets what jax.grad gives a bf16 model: bf16 gradients
            g = jax.tree.map(lambda a: a.astype(BF16), grads) if config == "naive-bf16" \
                else grads
            p = jax.tree.map(jnp.copy, params)
            state = tx.init(p)
            t0 = time.perf_counter()
            with optim_codes.kernel(mode):   # read while tracing
                lowered = jax.jit(step, donate_argnums=(0, 1)).lower(p, state, g)
            pending.append((row, lowered, time.perf_counter() - t0, p, state, g))

    def compile_one(item):
        t0 = time.perf_counter()
        return item[1].compile(), item[2] + time.perf_counter() - t0

    if compile_workers > 1:
        with ThreadPoolExecutor(compile_workers) as pool:
            done = list(pool.map(compile_one, pending))
    else:
        done = [compile_one(item) for item in pending]
    for (row, _, _, p, state, g), (compiled, compile_s) in zip(pending, done):
        ma = compiled.memory_analysis()
        rows[row] = {"temp_bytes_per_param": ma.temp_size_in_bytes / n,
                     "arg_bytes_per_param": ma.argument_size_in_bytes / n,
                     "compile_s": compile_s, "times": []}
        p, state = compiled(p, state, g)   # warm
        jax.block_until_ready(p)
        steps[row] = [compiled, p, state, g]
        print(f"  compiled {row} ({compile_s:.1f} s: trace, lower, compile)", flush=True)
    del pending, done
    for _ in range(repeats):
        for config, entry in steps.items():
            compiled, p, st, g = entry
            t0 = time.perf_counter()
            p, st = compiled(p, st, g)
            jax.block_until_ready((p, st))
            rows[config]["times"].append(time.perf_counter() - t0)
            entry[1], entry[2] = p, st
    base = float(np.median(rows["f32-master"]["times"]))
    print(f"  f32-master's update: {base * 1e3:.2f} ms (median of {repeats})", flush=True)
    for config, r in rows.items():
        r["time_ratio"] = float(np.median(r.pop("times"))) / base
        r["peak_bytes_per_param"] = r["arg_bytes_per_param"] + r["temp_bytes_per_param"]
        print(f"  {config:12s} {r['time_ratio']:5.2f}x time, args "
              f"{r['arg_bytes_per_param']:5.2f} + temp {r['temp_bytes_per_param']:5.2f} "
              f"B/param, compiled in {r['compile_s']:.1f} s", flush=True)
    return {"n_params": n, "repeats": repeats, "f32_master_s": base, "rows": rows,
            "compile_workers": compile_workers}


def update_costs(args, argv) -> dict:
    result = {"env": env_info(sys.argv if argv is None else argv), "runs": {}}
    names = [c for c in args.configs.split(",") if c] or None
    if names and "f32-master" not in names:
        names = ["f32-master", *names]   # the reference of the ratios
    kernels = tuple(args.kernels.split(","))
    result["suffix"] = args.out_suffix
    rng = np.random.default_rng(0)
    if args.update_params:
        shapes = synthetic_shapes(args.update_params)
        params = {f"p{i}": jnp.asarray(rng.normal(size=s) * 0.02, BF16)
                  for i, s in enumerate(shapes)}
        grads = {k: jnp.asarray(rng.normal(size=v.shape) * 1e-3, jnp.float32)
                 for k, v in params.items()}
        print(f"update cost: synthetic, {n_params(params) / 1e6:.1f}M parameters", flush=True)
        result["runs"]["synthetic"] = update_cost(params, grads, args.repeats, names,
                                                  kernels, args.compile_workers)
        write_update_cost(result, args.out)   # after each run: a partial result survives
        del params, grads
    corpus = D.load_corpus(200_000) if args.models else None
    for model in filter(None, args.models.split(",")):
        params, loss, length = MODELS[model](0)
        batch = jnp.asarray(D.sample_batches(corpus.train, 1, BATCH, length, 0)[0])
        with jax.numpy_dtype_promotion("standard"):
            grads = jax.jit(hg.grad(loss))(params, batch, jax.random.key(0))
        print(f"update cost: {model}, {n_params(params) / 1e6:.2f}M parameters", flush=True)
        result["runs"][model] = update_cost(params, grads, max(args.repeats, 21), names,
                                            kernels, args.compile_workers)
        write_update_cost(result, args.out)
    return result


def write_update_cost(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    backend = result["env"].get("backend", jax.default_backend())
    base = os.path.join(out_dir, f"optim_update_{backend}{result.get('suffix', '')}")
    write_json(base + ".json", result)
    lines = [f"# The optimizer update's cost: hifigrad.optim's configurations ({backend})", "",
             "Written by `PYTHONPATH=. python benchmarks/optim_bench.py --update-cost` (see "
             "the environment line for the arguments): the update alone (`tx.update` + "
             "`optax.apply_updates`, jitted, parameters and state donated) on bf16 "
             "parameters with float32 gradients (naive-bf16: bf16 gradients). *time*: "
             "median of each configuration's step over interleaved rounds, as a ratio to "
             "f32-master's (CPU ratios: the cores are shared, read them to about 10%); "
             "*arguments*: parameters, state and gradients; *temp*: the compiled update's "
             "temporaries; *peak*: the two together (bytes per parameter, "
             "`memory_analysis()`). f32-master's peak is 18 (2 + 12 + 4, no temporaries). "
             "*compile*: seconds to trace, lower and compile the update (one process, each "
             "configuration once, in the order of the table).", ""]
    workers = max(run.get("compile_workers", 1) for run in result["runs"].values())
    if workers > 1:
        lines += [f"Compiled {workers} configurations at a time (`--compile-workers "
                  f"{workers}`; each traced and lowered in turn first): a *compile* figure is "
                  "that configuration's trace and lowering plus its compilation's wall time "
                  "among the others'. The timings are taken after every compilation.", ""]
    if any(" (xla)" in c for run in result["runs"].values() for c in run["rows"]):
        lines += ["Block-coded configurations are measured twice (`--kernels auto,xla`): as "
                  "they run by default (on a TPU, the Pallas kernel of "
                  "`hifigrad/_src/optim_pallas.py` for leaves of blocks of 128 in their last "
                  "axis, the XLA path for the others; with `master=\"split\"` the kernel "
                  "also updates those leaves' split master, `optim_codes.split_leaf_step`), "
                  "and *(xla)*: every leaf on the XLA path "
                  "(`optim_codes.kernel(\"xla\")`).", ""]
    for name, run in result["runs"].items():
        lines += [f"## {name}: {run['n_params'] / 1e6:.2f}M parameters "
                  f"(f32-master's update: {run['f32_master_s'] * 1e3:.1f} ms)", "",
                  md_table(["configuration", "time / f32-master's", "arguments B/param",
                            "temp B/param", "peak B/param", "compile s"],
                           [[c, f"{r['time_ratio']:.2f}x", f"{r['arg_bytes_per_param']:.2f}",
                             f"{r['temp_bytes_per_param']:.2f}",
                             f"{r['peak_bytes_per_param']:.2f}",
                             f"{r['compile_s']:.1f}" if "compile_s" in r else "-"]
                            for c, r in run["rows"].items()]), ""]
    env = result["env"]
    lines.append("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", base + ".md")


# ------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--late-steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default="demo,lm1b")
    ap.add_argument("--configs", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--keep", default="",
                    help="an earlier optim_cpu.json (the same steps and models): the runs of "
                         "the configurations not in --configs are taken from it, so that a "
                         "change to some configurations reruns only those")
    ap.add_argument("--update-cost", action="store_true",
                    help="measure the optimizer update alone (time ratios, memory)")
    ap.add_argument("--update-params", type=float, default=33.6e6,
                    help="with --update-cost: synthetic parameters (0: the models' only)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", default="auto",
                    help="with --update-cost: the block-coded update's implementations, "
                         "comma-separated, each coded configuration measured with each: "
                         "auto (the Pallas kernel on a TPU, XLA elsewhere), xla")
    ap.add_argument("--compile-workers", type=int, default=1,
                    help="with --update-cost: configurations compiled at a time (each is "
                         "traced and lowered in turn first); the compile column is then "
                         "each one's time among the others")
    ap.add_argument("--out-suffix", default="",
                    help="with --update-cost: appended to the result files' names")
    args = ap.parse_args(argv)
    if args.update_cost:
        update_costs(args, argv)
        return
    corpus = D.load_corpus(2_000_000)
    names = [c for c in configs(LR) if not args.configs or c in args.configs.split(",")]
    result = {"env": env_info(sys.argv if argv is None else argv), "steps": args.steps,
              "late_steps": args.late_steps, "late_lr": LATE_LR, "models": {}}
    kept = {}
    if args.keep:
        with open(args.keep) as f:
            old = json.load(f)
        if (old["steps"], old["late_steps"], old["late_lr"]) != (args.steps, args.late_steps,
                                                                 LATE_LR):
            raise SystemExit(f"--keep {args.keep}: its steps differ from this run's")
        kept = old["models"]
        result["kept_from"] = {"file": os.path.relpath(args.keep),
                               "env": old.get("kept_from", {}).get("env", old["env"])}
    with jax.numpy_dtype_promotion("standard"):
        for model in args.models.split(","):
            length = MODELS[model](0)[2]
            val_batches = [jnp.asarray(b) for b in
                           D.sample_batches(corpus.val, 4, BATCH, length, 12345)]
            runs = {}
            for config in configs(LR):   # the kept runs, in the table's order
                if config not in names and config in kept.get(model, {}):
                    runs[config] = kept[model][config]
            for config in names:
                seeds = range(args.seeds) if config == "f32-master" else range(1)
                runs[config] = []
                for s in seeds:
                    r = train(model, config, s, args.steps, args.late_steps, corpus,
                              val_batches)
                    runs[config].append(r)
                    print(f"{model:5s} {config:12s} seed {s} val {r['val_main']:.4f} -> "
                          f"{r['val']:.4f} (late gain {r['late_gain']:+.4f}, moved "
                          f"{r['moved']:.3f}) {r['bytes_per_param']:.2f} B/param "
                          f"({r['train_s']:.0f} s)", flush=True)
            result["models"][model] = {c: runs[c] for c in configs(LR) if c in runs}
            write(result, args.out)   # after each model: a partial result survives


def summary(runs) -> dict:
    """Per configuration: bytes, final loss, late gain and its fraction of the float32
    master's (seed 0's, and its seeds' mean), within the float32 seeds' final spread."""
    ref = runs["f32-master"]
    ref_gain = ref[0]["late_gain"]   # seed 0: the same initialization and batches
    mean_gain = float(np.mean([r["late_gain"] for r in ref]))
    lo, hi = min(r["val"] for r in ref), max(r["val"] for r in ref)
    out = {}
    for config, rs in runs.items():
        r = rs[0]
        out[config] = {
            "bytes": r["bytes_per_param"], "val_main": r["val_main"], "val": r["val"],
            "gain": r["late_gain"], "fraction": r["late_gain"] / ref_gain,
            "fraction_of_mean": r["late_gain"] / mean_gain,
            "moved": r["moved"], "delta": r["val"] - ref[0]["val"],
            "within": lo - 1e-9 <= r["val"] <= hi + 1e-9,
            "above": r["val"] > hi + 1e-9}
    out["_ref"] = {"gain": ref_gain, "mean_gain": mean_gain, "lo": lo, "hi": hi,
                   "gains": [r["late_gain"] for r in ref],
                   "val_mean": float(np.mean([r["val"] for r in ref]))}
    return out


def write(result, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "optim_cpu")
    for model, runs in result["models"].items():
        result.setdefault("summary", {})[model] = summary(runs)
    write_json(base + ".json", result)
    lines = ["# Training state: hifigrad.optim's configurations on two language models (CPU)",
             "", "Written by `PYTHONPATH=. python benchmarks/optim_bench.py` (its docstring has "
             f"the models and the schedule): {result['steps']} steps of warm-up and cosine "
             f"decay, then {result['late_steps']} late steps at {result['late_lr']:g}, each "
             "configuration keeping its own state. *B/param*: bytes of parameters and "
             "optimizer state per parameter, from the compiled step's "
             "`memory_analysis().argument_size_in_bytes` less the batch's and the key's. "
             "*val*: validation loss (nats per byte) after the main phase and after the late "
             "phase, and the final one less the float32 master's (seed 0: the same "
             "initialization, batches and dropout as every configuration); *late gain*: the "
             "first val minus the second, and as a fraction of the float32 master's (seed 0) "
             "and of the mean of its seeds' gains; *within "
             "spread*: whether the final loss lies within the float32 master's seeds' "
             "(\"below\": lower than every seed's); *moved*: the fraction of parameter "
             "elements the late phase changed.", ""]
    checks = []
    for model, runs in result["models"].items():
        sm = result["summary"][model]
        ref = sm["_ref"]
        rows = []
        for config in runs:
            s = sm[config]
            if config == "f32-master":   # seed 0, and all its seeds' spread
                val = f"{s['val']:.4f} (seeds {ref['lo']:.4f}-{ref['hi']:.4f})"
                gain = (f"{s['gain']:+.4f} (seeds {min(ref['gains']):+.4f}-"
                        f"{max(ref['gains']):+.4f})")
                within = "-"
            else:
                val, gain = f"{s['val']:.4f}", f"{s['gain']:+.4f}"
                within = "yes" if s["within"] else ("above" if s["above"] else "below")
            rows.append([config, f"{s['bytes']:.2f}", f"{s['val_main']:.4f}", val,
                         f"{s['delta']:+.4f}", gain, f"{s['fraction']:.2f}",
                         f"{s['fraction_of_mean']:.2f}", within, f"{s['moved']:.3f}"])
            if config != "f32-master":
                checks.append((model, config, s))
        lines += [f"## {model}", "", md_table(
            ["configuration", "B/param", "val (main)", "val (final)", "- f32-master's",
             "late gain", "/ f32-master's", "/ seeds' mean", "within spread", "moved"],
            rows), ""]
    # bytes to two decimals: the step counts (4 to 12 bytes in all) are not per parameter
    ok = [f"{m} {c} ({s['bytes']:.2f} B)" for m, c, s in checks
          if round(s["bytes"], 2) <= TARGET_BYTES and s["fraction"] >= 0.9 and not s["above"]]
    lines += [f"Configurations at most {TARGET_BYTES:g} bytes per parameter (to two decimals: "
              "the step counts, a few bytes in all, aside) that keep at least 0.9 of the "
              "float32 master's late gain and end within (or below) its seeds' spread: " +
              (", ".join(ok) or "none") + ".", ""]
    plot(result, os.path.join(out_dir, "optim_curves.png"))
    lines += ["![loss curves](optim_curves.png)", ""]
    lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in result["env"].items()), ""]
    if "kept_from" in result:
        kept = result["kept_from"]
        lines += [f"The configurations this run left out (`--keep {kept['file']}`) are that "
                  "earlier run's: " + ", ".join(f"{k} {v}" for k, v in kept["env"].items()),
                  ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", base + ".md")


def _plot_deltas(ax, curves, ref, title, start: int = 0, k: int = 15):
    """Each configuration's loss curve minus `ref`, smoothed over `k` steps: ``curves`` maps a
    configuration to (its losses, its legend label)."""
    import matplotlib.pyplot as plt

    ref = np.asarray(ref)
    colors = plt.get_cmap("tab20").colors
    for i, (config, (losses, label)) in enumerate(curves.items()):
        y = np.convolve(np.asarray(losses) - ref, np.ones(k) / k, mode="valid")
        # tab20's dark shades, then its light ones: 20 distinct colours
        ax.plot(np.arange(len(y)) + start + k, y, label=label,
                color=colors[(2 * i) % 20 + (2 * i) // 20],
                linewidth=2 if config in ("f32-master", "naive-bf16") else 1.2,
                linestyle="--" if config == "naive-bf16" else "-")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("Δ training loss (smoothed)")
    ax.legend(fontsize=6)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    steps = result["steps"]
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8.4), squeeze=False)
    for col, model in enumerate(models):
        runs = result["models"][model]
        # against the float32 master's seed 0: the same initialization, batches and dropout
        ref = np.asarray(runs["f32-master"][0]["losses"])
        curves = {c: (rs[0]["losses"], f"{c} ({rs[0]['bytes_per_param']:.1f} B)")
                  for c, rs in runs.items()}
        _plot_deltas(axes[0, col], {c: (v[0][:steps], v[1]) for c, v in curves.items()},
                     ref[:steps], f"{model}: training loss minus the float32 master's")
        if result["late_steps"]:
            _plot_deltas(axes[1, col], {c: (v[0][steps:], v[1]) for c, v in curves.items()},
                         ref[steps:], f"{model}, late phase (lr {result['late_lr']:g})",
                         start=steps)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
