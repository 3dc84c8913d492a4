"""GPU benchmark: step time, TFLOP/s, temp memory and gradient SQNR of every backward hifigrad
offers, on a GPT-style decoder and on a scanned MLP, at sizes that load an H200.

Models (sizes are flags; the defaults are the GPU sizes, ``--small`` is a CPU preset):

* ``gpt``: 12 scanned pre-RMSNorm blocks (causal attention with 16 heads through
  ``jax.nn.dot_product_attention(..., implementation='xla')``, GELU MLP 4x), d=1024, vocab 8192
  with tied embeddings and fixed sinusoidal positions, batch 8 x 1024 tokens: 159.4M float32
  master parameters, cast to the compute dtype inside the loss; loss (log-softmax) in float32.
* ``mlp``: 32 scanned blocks ``c + W2 gelu(W1 LN(c))`` (LayerNorm without affine parameters, no
  biases), d=1024, hidden 4096, 8192 tokens, float32 carry, bf16 compute inside each block;
  loss ``mean(c**2)`` of the last carry.

Every row differentiates the same loss with respect to the same float32 master parameters, so
all gradients are float32 and comparable. The reference for SQNR is ``jax.grad`` of the float32
model under ``jax.default_matmul_precision('highest')``; each table's ratio column is over its
baseline row (``jax.grad bf16`` for the GPT, the bf16 remat scan for the MLP).

Columns: step time (median of ``--steps`` calls of the compiled gradient after one warm-up
call, ``block_until_ready``); ratio vs the baseline; TFLOP/s and % of ``--peak-tflops``
(default 790: an 8192^3 bf16 matmul on the H200) from the analytic model FLOP count (matmuls
and attention products, forward + backward = 3x forward, recomputation not counted), because
XLA's ``cost_analysis()`` counts a while loop's body once, not once per step (its figure is
shown as its own column); temp bytes (``compile().memory_analysis().temp_size_in_bytes``);
gradient SQNR vs the reference; grad dtypes; compile time (``jit(g).lower(...).compile()``,
tracing and hifigrad's rewrite included). A row that fails reports its error and the others
run; ``--budget-s`` stops starting rows when the time is spent (those rows say so).

Run from the repository root::

    PYTHONPATH=. python benchmarks/gpu_bench.py               # GPU sizes, both models
    PYTHONPATH=. python benchmarks/gpu_bench.py --small       # CPU preset

It writes ``benchmarks/results/<model>_<platform>.md`` and ``.json`` (``gpt_gpu``,
``mlp_gpu`` on a GPU; ``gpt_cpu_small``, ``mlp_cpu_small`` with ``--small`` on CPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import env_info, fmt_db, md_table, write_json  # noqa: E402

import hifigrad as hg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
F32, BF16 = jnp.float32, jnp.bfloat16
GPT_CODECS = ["none", "bf16", "fp8_e4m3", "int8", "int4"]
MLP_CODECS = ["bf16", "fp8_e4m3", "int8", "int4", "int2"]
MiB = 2**20

# Sizes: (GPU default, --small preset for CPU).
GPT_SIZES = {"blocks": (12, 2), "d": (1024, 64), "heads": (16, 4), "mlp": (4, 4),
             "vocab": (8192, 256), "batch": (8, 2), "seq": (1024, 32)}
MLP_SIZES = {"mlp_blocks": (32, 4), "mlp_d": (1024, 64), "mlp_hidden": (4096, 256),
             "tokens": (8192, 128)}


# ----------------------------------------------------------------------------- policies

def policy_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(hg.Policy)}


def describe_policy(p) -> str:
    """A policy's matmul mode as the backward will run it here (``auto -> fast`` etc.)."""
    s = p.matmul
    if hasattr(p, "resolved_matmul"):
        try:
            r = p.resolved_matmul()
            if r != s:
                s = f"{s} -> {r}"
        except Exception:  # noqa: BLE001 - a description only
            pass
    prec = getattr(p, "matmul_precision", None)
    if prec is not None:
        s += f", matmul_precision={prec}"
    return s


def policy_key(p) -> tuple:
    """Two policies with the same key trace the same backward on this platform."""
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    if hasattr(p, "resolved_matmul"):
        try:
            d["matmul"] = p.resolved_matmul()
        except Exception:  # noqa: BLE001
            pass
    return tuple(sorted((k, str(v)) for k, v in d.items()))


