"""Fidelity benchmark: gradient SQNR vs the float32 model across model families.

Each row is a model with float32 master parameters that the loss casts to the compute dtype
(inputs too), with the loss itself in float32. For each row the gradient with respect to the
master parameters is taken

* ``f32``: float32 forward, `jax.grad`: the reference;
* ``jax bf16`` / ``jax fp16``: the model in bf16 / fp16, `jax.grad` (backward in that dtype);
* ``jax fp16 LS``: the same with static loss scaling: the loss multiplied by ``2^k`` and the
  gradient divided by it, ``k`` chosen per row by one fixed rule: the largest ``k <= 15`` whose
  fp16 gradient is finite (start at 2^15, the usual initial scale, and halve on overflow, as
  dynamic loss scaling does in its first steps);
* ``hg bf16 exact`` / ``hg bf16 fast`` / ``hg fp16``: the same forwards, `hg.grad` (float32
  backward; ``fast``: bf16 matmul operands with float32 accumulation);

and compared with the reference: SQNR ``10 log10(|g_f32|^2 / |g - g_f32|^2)`` over all
parameters, and the fraction of gradient entries that are exactly zero where the reference's
are not (underflow).

The forward's share: ``hg.grad`` runs an exact float32 backward over the residuals the
low-precision forward saved, the best any backward can do over that forward; what separates it
from the float32 model is the forward's own rounding. A row is called *forward-limited* in bf16
when ``hg bf16 exact`` is less than 3 dB above ``jax bf16``: the backward's precision then
accounts for at most half of ``jax.grad``'s error power.

Rows: a pre-LN transformer (the demo's GPT), a ResNet with BatchNorm, an LSTM and an LRU-style
diagonal linear recurrence (the demo's recurrent block) over T = 64 / 512 / 2048, a 64-microbatch
gradient accumulation in a `lax.scan`, and a 48-block scanned residual MLP.

Run from the repository root::

    PYTHONPATH=. python benchmarks/fidelity_bench.py

It writes ``benchmarks/results/fidelity_cpu.md`` and ``fidelity_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import _common as C  # noqa: E402

import hifigrad as hg  # noqa: E402
from hifigrad.demo import model as gpt  # noqa: E402
from hifigrad.demo import recurrent as lru  # noqa: E402

BF16, FP16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
MAX_LOG2_SCALE = 15
METHODS = ("jax bf16", "jax fp16", "jax fp16 LS", "hg bf16 exact", "hg bf16 fast", "hg fp16")


@dataclasses.dataclass
class Row:
    name: str
    family: str
    loss: Callable  # (params, inputs, dtype) -> float32 scalar
    params: dict
    inputs: object


def _normal(rng, shape, std):
    return jnp.asarray((std * rng.standard_normal(shape)).astype(np.float32))


def _cast(tree, dt):
    return jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                        tree)


# ------------------------------------------------------------------------------ models

def transformer_row(args) -> Row:
    cfg = gpt.ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 256, (8, cfg.seq_len + 1)), jnp.int32)
    return Row("pre-LN transformer (4 blocks, d=64, seq 64)", "transformer",
               lambda p, x, dt: gpt.loss_fn(cfg, p, x, dt), gpt.init_params(0, cfg), tokens)


def _batch_norm(x, scale, bias, eps=1e-5):
    """Training-mode BatchNorm over N, H, W with float32 statistics (as Flax computes them),
    returned in ``x.dtype``."""
    x32 = x.astype(F32)
    mean = jnp.mean(x32, axis=(0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2), keepdims=True)
    y = ((x32 - mean) * lax.rsqrt(var + eps)).astype(x.dtype)
    return y * scale + bias


def _conv(x, w, stride=1):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def resnet_row(args) -> Row:
    rng = np.random.default_rng(2)
    widths = (16, 32, 64)

    def conv_w(cin, cout):
        return _normal(rng, (3, 3, cin, cout), math.sqrt(2.0 / (9 * cin)))

    params = {"stem": conv_w(3, widths[0]), "blocks": []}
    cin = widths[0]
    for w in widths:
        for _ in range(2):
            blk = {"c1": conv_w(cin, w), "s1": jnp.ones((w,)), "b1": jnp.zeros((w,)),
                   "c2": conv_w(w, w), "s2": jnp.ones((w,)), "b2": jnp.zeros((w,))}
            if cin != w:
                blk["proj"] = _normal(rng, (1, 1, cin, w), math.sqrt(1.0 / cin))
            params["blocks"].append(blk)
            cin = w
    params["head"] = _normal(rng, (widths[-1], 10), 1.0 / math.sqrt(widths[-1]))
    images = jnp.asarray(rng.standard_normal((16, 16, 16, 3)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 10, (16,)), jnp.int32)

    def loss(p, inputs, dt):
        x, y = inputs
        p = _cast(p, dt)
        h = jax.nn.relu(_conv(x.astype(dt), p["stem"]))
        k = 0
        for i, _ in enumerate(widths):
            for j in range(2):
                b = p["blocks"][k]
                k += 1
                stride = 2 if (j == 0 and i > 0) else 1
                r = jax.nn.relu(_batch_norm(_conv(h, b["c1"], stride), b["s1"], b["b1"]))
                r = _batch_norm(_conv(r, b["c2"]), b["s2"], b["b2"])
                sc = _conv(h, b["proj"], stride) if "proj" in b else h
                h = jax.nn.relu(sc + r)
        logits = (jnp.mean(h, axis=(1, 2)) @ p["head"]).astype(F32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return Row("ResNet with BatchNorm (6 blocks, 16-64 ch, 16x16)", "resnet", loss, params,
               (images, labels))


def lstm_row(T: int) -> Row:
    rng = np.random.default_rng(3)
    D, H, B = 32, 64, 8
    params = {"wx": _normal(rng, (D, 4 * H), 1 / math.sqrt(D)),
              "wh": _normal(rng, (H, 4 * H), 1 / math.sqrt(H)),
              "b": jnp.zeros((4 * H,))}
    x = jnp.asarray(rng.standard_normal((T, B, D)).astype(np.float32))

    def loss(p, x, dt):
        p = _cast(p, dt)
        xw = jnp.einsum("tbd,dg->tbg", x.astype(dt), p["wx"]) + p["b"]

        def step(carry, xw_t):
            h, c = carry
            z = xw_t + h @ p["wh"]
            i, f, g, o = jnp.split(z, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((B, H), dt)
        _, hs = lax.scan(step, (zeros, zeros), xw)
        return jnp.mean(jnp.square(hs.astype(F32)))

    return Row(f"LSTM, T={T} (d=32, hidden 64, batch 8)", "lstm", loss, params, x)


def ssm_row(T: int) -> Row:
    cfg = lru.RecurrentConfig(n_layers=2, d_model=32, d_state=64, seq_len=T)
    full = lru.init_params(4, cfg)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, T, cfg.d_model)).astype(np.float32))

    def loss(p, x, dt):
        out = gpt.lax_scan_blocks(lambda c, b: lru.block(cfg, c, b), x.astype(dt), p)
        return jnp.mean(jnp.square((out - x.astype(dt)).astype(F32)))

    return Row(f"diagonal linear recurrence (LRU), T={T} (2 blocks, d=32, state 64, batch 4)",
               "ssm", loss, full["blocks"], x)


def microbatch_row(args) -> Row:
    rng = np.random.default_rng(5)
    D, Hd, n_mb, mb = 64, 256, 64, 8
    params = {"w1": _normal(rng, (D, Hd), 1 / math.sqrt(D)), "b1": jnp.zeros((Hd,)),
              "w2": _normal(rng, (Hd, 10), 1 / math.sqrt(Hd)), "b2": jnp.zeros((10,))}
    x = jnp.asarray(rng.standard_normal((n_mb, mb, D)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, (n_mb, mb)), jnp.int32)

    def loss(p, inputs, dt):
        x, y = inputs
        p = _cast(p, dt)  # cast once, outside the loop over microbatches

        def step(acc, xy):
            xb, yb = xy
            h = jax.nn.gelu(xb.astype(dt) @ p["w1"] + p["b1"])
            logp = jax.nn.log_softmax((h @ p["w2"] + p["b2"]).astype(F32))
            nll = -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))
            return acc + nll / n_mb, None

        total, _ = lax.scan(step, jnp.zeros((), F32), (x, y))
        return total

    return Row("64-microbatch gradient accumulation (MLP 64-256-10, lax.scan)", "microbatch",
               loss, params, (x, y))


def deep_mlp_row(args) -> Row:
    rng = np.random.default_rng(6)
    L, D, Hd, B = 48, 64, 128, 16
    params = {"ln_s": jnp.ones((L, D)), "ln_b": jnp.zeros((L, D)),
              "w1": _normal(rng, (L, D, Hd), 1 / math.sqrt(D)), "b1": jnp.zeros((L, Hd)),
              "w2": _normal(rng, (L, Hd, D), 1 / math.sqrt(Hd * 2 * L)), "b2": jnp.zeros((L, D))}
    x = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))
    target = jnp.asarray(rng.standard_normal((B, D)).astype(np.float32))

    def loss(p, inputs, dt):
        x, t = inputs

        def block(c, q):
            q = _cast(q, dt)
            c32 = c.astype(F32)
            mu = jnp.mean(c32, -1, keepdims=True)
            var = jnp.mean(jnp.square(c32 - mu), -1, keepdims=True)
            h = ((c32 - mu) * lax.rsqrt(var + 1e-5)).astype(dt) * q["ln_s"] + q["ln_b"]
            h = jax.nn.gelu(h @ q["w1"] + q["b1"])
            return c + (h @ q["w2"] + q["b2"]), None

        out, _ = lax.scan(block, x.astype(dt), p)
        return jnp.mean(jnp.square(out.astype(F32) - t))

    return Row("48-block scanned residual MLP (d=64, hidden 128, batch 16)", "deep-mlp", loss,
               params, (x, target))


# ------------------------------------------------------------------------------ measuring

def _flat64(tree) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(tree)])


def _grad_program(row: Row, dt, kind: str, opts):
    def scaled_loss(p, x, s):
        return row.loss(p, x, dt) * s

    if kind == "jax":
        g = jax.grad(scaled_loss)
    else:
        g = hg.grad(scaled_loss, policy=hg.Policy(matmul=kind))
    t = time.perf_counter()
    compiled = jax.jit(g).lower(row.params, row.inputs, jnp.float32(1)).compile(
        compiler_options=opts)
    return compiled, time.perf_counter() - t


def measure(row: Row, opts) -> dict:
    t0 = time.perf_counter()
    one = jnp.float32(1)
    ref_prog, _ = _grad_program(row, F32, "jax", opts)
    ref = _flat64(ref_prog(row.params, row.inputs, one))
    out = {"name": row.name, "family": row.family,
           "n_params": int(sum(a.size for a in jax.tree.leaves(row.params))),
           "ref_zero_frac": float(np.mean(ref == 0)), "sqnr_db": {}, "underflow_frac": {},
           "compile_s": {}}

    def record(method, g):
        g = np.asarray(g)
        out["sqnr_db"][method] = C.sqnr_db(ref, g)
        out["underflow_frac"][method] = float(np.mean((g == 0) & (ref != 0)))

    for method, dt, kind in (("jax bf16", BF16, "jax"), ("jax fp16", FP16, "jax"),
                             ("hg bf16 exact", BF16, "exact"), ("hg bf16 fast", BF16, "fast"),
                             ("hg fp16", FP16, "exact")):
        try:
            prog, secs = _grad_program(row, dt, kind, opts)
        except Exception as e:  # reported in the table, the other methods still run
            out["sqnr_db"][method] = None
            out.setdefault("errors", {})[method] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        out["compile_s"][method] = secs
        record(method, _flat64(prog(row.params, row.inputs, one)))
        if method == "jax fp16":
            for k in range(MAX_LOG2_SCALE, -1, -1):  # the static loss-scale rule (docstring)
                s = jnp.float32(2.0**k)
                g = _flat64(prog(row.params, row.inputs, s)) / 2.0**k
                if np.all(np.isfinite(g)):
                    break
            out["loss_scale_log2"] = k
            record("jax fp16 LS", g)
    j, h = out["sqnr_db"].get("jax bf16"), out["sqnr_db"].get("hg bf16 exact")
    out["bf16_forward_limited"] = (None if j is None or h is None or not math.isfinite(j)
                                   or not math.isfinite(h) else bool(h - j < 3.0))
    out["wall_s"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------ report

def _db(v) -> str:
    if v is None:
        return "error"
    if isinstance(v, float) and math.isnan(v):
        return "non-finite"
    return C.fmt_db(v)


def _pct(v) -> str:
    if v is None:
        return "-"
    return "0" if v == 0 else f"{100 * v:.2g}%"


def markdown(results: dict) -> str:
    env = results["environment"]
    rows = results["rows"]
    headers = ["row", *METHODS, "hg − jax bf16 (dB)", "bf16 forward-limited"]
    body = []
    for r in rows:
        s = r["sqnr_db"]
        gain = (None if s.get("jax bf16") is None or s.get("hg bf16 exact") is None
                else s["hg bf16 exact"] - s["jax bf16"])
        cells = [_db(s.get(m)) for m in METHODS]
        cells[METHODS.index("jax fp16 LS")] += f" (2^{r.get('loss_scale_log2', '?')})"
        body.append([r["name"], *cells, "-" if gain is None or not math.isfinite(gain)
                     else f"{gain:+.1f}",
                     {True: "yes", False: "no", None: "-"}[r["bf16_forward_limited"]]])
    under = [[r["name"], _pct(r["ref_zero_frac"]), *[_pct(r["underflow_frac"].get(m))
                                                     for m in METHODS]] for r in rows]
    lines = [
        "# Fidelity benchmark: gradient SQNR vs the float32 model", "",
        f"Command: `{env['command']}`  ",
        f"Date: {env['date']}; JAX {env['jax']} (jaxlib {env['jaxlib']}), Python "
        f"{env['python']}, backend {env['backend']}; {env['cpu']}; "
        f"XLA_FLAGS={env['xla_flags'] or '(none)'}; total {results['wall_s']:.0f} s.", "",
        "## Gradient SQNR vs the f32 model (dB, higher is better)", "",
        C.md_table(headers, body), "",
        "*jax fp16 LS*: static loss scale 2^k, k the largest <= 15 whose fp16 gradient is "
        "finite (in parentheses). *hg − jax bf16*: what the float32 backward recovers. "
        "*bf16 forward-limited*: hg bf16 exact is less than 3 dB above jax bf16, i.e. the bf16 "
        "forward's own rounding (the error hg.grad leaves, since its backward is exact over "
        "the forward's residuals) is at least half of jax.grad's error power.", "",
        "## Gradient entries that underflow to zero (zero where the f32 gradient is not)", "",
        C.md_table(["row", "f32 zero entries", *METHODS], under), "",
    ]
    errors = [(r["name"], m, e) for r in rows for m, e in r.get("errors", {}).items()]
    if errors:
        lines += ["## Errors", ""] + [f"- {n}, {m}: {e}" for n, m, e in errors] + [""]
    lines += ["## Conclusions (computed from the numbers above)", ""]
    lines += [f"- {c}" for c in conclusions(rows)]
    return "\n".join(lines) + "\n"


def conclusions(rows) -> list[str]:
    out = []

    def gain(r, a, b):
        x, y = r["sqnr_db"].get(a), r["sqnr_db"].get(b)
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            return None
        return x - y

    gains = [(gain(r, "hg bf16 exact", "jax bf16"), r["name"]) for r in rows]
    gains = [g for g in gains if g[0] is not None]
    if gains:
        best = max(gains)
        out.append(f"Largest bf16 gain of hg.grad over jax.grad: {best[0]:+.1f} dB "
                   f"({best[1]}); smallest: {min(gains)[0]:+.1f} dB ({min(gains)[1]}).")
    limited = [r["name"] for r in rows if r["bf16_forward_limited"]]
    if limited:
        out.append("bf16 forward-limited rows (hg within 3 dB of jax.grad): "
                   + "; ".join(limited) + ".")
    for fam in ("lstm", "ssm"):
        fr = [r for r in rows if r["family"] == fam]
        if len(fr) >= 2:
            parts = []
            for m in ("jax bf16", "hg bf16 exact", "jax fp16", "hg fp16"):
                a, b = fr[0]["sqnr_db"].get(m), fr[-1]["sqnr_db"].get(m)
                if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
                    parts.append(f"{m} {a:.1f} → {b:.1f} dB")
            out.append(f"{fr[0]['family'].upper()} from its shortest to its longest T: "
                       + "; ".join(parts) + ".")
    fp = [(gain(r, "hg fp16", "jax fp16 LS"), r["name"]) for r in rows]
    fp = [g for g in fp if g[0] is not None]
    if fp:
        worse = [n for g, n in fp if g < 0]
        out.append(f"hg fp16 (no loss scaling) vs jax fp16 with the static loss scale: "
                   f"{min(fp)[0]:+.1f} to {max(fp)[0]:+.1f} dB"
                   + (f"; below it on: {'; '.join(worse)}" if worse else "") + ".")
    uf = [(r["underflow_frac"].get("jax fp16") or 0.0, r["name"]) for r in rows]
    uf = [u for u in uf if u[0] > 0]
    if uf:
        out.append("fp16 jax.grad without loss scaling loses gradient entries to underflow on: "
                   + "; ".join(f"{n} ({100 * u:.2g}%)" for u, n in sorted(uf, reverse=True))
                   + ".")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="64,512,2048",
                    help="sequence lengths of the LSTM and SSM rows (default 64,512,2048)")
    ap.add_argument("--rows", default="all",
                    help="comma-separated families: transformer,resnet,lstm,ssm,microbatch,"
                         "deep-mlp (default all)")
    ap.add_argument("--opt-level", type=int, default=1,
                    help="XLA CPU backend optimisation level (compile time is most of the run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fidelity_cpu"),
                    help="output path without extension (writes PATH.md and PATH.json)")
    args = ap.parse_args(argv)
    lengths = [int(t) for t in args.lengths.split(",") if t.strip()]
    fams = None if args.rows == "all" else set(args.rows.split(","))
    builders = [("transformer", lambda: [transformer_row(args)]),
                ("resnet", lambda: [resnet_row(args)]),
                ("lstm", lambda: [lstm_row(T) for T in lengths]),
                ("ssm", lambda: [ssm_row(T) for T in lengths]),
                ("microbatch", lambda: [microbatch_row(args)]),
                ("deep-mlp", lambda: [deep_mlp_row(args)])]
    opts = ({"xla_backend_optimization_level": args.opt_level}
            if jax.default_backend() == "cpu" else None)
    env = C.env_info([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    rows = []
    for fam, build in builders:
        if fams is not None and fam not in fams:
            continue
        for row in build():
            r = measure(row, opts)
            rows.append(r)
            print(f"{r['name']}: " + ", ".join(f"{m} {_db(r['sqnr_db'].get(m))}"
                                               for m in METHODS)
                  + f" ({r['wall_s']:.0f} s)", flush=True)
    results = {"environment": env, "rows": rows, "wall_s": time.perf_counter() - t0}
    md = markdown(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    C.write_json(args.out + ".json", results)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