# ----------------------------------------------------------------------------- GPT model

def gpt_init(key, *, blocks, d, mlp, vocab):
    ks = jax.random.split(key, 5)
    L, h = blocks, mlp * d

    def normal(k, shape, std):
        return jax.random.normal(k, shape, F32) * np.float32(std)

    return {
        "embed": normal(ks[0], (vocab, d), 1.0),
        "blocks": {
            "g1": jnp.ones((L, d), F32),
            "wqkv": normal(ks[1], (L, d, 3 * d), d ** -0.5),
            "wo": normal(ks[2], (L, d, d), d ** -0.5 / math.sqrt(2 * L)),
            "g2": jnp.ones((L, d), F32),
            "w1": normal(ks[3], (L, d, h), d ** -0.5),
            "w2": normal(ks[4], (L, h, d), h ** -0.5 / math.sqrt(2 * L)),
        },
        "gf": jnp.ones((d,), F32),
    }


def rms_norm(x, g, eps=1e-6):
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * lax.rsqrt(ms + jnp.asarray(eps, x.dtype)) * g


def sinusoid(T, d):
    pos = np.arange(T, dtype=np.float64)[:, None]
    inv = np.exp(-math.log(10000.0) * np.arange(0, d, 2, dtype=np.float64) / d)[None, :]
    out = np.zeros((T, d), np.float64)
    out[:, 0::2], out[:, 1::2] = np.sin(pos * inv), np.cos(pos * inv)
    return out.astype(np.float32)


def gpt_block(x, p, *, heads, dtype, attn):
    """Pre-RMSNorm block. ``x`` is the residual stream (its dtype is the carry's); everything
    else runs in ``dtype``; each branch's output is added to the stream in the stream's dtype."""
    B, T, d = x.shape
    h = rms_norm(x.astype(dtype), p["g1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(B, T, heads, d // heads) for t in (q, k, v))
    if callable(attn):  # a kernel of one's own: attn(q, k, v) -> o, causal, [B, T, H, D]
        o = attn(q, k, v)
    else:
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attn)
    x = x + (o.reshape(B, T, d) @ p["wo"]).astype(x.dtype)
    h = rms_norm(x.astype(dtype), p["g2"])
    return x + (jax.nn.gelu(h @ p["w1"]) @ p["w2"]).astype(x.dtype)


def make_gpt_loss(*, heads, dtype=BF16, scan="lax", codec=None, save="inputs", attn="xla",
                  carry_dtype=None):
    """The GPT loss ``loss(params, tokens, targets)``.

    ``scan``: ``'lax'`` (plain `lax.scan`), ``'remat'`` (`lax.scan` of `jax.checkpoint(block)`)
    or ``'hg'`` (`hg.scan(block, codec=codec, save=save)`). ``carry_dtype`` is the residual
    stream's dtype between blocks (default: ``dtype``; the hg.scan rows use float32).
    """
    carry_dtype = dtype if carry_dtype is None else carry_dtype
    block = lambda c, bp: (gpt_block(c, bp, heads=heads, dtype=dtype, attn=attn), None)

    def loss(params, tokens, targets):
        p = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
        T, d = tokens.shape[1], p["embed"].shape[1]
        x = (p["embed"][tokens] + jnp.asarray(sinusoid(T, d), dtype)).astype(carry_dtype)
        if scan == "lax":
            x, _ = lax.scan(block, x, p["blocks"])
        elif scan == "remat":
            x, _ = lax.scan(jax.checkpoint(block), x, p["blocks"])
        else:
            x, _ = hg.scan(block, x, p["blocks"], codec=codec, save=save)
        h = rms_norm(x.astype(dtype), p["gf"])
        logits = (h @ p["embed"].T).astype(F32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


def gpt_flops(cfg) -> float:
    """Analytic FLOPs of one gradient step: 3x the forward's matmul and attention products
    (full T x T score matrices, as XLA's attention computes them); recomputation not counted."""
    d, T, L, V = cfg.d, cfg.seq, cfg.blocks, cfg.vocab
    per_token = L * (2 * d * d * (3 + 1 + 2 * cfg.mlp) + 4 * T * d) + 2 * d * V
    return 3.0 * per_token * cfg.batch * T


# ----------------------------------------------------------------------------- MLP model

def mlp_init(key, *, blocks, d, hidden):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (blocks, d, hidden), F32) * np.float32(d ** -0.5),
        "w2": jax.random.normal(k2, (blocks, hidden, d), F32)
        * np.float32(hidden ** -0.5 / math.sqrt(blocks)),
    }


def layer_norm(x, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + jnp.asarray(eps, x.dtype))


def mlp_body(dtype):
    """One block on a float32 carry: ``c + W2 gelu(W1 LN(c))``, computed in ``dtype``."""
    def body(c, p):
        x = c.astype(dtype)
        w1, w2 = p["w1"].astype(dtype), p["w2"].astype(dtype)
        return c + (jax.nn.gelu(layer_norm(x) @ w1) @ w2).astype(c.dtype), None
    return body


def make_mlp_loss(*, dtype=BF16, scan="remat", codec=None, save="inputs"):
    body = mlp_body(dtype)

    def loss(params, x):
        if scan == "remat":
            c, _ = lax.scan(jax.checkpoint(body), x, params)
        else:
            c, _ = hg.scan(body, x, params, codec=codec, save=save)
        return jnp.mean(jnp.square(c))

    return loss


def mlp_flops(cfg) -> float:
    return 3.0 * cfg.mlp_blocks * cfg.tokens * 2 * 2 * cfg.mlp_d * cfg.mlp_hidden


# ----------------------------------------------------------------------------- rows

@dataclasses.dataclass
class Row:
    name: str
    build: Callable[[], Callable] | None  # () -> gradient function of (params, *data)
    what: str = ""
    precision: str | None = None  # jax.default_matmul_precision while tracing
    skip: str | None = None  # reported without building
    key: tuple | None = None  # rows with equal keys run the same program: measured once


def cudnn_unavailable() -> str | None:
    """Why the cuDNN attention row cannot run here, or None."""
    try:
        dev = jax.devices()[0]
        version = str(getattr(dev.client, "platform_version", "")).lower()
    except Exception as e:  # noqa: BLE001
        return f"skipped: no device ({e})"
    if dev.platform != "gpu" or "rocm" in version:
        return "skipped: cuDNN needs a CUDA GPU"
    return None


def _hg(loss, policy=None):
    return (lambda: hg.grad(loss)) if policy is None else (lambda: hg.grad(loss, policy=policy))


def _jax(loss):
    return lambda: jax.grad(loss)


def _policy_row(name, loss, kwargs, what):
    """An hg.grad row with ``Policy(**kwargs)``; a policy this hifigrad lacks reports its
    error (the row is kept, so tables from before and after a Policy change line up)."""
    try:
        p = hg.Policy(**kwargs)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return Row(name, None, what, skip=f"cannot build: {type(e).__name__}: {e}")
    return Row(name, _hg(loss, p), f"{what} [{describe_policy(p)}]", key=("hg", policy_key(p)))


def gpt_rows(cfg) -> list[Row]:
    H = cfg.heads
    plain = make_gpt_loss(heads=H)
    remat = make_gpt_loss(heads=H, scan="remat")
    f32 = make_gpt_loss(heads=H, dtype=F32)
    default = hg.Policy()
    rows = [
        Row("jax.grad f32 highest", _jax(f32), "f32 model, precision='highest' (reference)",
            precision="highest"),
        Row("jax.grad f32 default", _jax(f32), "f32 model, default precision (TF32 on GPU)"),
        Row("jax.grad bf16", _jax(plain), "bf16 model, bf16 backward (baseline)"),
        Row("hg.grad bf16 default", _hg(plain),
            f"bf16 model, hg.grad, Policy() [{describe_policy(default)}]",
            key=("hg", policy_key(default))),
        _policy_row("hg.grad bf16 exact", plain, {"matmul": "exact"}, "Policy(matmul='exact')"),
        _policy_row("hg.grad bf16 fast", plain, {"matmul": "fast"}, "Policy(matmul='fast')"),
        _policy_row("hg.grad bf16 auto", plain, {"matmul": "auto"}, "Policy(matmul='auto')"),
    ]
    if "matmul_precision" in policy_fields():
        rows.append(_policy_row("hg.grad bf16 exact highest", plain,
                                {"matmul": "exact", "matmul_precision": "highest"},
                                "Policy(matmul='exact', matmul_precision='highest')"))
    rows.append(Row("jax.grad bf16 remat scan", _jax(remat),
                    "lax.scan(jax.checkpoint(block)), bf16 carry"))
    fast = _policy_row("hg.grad fast remat scan", remat, {"matmul": "fast"},
                       "hg.grad Policy(matmul='fast') over the remat scan")
    fast.key = None
    rows.append(fast)
    for save in ("inputs", "residuals"):
        for c in GPT_CODECS:
            loss = make_gpt_loss(heads=H, scan="hg", codec=c, save=save, carry_dtype=F32)
            sfx = "" if save == "inputs" else " residuals"
            rows.append(Row(f"jax.grad hg.scan{sfx} {c}", _jax(loss),
                            f"jax.grad over hg.scan(codec='{c}', save='{save}'), f32 carry"))
    loss = make_gpt_loss(heads=H, scan="hg", codec="fp8_e4m3", carry_dtype=F32)
    rows.append(Row("hg.grad hg.scan fp8_e4m3", _hg(loss),
                    f"hg.grad (Policy() [{describe_policy(default)}]) over "
                    f"hg.scan(codec='fp8_e4m3')"))
    why = cudnn_unavailable()
    cud = make_gpt_loss(heads=H, attn="cudnn")
    rows.append(Row("jax.grad bf16 cudnn attention", _jax(cud),
                    "bf16 model, implementation='cudnn'", skip=why))
    rows.append(Row("hg.grad bf16 cudnn attention", _hg(cud),
                    f"bf16 model, implementation='cudnn', hg.grad Policy() "
                    f"[{describe_policy(default)}]", skip=why))
    return rows


def mlp_rows(cfg) -> list[Row]:
    default = hg.Policy()
    rows = [
        Row("f32 remat scan highest", _jax(make_mlp_loss(dtype=F32)),
            "lax.scan(jax.checkpoint(block)) in f32, precision='highest' (reference)",
            precision="highest"),
        Row("f32 remat scan", _jax(make_mlp_loss(dtype=F32)),
            "the same at default precision (TF32 on GPU)"),
        Row("bf16 remat scan", _jax(make_mlp_loss()),
            "lax.scan(jax.checkpoint(block)), bf16 compute (baseline)"),
    ]
    for grad in ("jax.grad", "hg.grad"):
        for save in ("inputs", "residuals"):
            for c in MLP_CODECS:
                loss = make_mlp_loss(scan="hg", codec=c, save=save)
                sfx = "" if save == "inputs" else " residuals"
                extra = "" if grad == "jax.grad" else f", Policy() [{describe_policy(default)}]"
                rows.append(Row(f"{grad} hg.scan{sfx} {c}",
                                _jax(loss) if grad == "jax.grad" else _hg(loss),
                                f"{grad} over hg.scan(codec='{c}', save='{save}'){extra}"))
    return rows


# ----------------------------------------------------------------------------- measuring

def _short(e, n=200) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= n else line[:n] + "..."


@jax.jit
def _sqnr_parts(ref, got):
    """(|ref|^2, |got-ref|^2, all finite) on the device, in float32 (no host copies)."""
    rl, gl = jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)
    sig = sum(jnp.sum(jnp.square(r.astype(F32))) for r in rl)
    err = sum(jnp.sum(jnp.square(g.astype(F32) - r.astype(F32))) for r, g in zip(rl, gl))
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in gl]))
    return sig, err, finite


def sqnr(ref, got) -> float:
    if jax.tree_util.tree_structure(ref) != jax.tree_util.tree_structure(got):
        return float("nan")
    sig, err, finite = (np.asarray(v) for v in _sqnr_parts(ref, got))
    if not bool(finite):
        return float("nan")
    return math.inf if float(err) == 0.0 else 10.0 * math.log10(float(sig) / float(err))


def cost_flops(compiled) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend has it
        return None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    if not ca:
        return None
    v = ca.get("flops")
    return None if v is None or v < 0 else float(v)


def lower_row(row: Row, args) -> tuple[dict, object]:
    """Builds and lowers one row (tracing and hifigrad's rewrite happen here, in this thread).
    Never raises: errors land in ``status``. Returns (result dict, lowered or None)."""
    res = {"name": row.name, "what": row.what, "status": "ok"}
    if row.skip:
        res["status"] = row.skip
        return res, None
    stage, lowered = "build", None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            g = row.build()
            stage = "compile"
            ctx = (jax.default_matmul_precision(row.precision) if row.precision
                   else contextlib.nullcontext())
            t0 = time.perf_counter()
            with ctx:
                lowered = jax.jit(g).lower(*args)
            res["lower_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            res["status"] = f"{stage} error: {_short(e)}"
            res["traceback"] = traceback.format_exc(limit=8)
            lowered = None
    msgs = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}"
                   for w in caught})
    if msgs:
        res["warnings"] = msgs
    return res, lowered


def compile_row(lowered):
    """XLA compilation of a lowered row (may run in a worker thread). Returns
    (compiled, seconds) or raises."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0


def run_row(res: dict, compiled, args, ref, steps, is_ref) -> object:
    """Runs and times a compiled row; fills ``res``; returns its gradients (or None)."""
    res["xla_flops"] = cost_flops(compiled)
    try:
        res["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend has it
        res["temp_bytes"] = None
    stage = "run"
    try:
        grads = jax.block_until_ready(compiled(*args))  # warm-up call
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        res["step_s"] = statistics.median(times)
        res["step_all_s"] = times
        res["grad_dtypes"] = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(grads)})
        stage = "sqnr"
        res["sqnr_db"] = "reference" if is_ref else None if ref is None else sqnr(ref, grads)
        return grads
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        res["status"] = f"{stage} error: {_short(e)}"
        res["traceback"] = traceback.format_exc(limit=8)
        return None


# ----------------------------------------------------------------------------- reporting

def device_info() -> dict:
    dev = jax.devices()[0]
    info = {"device_kind": dev.device_kind, "platform": dev.platform,
            "device_count": jax.device_count(), "driver": "n/a"}
    try:
        info["platform_version"] = str(dev.client.platform_version)
    except Exception:  # noqa: BLE001
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            first = out.stdout.strip().splitlines()[0]
            name, driver, mem = (s.strip() for s in first.split(","))
            info.update(driver=driver, gpu_name=name, gpu_memory=mem)
        except Exception as e:  # noqa: BLE001
            info["driver"] = f"n/a (nvidia-smi: {_short(e, 80)})"
    return info


def _cell(v, f):
    return "-" if v is None else f(v)


def report(model, title, cfg, rows, results, baseline, flops, env, dev, elapsed, out, argv,
           quiet=False):
    base = results.get(baseline, {}).get("step_s")
    table = []
    for r in rows:
        m = results[r.name]
        ok = m["status"] == "ok" or m["status"].startswith("same program")
        step = m.get("step_s")
        tflops = flops / step / 1e12 if ok and step else None
        m["analytic_tflop_per_s"] = tflops
        m["ratio_vs_baseline"] = step / base if ok and step and base else None
        s = m.get("sqnr_db")
        table.append([
            r.name,
            m["status"].replace("|", "/"),
            _cell(step if ok else None, lambda v: f"{v * 1e3:.2f}"),
            _cell(m["ratio_vs_baseline"], lambda v: f"{v:.3f}"),
            _cell(tflops, lambda v: f"{v:.3g}"),
            _cell(tflops, lambda v: f"{100 * v / cfg.peak_tflops:.3g}"),
            _cell(m.get("xla_flops"), lambda v: f"{v / 1e9:.2f}"),
            _cell(m.get("temp_bytes"), lambda v: f"{v / MiB:.1f}"),
            "reference" if s == "reference" else _cell(s if ok else None, fmt_db),
            "/".join(m.get("grad_dtypes", [])) or "-",
            _cell(m.get("lower_s"), lambda v: f"{v:.2f}"),
            _cell(m.get("compile_s"), lambda v: f"{v:.2f}"),
            (r.what + ("; warnings: " + "; ".join(m["warnings"]) if m.get("warnings") else ""))
            .replace("|", "/"),
        ])
    headers = ["row", "status", "step (ms)", f"ratio vs {baseline}", "TFLOP/s (analytic)",
               f"% of {cfg.peak_tflops:g}", "XLA GFLOP (cost_analysis)", "temp (MiB)",
               "grad SQNR vs f32 highest (dB)", "grad dtype", "lower (s)", "XLA compile (s)",
               "what"]
    n_ok = sum(1 for m in results.values() if m["status"] == "ok")
    n_same = sum(1 for m in results.values() if m["status"].startswith("same program"))
    n_skip = sum(1 for m in results.values() if m["status"].startswith("skipped"))
    n_err = len(results) - n_ok - n_same - n_skip
    md = [
        f"# {title}",
        "",
        f"- date: {env['date']}",
        f"- command: `{env['command']}` (from the repository root)",
        f"- device: {dev['device_kind']} ({dev['platform']}, {dev['device_count']} device(s)); "
        f"driver {dev['driver']}" + (f"; {dev['gpu_name']}, {dev['gpu_memory']}"
                                     if "gpu_name" in dev else ""),
        f"- jax {env['jax']}, jaxlib {env['jaxlib']}, Python {env['python']}, hifigrad "
        f"{getattr(hg, '__version__', '?')}; XLA_FLAGS={env['xla_flags'] or '(none)'}",
        f"- model: {cfg.describe}",
        f"- step: median of {cfg.steps} calls of the compiled gradient after one warm-up call "
        f"(`block_until_ready`); TFLOP/s from the analytic count, {flops / 1e9:.2f} GFLOP per "
        f"step (3x the forward's matmul and attention products; recomputation not counted); "
        f"XLA's `cost_analysis()` flops are shown beside it but count the scanned loop body "
        f"once, not once per block; peak {cfg.peak_tflops:g} TFLOP/s (`--peak-tflops`).",
        f"- lower: tracing, hifigrad's rewrite and lowering of `jax.jit(grad)`, one row at a "
        f"time; XLA compile: `lowered.compile()`, {cfg.compile_threads} at a time in threads "
        f"(each row's wall time, under that contention), all finished before any row is timed; "
        f"rows marked 'same program' share an earlier row's policy as resolved here.",
        f"- rows: {n_ok} measured, {n_same} shared with an identical program, {n_skip} skipped, "
        f"{n_err} failed; run time {elapsed:.0f} s.",
        "",
        md_table(headers, table),
        "",
    ]
    if any(m.get("traceback") for m in results.values()):
        md += ["## Errors", ""]
        for name, m in results.items():
            if m.get("traceback"):
                md += [f"### {name}", "", "```", m["traceback"].rstrip(), "```", ""]
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    json_rows = [{k: v for k, v in results[r.name].items() if k != "grads"} for r in rows]
    write_json(out + ".json", {"model": model, "env": env, "device": dev,
                               "config": vars(cfg.args), "analytic_flops_per_step": flops,
                               "baseline": baseline, "rows": json_rows, "elapsed_s": elapsed,
                               "argv": argv})
    if not quiet:
        print("\n".join(md), flush=True)
        print(f"wrote {out}.md and {out}.json", flush=True)


def run_model(model, cfg, deadline, env, dev, argv, run_deadline=None):
    """One model's table, in three phases so that timing never overlaps compilation:
    lower every row in order (Python: tracing and hifigrad's rewrite), compiling each in a pool
    of ``--compile-threads`` threads as soon as it is lowered; wait for the compiles; then run
    and time the rows one by one. The report is rewritten after every row, so a run cut short
    keeps what it measured. ``deadline``: no row is lowered after ``lower_frac`` of the time
    left, and compiles still running at the deadline are given up. ``run_deadline`` (default
    ``deadline``): no compiled row starts running after it (running a compiled row costs a few
    steps; its compile is already paid)."""
    run_deadline = deadline if run_deadline is None else run_deadline
    t_start = time.perf_counter()
    if model == "gpt":
        params = gpt_init(jax.random.key(0), blocks=cfg.blocks, d=cfg.d, mlp=cfg.mlp,
                          vocab=cfg.vocab)
        tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq), 0, cfg.vocab)
        data = (params, tokens, jnp.roll(tokens, -1, axis=1))
        rows, baseline, flops = gpt_rows(cfg), "jax.grad bf16", gpt_flops(cfg)
        n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        cfg.describe = (f"GPT-style decoder, {cfg.blocks} scanned pre-RMSNorm blocks, d={cfg.d}, "
                        f"{cfg.heads} heads, MLP {cfg.mlp}x (GELU), vocab {cfg.vocab} (tied "
                        f"embeddings, sinusoidal positions), batch {cfg.batch} x {cfg.seq} "
                        f"tokens, {n / 1e6:.1f}M f32 master parameters cast to bf16 inside; "
                        f"XLA attention (`jax.nn.dot_product_attention(implementation='xla')`)")
        title = "GPU benchmark: GPT-style decoder"
    else:
        params = mlp_init(jax.random.key(0), blocks=cfg.mlp_blocks, d=cfg.mlp_d,
                          hidden=cfg.mlp_hidden)
        x = jax.random.normal(jax.random.key(1), (cfg.tokens, cfg.mlp_d), F32)
        data = (params, x)
        rows, baseline, flops = mlp_rows(cfg), "bf16 remat scan", mlp_flops(cfg)
        n = sum(int(np.prod(v.shape)) for v in jax.tree_util.tree_leaves(params))
        cfg.describe = (f"scanned MLP, {cfg.mlp_blocks} blocks `c + W2 gelu(W1 LN(c))`, "
                        f"d={cfg.mlp_d}, hidden {cfg.mlp_hidden}, {cfg.tokens} tokens, f32 "
                        f"carry, bf16 compute inside each block, {n / 1e6:.1f}M f32 parameters")
        title = "GPU benchmark: scanned MLP"
    if cfg.rows:
        wanted = set(cfg.rows.split(","))
        rows = [r for i, r in enumerate(rows) if i == 0 or r.name in wanted]
    out = os.path.join(cfg.out_dir, f"{model}_{cfg.platform_tag}")
    print(f"\n== {model}: {cfg.describe}; {len(rows)} rows; compile threads "
          f"{cfg.compile_threads}", flush=True)
    results = {r.name: {"name": r.name, "what": r.what,
                        "status": "not run: the benchmark stopped before this row"}
               for r in rows}

    def write():
        report(model, title, cfg, rows, results, baseline, flops, env, dev,
               time.perf_counter() - t_start, out, argv, quiet=True)

    write()
    lower_deadline = None if deadline is None else (
        t_start + cfg.lower_frac * (deadline - t_start))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, cfg.compile_threads))
    futures, by_key, shared = {}, {}, {}
    # Phase 1: lower (and start compiling) every row.
    for i, r in enumerate(rows):
        tag = f"[{model} {i + 1}/{len(rows)}] {r.name}"
        if lower_deadline is not None and time.perf_counter() > lower_deadline and i > 0:
            results[r.name]["status"] = "skipped: --budget-s spent before this row started"
            print(f"{tag}: skipped (budget)", flush=True)
            continue
        if r.key is not None and r.key in by_key and not r.skip:
            shared[r.name] = by_key[r.key]
            print(f"{tag}: same program as '{by_key[r.key]}'", flush=True)
            continue
        res, lowered = lower_row(r, data)
        results[r.name] = res
        if r.key is not None and lowered is not None:
            by_key[r.key] = r.name
        if lowered is not None:
            futures[r.name] = pool.submit(compile_row, lowered)
        print(f"{tag}: {res['status']}"
              + (f"; lowered in {res['lower_s']:.2f} s" if "lower_s" in res else ""), flush=True)
    # Phase 2: wait for the compiles.
    t_wait = time.perf_counter()
    compiled = {}
    for name, fut in futures.items():
        try:
            # With a budget, a compile still running at the deadline is given up (reported),
            # so that one slow or stuck compile cannot take the rows already compiled with it.
            left = (None if deadline is None or name == rows[0].name  # the reference: always
                    else max(0.0, deadline - time.perf_counter()))
            compiled[name], results[name]["compile_s"] = fut.result(timeout=left)
        except concurrent.futures.TimeoutError:
            results[name]["status"] = "skipped: --budget-s spent while this row was compiling"
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            results[name]["status"] = f"compile error: {_short(e)}"
            results[name]["traceback"] = "".join(traceback.format_exception(e, limit=8))
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"== {model}: {len(compiled)} programs compiled; waited "
          f"{time.perf_counter() - t_wait:.1f} s for the compiles", flush=True)
    write()
    # Phase 3: run and time, one row at a time.
    ref = None
    for i, r in enumerate(rows):
        tag = f"[{model} {i + 1}/{len(rows)}] {r.name}"
        if r.name in shared:
            first = shared[r.name]
            m = {k: v for k, v in results[first].items() if k not in ("what",)}
            if m["status"] == "ok":
                m["status"] = f"same program as '{first}' (not recompiled)"
            m.update(name=r.name, what=r.what)
            results[r.name] = m
            continue
        if r.name not in compiled:
            continue
        res = results[r.name]
        if run_deadline is not None and time.perf_counter() > run_deadline and i > 0:
            res["status"] = "skipped: --budget-s spent before this row ran (it was compiled)"
            compiled.pop(r.name)
            print(f"{tag}: skipped (budget)", flush=True)
            write()
            continue
        t0 = time.perf_counter()
        grads = run_row(res, compiled.pop(r.name), data, ref, cfg.steps, is_ref=(i == 0))
        if i == 0:
            ref = grads
        del grads
        step = f"{res['step_s'] * 1e3:.2f} ms" if "step_s" in res else "-"
        s = res.get("sqnr_db")
        print(f"{tag}: {res['status']}; step {step}; SQNR "
              f"{s if s == 'reference' or s is None else fmt_db(s)}; lower "
              f"{res.get('lower_s', float('nan')):.2f} s, compile "
              f"{res.get('compile_s', float('nan')):.2f} s; ran in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        write()
    for name, first in shared.items():  # rows that share a program measured after them
        if results[name]["status"].startswith("not run"):
            m = {k: v for k, v in results[first].items() if k != "what"}
            if m["status"] == "ok":
                m["status"] = f"same program as '{first}' (not recompiled)"
            m.update(name=name, what=results[name]["what"])
            results[name] = m
    report(model, title, cfg, rows, results, baseline, flops, env, dev,
           time.perf_counter() - t_start, out, argv)
    return results


class Config:
    def __init__(self, args):
        self.args = args
        for k, v in vars(args).items():
            setattr(self, k, v)
        self.describe = ""


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp")
    ap.add_argument("--small", action="store_true",
                    help="CPU preset: " + ", ".join(f"{k}={v[1]}" for k, v in
                                                     {**GPT_SIZES, **MLP_SIZES}.items()))
    for k, (big, _) in {**GPT_SIZES, **MLP_SIZES}.items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=None,
                        help=f"default {big} (GPU size)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--peak-tflops", type=float, default=790.0,
                    help="peak for the %% column (default 790: H200 bf16, 8192^3 matmul)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new rows after this many seconds (all models together)")
    ap.add_argument("--run-grace-s", type=float, default=20.0,
                    help="with --budget-s: rows already compiled may still run this long after "
                         "the budget (a few steps each; their compile is paid)")
    ap.add_argument("--gpt-share", type=float, default=0.6,
                    help="fraction of --budget-s the GPT table may use before the MLP starts")
    ap.add_argument("--compile-threads", type=int, default=4,
                    help="XLA compilations run this many at a time, before any row is timed")
    ap.add_argument("--lower-frac", type=float, default=0.6,
                    help="with --budget-s: no row of a model is lowered after this fraction of "
                         "its time")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row names to run (the reference row always runs)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default=None,
                    help="platform part of the file names (default: gpu, cpu or cpu_small)")
    args = ap.parse_args(argv)
    for k, (big, small) in {**GPT_SIZES, **MLP_SIZES}.items():
        if getattr(args, k) is None:
            setattr(args, k, small if args.small else big)
    return args


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    cfg = Config(args)
    t0 = time.perf_counter()
    env = env_info([os.path.relpath(os.path.abspath(__file__))] + argv)
    dev = device_info()
    backend = jax.default_backend()
    cfg.platform_tag = args.tag or (backend + ("_small" if args.small else ""))
    print(f"gpu_bench: jax {jax.__version__} on {backend} ({dev['device_kind']}, driver "
          f"{dev['driver']}); models {args.models}; budget {args.budget_s} s", flush=True)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in ("gpt", "mlp")]
    if bad:
        raise SystemExit(f"unknown model(s) {bad}: use gpt, mlp")
    summary = {}
    end = None if args.budget_s is None else t0 + args.budget_s
    for i, model in enumerate(models):
        # The GPT table may start work until gpt_share of the budget, the last model until its
        # end; compiled rows run until the end of the whole budget plus --run-grace-s.
        deadline = end
        if end is not None and i < len(models) - 1 and model == "gpt":
            deadline = t0 + args.budget_s * args.gpt_share
        try:
            res = run_model(model, cfg, deadline, env, dev, argv,
                            run_deadline=None if end is None else end + args.run_grace_s)
            summary[model] = {n: m["status"] for n, m in res.items()}
        except Exception as e:  # noqa: BLE001 - the other model still runs
            print(f"{model}: failed outside any row: {_short(e)}", flush=True)
            traceback.print_exc()
            summary[model] = {"(model)": f"error: {_short(e)}"}
    print(f"\ngpu_bench done in {time.perf_counter() - t0:.0f} s", flush=True)
    return summary


if __name__ == "__main__":
    main()
