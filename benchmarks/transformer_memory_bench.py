"""Memory of a bf16 transformer's training step with compressed checkpoints, against the bf16
remat scan a bf16 user runs today.

The model: ``--blocks`` scanned bf16 pre-LN transformer blocks (LayerNorm without affine
parameters; XLA attention: ``softmax(q k^T / sqrt(dh))`` with a causal mask, in bf16; GELU MLP
4x; no biases), bf16 parameters and a bf16 carry. Loss: ``mean(carry**2)`` of the last carry
(in float32). Two sizes: ``large`` (64 x 128 tokens, d=256, 4 heads) and ``small`` (16 x 128
tokens, d=128, 4 heads).

Columns (peak temp, ``jax.jit(step).lower(...).compile().memory_analysis()
.temp_size_in_bytes``, compile only), each a ratio to the first:

* ``remat bf16``: ``jax.grad`` over ``lax.scan(jax.checkpoint(block))``, bf16 carry and
  parameters (bf16 gradients): the baseline;
* ``remat f32``: the same model in float32 (float32 parameters and carry);
* ``hg <codec>``: ``hg.grad`` over ``hg.scan(block, codec=<codec>)`` (float32 gradients,
  float32 backward, default ``backward_slices``);
* ``hg <codec> unsliced``: the same with ``backward_slices=1`` (the backward at once);
* ``bf16-bwd <codec>``: ``jax.grad`` over ``hg.scan(..., tangent_dtype=jnp.bfloat16)``: the
  same checkpoints with a bf16 backward (what the codec alone gives);
* ``cc <codec>``: ``hg.grad`` over ``hg.compress_checkpoints(<the remat scan>, <codec>)``: the
  baseline's own program, unmodified, with its checkpoints compressed (the drop-in).

``--sqnr`` adds the gradient SQNR (dB) against the float32 model (float32 parameters, carry
and backward, ``lax.scan(jax.checkpoint)``) at 2 blocks of the small model, for the bf16 remat
scan, the hg.scan codecs sliced and unsliced.

``--hlo`` writes the HLO evidence of the sliced backward: the count of dot ops in the
optimized HLO of one training step, sliced and unsliced (the same: no matmul recomputed),
and the while loops that run the slices.

Targets (printed PASS / FAIL as measured, and tabled in the report): ``hg <codec>`` at most
1.03x ``bf16-bwd <codec>`` at 12 and 24 blocks and on the small model at 16; against ``remat
bf16``, fp8_e4m3 and int8 at most 0.93x (12 blocks) and 0.87x (24), int4 0.89x and 0.79x, the
small model 0.92x, every other row at most 1.0x; SQNR sliced within 0.1 dB of unsliced, and
float32 gradients.

Run from the repository root (one release at a time; about 8 minutes on 2 shared CPU cores)::

    PYTHONPATH=. python benchmarks/transformer_memory_bench.py --sqnr --hlo

It writes ``benchmarks/results/transformer_memory_jax<release>.md`` and ``.json``.

``--models`` (about 3 minutes) measures instead the drop-in on four models as their code bases
write them (``benchmarks/real_models.py``: a MaxText-style llama2 layer, Flax NNX
``nnx.scan(nnx.remat)``, Equinox ``lax.scan`` + ``eqx.filter_checkpoint``, a float ``jnp.tril``
mask): ``hg.grad`` over ``hg.compress_checkpoints(loss, "int8" / "fp8_e4m3")`` against
``jax.grad(loss)`` of the same bf16 remat scan, at five sizes, with ``hg.slice_report``'s
verdict and a gradient check against the float32 model. Targets: at most 0.85x at 8 x 256
tokens and 16 blocks, at most 1.0x wherever batch x tokens >= 1024. It writes
``benchmarks/results/real_models_jax<release>.md`` and ``.json``.
``--codec-share`` (about 30 minutes) separates what the sliced float32 backward saves (codec
"none") from what each codec adds, at depths 2 to 48 and batches 8 and 32, with each codec's
gradient SQNR; it writes ``benchmarks/results/codec_share_jax<release>.md`` and ``.json``.
``--entry-points`` (about 5 minutes) measures the three entry points (`hg.scan`, a `lax.scan`
over `hg.checkpoint`, `hg.compress_checkpoints`) on a block that writes its shapes as Python
ints, int8 against the bf16 remat scan (target: each at most 0.85x); it writes
``benchmarks/results/entry_points_jax<release>.md`` and ``.json``.
``--only-hlo`` re-measures the HLO section of that release's results, ``--report-only``
rewrites the markdown from the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import env_info, md_table, sqnr_db, write_json  # noqa: E402

import hifigrad as hg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CODECS = ["fp8_e4m3", "int8", "int4"]
SIZES = {"large": dict(batch=64, seq=128, d=256, heads=4),
         "small": dict(batch=16, seq=128, d=128, heads=4)}
MiB = 2**20


def init_params(key, *, blocks, d, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 4)
    L = blocks

    def w(k, shape, fan_in, scale=1.0):
        return (jax.random.normal(k, (L, *shape)) * fan_in ** -0.5 * scale).astype(dtype)

    return {"wqkv": w(ks[0], (d, 3 * d), d), "wo": w(ks[1], (d, d), d, L ** -0.5),
            "w1": w(ks[2], (d, 4 * d), d), "w2": w(ks[3], (4 * d, d), 4 * d, L ** -0.5)}


def layer_norm(x, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps)


def make_block(heads):
    def block(x, p):
        b, t, d = x.shape
        dh = d // heads
        qkv = layer_norm(x) @ p["wqkv"]
        q, k, v = jnp.split(qkv.reshape(b, t, 3, heads, dh), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(dh ** -0.5, x.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(mask, s, jnp.asarray(-1e9 if x.dtype == jnp.float32 else -3e38, x.dtype))
        a = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
        x = x + o @ p["wo"]
        return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"]
    return block


def loss_of(carry):
    return jnp.mean(jnp.square(carry.astype(jnp.float32)))


def step_fns(heads):
    """name -> (kind, grad function of (params, x))."""
    block = make_block(heads)

    def body(c, p):
        return block(c, p), None

    def remat(params, x):
        return loss_of(lax.scan(jax.checkpoint(body), x, params)[0])

    fns = {"remat bf16": jax.grad(remat), "remat f32": jax.grad(remat)}
    for c in CODECS:
        def hgscan(params, x, c=c, **kw):
            return loss_of(hg.scan(body, x, params, codec=c, **kw)[0])
        fns[f"hg {c}"] = hg.grad(hgscan)
        fns[f"hg {c} unsliced"] = hg.grad(lambda p, x, c=c: hgscan(p, x, c, backward_slices=1))
        fns[f"bf16-bwd {c}"] = jax.grad(
            lambda p, x, c=c: hgscan(p, x, c, tangent_dtype=jnp.bfloat16))
        fns[f"cc {c}"] = hg.grad(hg.compress_checkpoints(remat, c))
    return fns


def abstract(size, blocks, dtype):
    cfg = SIZES[size]
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), blocks=blocks,
                                                d=cfg["d"], dtype=dtype))
    x = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"], cfg["d"]), dtype)
    return params, x


def compiled(fn, size, blocks, name):
    dtype = jnp.float32 if name == "remat f32" else jnp.bfloat16
    return jax.jit(fn).lower(*abstract(size, blocks, dtype)).compile()


def peak_temp(fn, size, blocks, name) -> int:
    return compiled(fn, size, blocks, name).memory_analysis().temp_size_in_bytes


def hlo_counts(fn, size, blocks, name) -> dict:
    text = compiled(fn, size, blocks, name).as_text()
    return {"dot": len(re.findall(r" dot\(", text)),
            "while": len(re.findall(r" while\(", text)),
            "fusion": len(re.findall(r" fusion\(", text))}


def hlo_section(fns) -> dict:
    return {n: hlo_counts(fns[n], "large", 12, n)
            for n in ("remat bf16", "hg int8", "hg int8 unsliced", "bf16-bwd int8")}


def sqnr_rows(names, fns, heads):
    """Gradient SQNR (dB) vs the float32 model, small model at 2 blocks."""
    cfg = SIZES["small"]
    key = jax.random.PRNGKey(1)
    p32 = init_params(key, blocks=2, d=cfg["d"], dtype=jnp.float32)
    x32 = jax.random.normal(jax.random.PRNGKey(2), (cfg["batch"], cfg["seq"], cfg["d"]))
    ref = jax.jit(fns["remat f32"])(p32, x32)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p32)
    out = {}
    for n in names:
        if n == "remat f32":
            continue
        g = jax.jit(fns[n])(p16, x32.astype(jnp.bfloat16))
        dts = {a.dtype.name for a in jax.tree_util.tree_leaves(g)}
        flat = [np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(g)]
        flat_ref = [np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(ref)]
        out[n] = {"sqnr_db": sqnr_db(np.concatenate(flat_ref), np.concatenate(flat)),
                  "grad_dtypes": sorted(dts)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", default="4,12,24,48")
    ap.add_argument("--small-depths", default="4,16")
    ap.add_argument("--sqnr", action="store_true")
    ap.add_argument("--hlo", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--only-hlo", action="store_true",
                    help="recompute the HLO section of this release's existing results file")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite this release's markdown report from its JSON (no measuring)")
    ap.add_argument("--models", nargs="?", const=",".join(MODEL_NAMES), default=None,
                    help="instead: the drop-in on models as four code bases write them "
                         f"(benchmarks/real_models.py; default all of {','.join(MODEL_NAMES)})")
    ap.add_argument("--entry-points", action="store_true",
                    help="instead: hg.scan, hg.checkpoint and compress_checkpoints on a block "
                         "that bakes its shapes in")
    ap.add_argument("--codec-share", action="store_true",
                    help="instead: what slicing gives and what each codec adds, by depth and "
                         "batch")
    ap.add_argument("--maxtext", nargs="?", const="llama2-full,llama2-minimal,mistral,gemma2,"
                    "deepseek", default=None,
                    help="instead: real MaxText decoders (needs maxtext, Python >= 3.12)")
    args = ap.parse_args(argv)
    if args.codec_share:
        result = codec_share_section(argv)
        write_codec_share(result, args.out)
        return
    if args.maxtext is not None:
        import maxtext_models

        if not maxtext_models.available():
            raise SystemExit("--maxtext needs maxtext (0.2.5, Python >= 3.12): see "
                             "benchmarks/maxtext_models.py")
        result = maxtext_section(args.maxtext.split(","), argv)
        write_maxtext(result, args.out)
        return
    if args.entry_points:
        result = entry_section(argv)
        write_entry(result, args.out)
        return
    if args.models is not None:
        result = models_section(args.models.split(","), argv)
        write_models(result, args.out)
        return
    if args.report_only:
        with open(os.path.join(args.out, f"transformer_memory_jax{jax.__version__}.json")) as f:
            write(json.load(f), args.out)
        return
    heads = 4
    fns = step_fns(heads)
    if args.only_hlo:
        path = os.path.join(args.out, f"transformer_memory_jax{jax.__version__}.json")
        with open(path) as f:
            result = json.load(f)
        result["hlo"] = hlo_section(fns)
        result["hlo_command"] = env_info(sys.argv if argv is None else argv)["command"]
        write(result, args.out)
        return
    names = list(fns)
    runs = [("large", int(b)) for b in args.depths.split(",") if b] + \
        [("small", int(b)) for b in args.small_depths.split(",") if b]
    temps = {}
    for size, blocks in runs:
        row = {}
        for n in names:
            row[n] = peak_temp(fns[n], size, blocks, n)
            print(f"{size} {blocks:3d} {n:24s} {row[n] / MiB:9.2f} MiB", flush=True)
        temps[f"{size} {blocks}"] = row
    result = {"env": env_info(sys.argv if argv is None else argv), "jax": jax.__version__,
              "peak_temp_bytes": temps}
    if args.hlo:
        result["hlo"] = hlo_section(fns)
    if args.sqnr:
        result["sqnr"] = sqnr_rows(names, fns, heads)
    write(result, args.out)


# ------------------------------------------------------------------ real models (--models)
# The drop-in on models as their code bases write them (real_models.py): `hg.grad` over
# `hg.compress_checkpoints(loss, codec)` against `jax.grad(loss)` (the model's own bf16 remat
# scan), peak temp compiled. (batch, seq, d_model, blocks); the first is the target size.
MODEL_NAMES = ["maxtext", "nnx", "equinox", "tril"]
MODEL_SIZES = [(8, 256, 256, 16), (4, 256, 256, 16), (16, 128, 128, 16), (8, 128, 128, 8),
               (4, 128, 128, 4)]
MODEL_CODECS = ["int8", "fp8_e4m3"]
MODEL_TARGET = 0.85   # at MODEL_SIZES[0]
MODEL_CEILING = 1.0   # wherever batch x tokens >= 1024
SANITY_SIZE = (4, 128, 64, 2)  # gradients checked against the float32 model's
SANITY_RTOL = 0.05


def _to_f32(tree):
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _sanity(build) -> float:
    """Norm-wise relative error of the int8 drop-in's gradients (float32) against jax.grad
    of the same model in float32 (parameters and inputs cast): int8 checkpoints of a bf16
    forward, a few 1e-3 expected; asserted below SANITY_RTOL, and finite."""
    loss, make = build(*SANITY_SIZE)
    args = make()
    got = jax.jit(hg.grad(hg.compress_checkpoints(loss, "int8")))(*args)
    want = jax.jit(jax.grad(loss))(*_to_f32(args))
    g = np.concatenate([np.asarray(a, np.float64).ravel()
                        for a in jax.tree_util.tree_leaves(got)])
    w = np.concatenate([np.asarray(a, np.float64).ravel()
                        for a in jax.tree_util.tree_leaves(want)])
    dts = {a.dtype for a in jax.tree_util.tree_leaves(got)}
    assert dts == {np.dtype(np.float32)}, dts
    assert np.all(np.isfinite(g)), "non-finite gradients"
    err = float(np.linalg.norm(g - w) / np.linalg.norm(w))
    assert err < SANITY_RTOL, err
    return err


def models_section(names, argv) -> dict:
    from real_models import MODELS

    out = {"env": env_info(sys.argv if argv is None else argv), "jax": jax.__version__,
           "models": {}}
    for name in names:
        build = MODELS[name]
        rows = {}
        for b, t, d, n in MODEL_SIZES:
            loss, make = build(b, t, d, n)
            args = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                          make())

            def temp(f, args=args):
                return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

            row = {"remat bf16": temp(jax.grad(loss))}
            for c in MODEL_CODECS:
                row[f"cc {c}"] = temp(hg.grad(hg.compress_checkpoints(loss, c)))
            row["slice_report"] = sorted(set(hg.slice_report(
                jax.grad(hg.compress_checkpoints(loss, "int8")), *args)))
            key = f"{b}x{t} d{d} {n} blocks"
            rows[key] = row
            print(f"{name:8s} {key:22s} remat bf16 {row['remat bf16'] / MiB:8.1f} MiB  " +
                  "  ".join(f"cc {c} {row[f'cc {c}'] / row['remat bf16']:.3f}x"
                            for c in MODEL_CODECS) + f"  {row['slice_report']}", flush=True)
        out["models"][name] = {"rows": rows, "sanity_rel_err": _sanity(build)}
    return out


def model_targets(result) -> list[tuple[str, str, bool]]:
    out = []
    first = "{}x{} d{} {} blocks".format(*MODEL_SIZES[0])
    for name, m in result["models"].items():
        for key, row in m["rows"].items():
            b, t = (int(v) for v in key.split()[0].split("x"))
            lim = MODEL_TARGET if key == first else MODEL_CEILING if b * t >= 1024 else None
            for c in MODEL_CODECS if lim is not None else ():
                r = row[f"cc {c}"] / row["remat bf16"]
                out.append((f"{name} {key} cc {c} <= {lim}x remat bf16", f"{r:.3f}x", r <= lim))
    return out


def write_models(result, out_dir):
    ver = result["jax"]
    base = os.path.join(out_dir, f"real_models_jax{ver}")
    write_json(base + ".json", result)
    lines = [f"# The drop-in on models as their code bases write them (jax {ver}, CPU)", "",
             "Written by `PYTHONPATH=. python benchmarks/transformer_memory_bench.py --models`"
             ". Models: `benchmarks/real_models.py` (MaxText-style llama2 layer with names, "
             "sharding constraints, integer positions and segment ids; Flax NNX "
             "`nnx.scan(nnx.remat)`; Equinox `lax.scan` + `eqx.filter_checkpoint`; a float "
             "`jnp.tril` mask). *remat bf16*: `jax.grad` of the model's own bf16 remat scan "
             "(bf16 gradients), peak temp of one compiled step "
             "(`memory_analysis().temp_size_in_bytes`); *cc*: `hg.grad` over "
             "`hg.compress_checkpoints(loss, codec)` of the same loss, unmodified (float32 "
             "gradients), as a ratio; *slicing*: `hg.slice_report` of the int8 drop-in.", ""]
    header = ["model", "size", "remat bf16 MiB", *[f"cc {c}" for c in MODEL_CODECS],
              "slicing"]
    rows = []
    for name, m in result["models"].items():
        for key, row in m["rows"].items():
            b = row["remat bf16"]
            rows.append([name, key, f"{b / MiB:.1f}"] +
                        [f"{row[f'cc {c}'] / b:.3f}x" for c in MODEL_CODECS] +
                        ["; ".join(row["slice_report"])])
    lines += [md_table(header, rows), ""]
    lines += ["Gradient check (int8 drop-in vs `jax.grad` of the same model in float32, "
              "{}x{} tokens, d {}, {} blocks; norm-wise relative error, asserted < {}): ".format(
                  *SANITY_SIZE, SANITY_RTOL) +
              ", ".join(f"{n} {m['sanity_rel_err']:.2e}" for n, m in result["models"].items()),
              ""]
    lines += targets_section(model_targets(result))
    write_md(base, lines, result)


def targets_section(checks) -> list[str]:
    """The markdown of `checks` ((target, measured, ok) each), each also printed."""
    for t, m, ok in checks:
        print("PASS" if ok else "FAIL", t, m)
    return [f"## Targets: {sum(ok for *_, ok in checks)} of {len(checks)} pass", "",
            md_table(["target", "measured", ""],
                     [[t, m, "PASS" if ok else "FAIL"] for t, m, ok in checks]), ""]


def write_md(base, lines, result):
    """`lines` and the environment line into ``base.md``."""
    lines = [*lines, "Environment: " + ", ".join(f"{k} {v}" for k, v in result["env"].items()),
             ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("wrote", base + ".md")


# ------------------------------------------------------------------ entry points (--entry-points)
# One slicing engine for the three entry points: a hand-written block that bakes its shapes
# in as Python ints (as most hand-written transformers do: `reshape(B, T, H, DH)`), under
# `hg.scan`, a `lax.scan` over `hg.checkpoint` and `hg.compress_checkpoints` of the remat scan,
# against the bf16 remat scan. (batch, seq, d_model, blocks).
ENTRY_SIZES = [(16, 128, 128, 16), (8, 256, 512, 16)]
ENTRY_TARGET = 0.85  # each entry point, int8, against remat bf16


def baked_block(batch, seq, d, heads=4):
    """`make_block`'s transformer block with its shapes written as Python ints."""
    dh = d // heads

    def block(x, p):
        qkv = layer_norm(x) @ p["wqkv"]
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3, heads, dh), 3, axis=2)
        q, k, v = (a.reshape(batch, seq, heads, dh) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(dh ** -0.5, x.dtype)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        s = jnp.where(mask, s, jnp.asarray(-3e38, x.dtype))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        x = x + o.reshape(batch, seq, d) @ p["wo"]
        h = layer_norm(x).reshape(batch * seq, d)
        return x + (jax.nn.gelu(h @ p["w1"]) @ p["w2"]).reshape(batch, seq, d)
    return block


def entry_section(argv) -> dict:
    out = {"env": env_info(sys.argv if argv is None else argv), "jax": jax.__version__,
           "rows": {}}
    for b, t, d, n in ENTRY_SIZES:
        block = baked_block(b, t, d)

        def body(c, p, block=block):
            return block(c, p), None

        def remat(params, x):
            return loss_of(lax.scan(jax.checkpoint(body), x, params)[0])

        def scanned(params, x):
            return loss_of(hg.scan(body, x, params, codec="int8")[0])

        ck = hg.checkpoint(body, codec="int8")
        ck0 = hg.checkpoint(body, codec="int8", encode_argnums=0)

        def checkpointed(params, x, ck=ck):
            return loss_of(lax.scan(ck, x, params)[0])

        def checkpointed0(params, x, ck=ck0):
            return loss_of(lax.scan(ck, x, params)[0])

        params = jax.eval_shape(functools.partial(init_params, jax.random.PRNGKey(0),
                                                  blocks=n, d=d))
        x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
        variants = {"remat bf16": jax.grad(remat), "hg.scan int8": hg.grad(scanned),
                    "hg.checkpoint int8": hg.grad(checkpointed),
                    "hg.checkpoint int8 encode_argnums=0": hg.grad(checkpointed0),
                    "cc int8": hg.grad(hg.compress_checkpoints(remat, "int8"))}
        row = {}
        for name, f in variants.items():
            row[name] = jax.jit(f).lower(params, x).compile().memory_analysis() \
                .temp_size_in_bytes
            if name != "remat bf16":
                row[name + " slicing"] = sorted(set(hg.slice_report(f, params, x)))
        key = f"{b}x{t} d{d} {n} blocks"
        out["rows"][key] = row
        print(key, "  ".join(f"{k} {row[k] / row['remat bf16']:.3f}x {row[k + ' slicing']}"
                             for k in variants if k != "remat bf16"), flush=True)
    return out


def entry_targets(result) -> list[tuple[str, str, bool]]:
    out = []
    for key, row in result["rows"].items():
        for name in ("hg.scan int8", "hg.checkpoint int8", "hg.checkpoint int8 encode_argnums=0",
                     "cc int8"):
            if name not in row:  # results written before that column existed
                continue
            r = row[name] / row["remat bf16"]
            out.append((f"{key} {name} <= {ENTRY_TARGET}x remat bf16", f"{r:.3f}x",
                        r <= ENTRY_TARGET))
    return out


def write_entry(result, out_dir):
    ver = result["jax"]
    base = os.path.join(out_dir, f"entry_points_jax{ver}")
    write_json(base + ".json", result)
    lines = [f"# One slicing engine: the three entry points on a shape-baked block (jax {ver}, "
             "CPU)", "",
             "Written by `PYTHONPATH=. python benchmarks/transformer_memory_bench.py "
             "--entry-points`. The block is the bench's bf16 pre-LN transformer block with its "
             "shapes written as Python ints (`reshape(B, T, 3, H, DH)`, `reshape(B * T, D)`). "
             "*remat bf16*: `jax.grad` of `lax.scan(jax.checkpoint(block))` (bf16 gradients); "
             "*hg.scan*: `hg.grad` over `hg.scan(block, codec='int8')`; *hg.checkpoint*: "
             "`hg.grad` over `lax.scan(hg.checkpoint(block, 'int8'))`, which encodes the "
             "per-step parameters too (its arguments: the scan stacks their int8 copies), or "
             "with `encode_argnums=0` saves them as they are (no copy: they stay alive); "
             "*cc*: `hg.grad` over "
             "`hg.compress_checkpoints(<the remat scan>, 'int8')` (float32 gradients). Peak temp "
             "of one compiled step as a ratio to *remat bf16*; *slicing*: `hg.slice_report`.",
             ""]
    names = ["hg.scan int8", "hg.checkpoint int8", "hg.checkpoint int8 encode_argnums=0",
             "cc int8"]
    rows = []
    for key, row in result["rows"].items():
        b = row["remat bf16"]
        rows.append([key, f"{b / MiB:.1f}", *[f"{row[n] / b:.3f}x" for n in names],
                     "; ".join(sorted({s for n in names for s in row[n + " slicing"]}))])
    lines += [md_table(["size", "remat bf16 MiB", *names, "slicing"], rows), ""]
    lines += targets_section(entry_targets(result))
    write_md(base, lines, result)


# ------------------------------------------------------------------ codec share (--codec-share)
# What slicing gives and what each codec adds, by depth and batch: `hg.grad` over
# `hg.compress_checkpoints(<the bf16 remat scan>, codec)` for codec "none" (the sliced float32
# backward alone, each block's input saved as it is) and each codec, against `jax.grad` of the
# remat scan; and each codec's gradient SQNR against the float32 model.
SHARE_CODECS = ["none", "fp8_e4m3", "int8", "int4", "int2"]
SHARE_DEPTHS = (2, 8, 24, 48)
SHARE_BATCHES = (8, 32)
SHARE_SIZE = dict(seq=128, d=256, heads=4)
SHARE_MATTERS = 0.8  # a codec "matters" where it takes at most this of codec "none"'s peak


def codec_share_section(argv) -> dict:
    out = {"env": env_info(sys.argv if argv is None else argv), "jax": jax.__version__,
           "size": SHARE_SIZE, "rows": {}}
    block = make_block(SHARE_SIZE["heads"])

    def body(c, p):
        return block(c, p), None

    def remat(params, x):
        return loss_of(lax.scan(jax.checkpoint(body), x, params)[0])

    for blocks in SHARE_DEPTHS:
        for batch in SHARE_BATCHES:
            params = jax.eval_shape(functools.partial(init_params, jax.random.PRNGKey(0),
                                                      blocks=blocks, d=SHARE_SIZE["d"]))
            x = jax.ShapeDtypeStruct((batch, SHARE_SIZE["seq"], SHARE_SIZE["d"]),
                                     jnp.bfloat16)

            def temp(f, params=params, x=x):
                return jax.jit(f).lower(params, x).compile().memory_analysis() \
                    .temp_size_in_bytes
            row = {"remat bf16": temp(jax.grad(remat))}
            for c in SHARE_CODECS:
                row[f"cc {c}"] = temp(hg.grad(hg.compress_checkpoints(remat, c)))
            key = f"{blocks} blocks, batch {batch}"
            out["rows"][key] = row
            print(key, "  ".join(f"{k} {row[k] / row['remat bf16']:.3f}x" for k in row
                                 if k != "remat bf16"), flush=True)
    # SQNR against the float32 model: 4 blocks, batch 8, real values.
    key = jax.random.PRNGKey(1)
    p32 = init_params(key, blocks=4, d=SHARE_SIZE["d"], dtype=jnp.float32)
    x32 = jax.random.normal(jax.random.PRNGKey(2), (8, SHARE_SIZE["seq"], SHARE_SIZE["d"]))
    ref = jax.jit(jax.grad(remat))(p32, x32)
    p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p32)
    flat_ref = np.concatenate([np.asarray(a, np.float64).ravel()
                               for a in jax.tree_util.tree_leaves(ref)])
    out["sqnr_db"] = {}
    for name, f in [("remat bf16 (jax.grad)", jax.grad(remat)),
                    *[(f"cc {c}", hg.grad(hg.compress_checkpoints(remat, c)))
                      for c in SHARE_CODECS]]:
        g = jax.jit(f)(p16, x32.astype(jnp.bfloat16))
        flat = np.concatenate([np.asarray(a, np.float64).ravel()
                               for a in jax.tree_util.tree_leaves(g)])
        out["sqnr_db"][name] = sqnr_db(flat_ref, flat)
    print("SQNR", out["sqnr_db"], flush=True)
    return out


def write_codec_share(result, out_dir):
    ver = result["jax"]
    base = os.path.join(out_dir, f"codec_share_jax{ver}")
    write_json(base + ".json", result)
    size = result["size"]
    lines = [f"# What slicing gives and what each codec adds (jax {ver}, CPU)", "",
             "Written by `PYTHONPATH=. python benchmarks/transformer_memory_bench.py "
             "--codec-share`. The bench's bf16 pre-LN transformer block (d={d}, {heads} heads, "
             "{seq} tokens per row), scanned; peak temp of one compiled step "
             "(`memory_analysis().temp_size_in_bytes`). *remat bf16*: `jax.grad` of "
             "`lax.scan(jax.checkpoint(block))`, what a bf16 user runs; *cc none*: `hg.grad` of "
             "`hg.compress_checkpoints(<that loss>, 'none')`: the float32 backward in batch "
             "slices, each block's input saved as it is (the slicing's share); *cc codec*: the "
             "same with that codec (its share: the second number, against *cc none*).".format(
                 **size), ""]
    header = ["depth, batch", "remat bf16 MiB", "cc none", *[f"cc {c}" for c in
                                                             SHARE_CODECS[1:]]]
    rows = []
    for key, row in result["rows"].items():
        b, n = row["remat bf16"], row["cc none"]
        rows.append([key, f"{b / MiB:.1f}", f"{n / b:.3f}x",
                     *[f"{row[f'cc {c}'] / b:.3f}x ({row[f'cc {c}'] / n:.2f})"
                       for c in SHARE_CODECS[1:]]])
    lines += [md_table(header, rows), ""]
    first = {}
    for c in SHARE_CODECS[1:]:
        hits = [k for k, r in result["rows"].items()
                if r[f"cc {c}"] <= SHARE_MATTERS * r["cc none"]]
        first[c] = hits[0] if hits else None
    lines += ["Where a codec's bits start to matter (its peak at most "
              f"{SHARE_MATTERS}x codec 'none''s: the codec saves a fifth more than the slicing "
              "alone; first in the table's order): " + "; ".join(
                  f"{c}: {k or 'nowhere measured'}" for c, k in first.items()) + ".", ""]
    lines += ["Gradient SQNR against the float32 model (4 blocks, batch 8; float32 "
              "gradients for cc): " + ", ".join(f"{k} {v:.1f} dB"
                                                for k, v in result["sqnr_db"].items()), ""]
    write_md(base, lines, result)


# ------------------------------------------------------------------ real MaxText (--maxtext)
# MaxText 0.2.5 from PyPI, unmodified (benchmarks/maxtext_models.py builds its decoders as its
# trainer does, under jax.set_mesh): `hg.grad(hg.compress_checkpoints(loss, codec))` against
# `jax.grad(loss)`, MaxText's own bf16 remat training step.
MAXTEXT_LAYERS = (8, 16)
MAXTEXT_CODECS = ["int8", "fp8_e4m3"]
MAXTEXT_TARGET = 0.75
MAXTEXT_CHECK = dict(layers=2, batch=8, seq=64)  # 512 rows: 2 slices of 256
# Configs also measured with MaxText's param_scan_axis=0 (its default is 1: each weight
# stacked on axis 1, which XLA:CPU copies to the front for the scan, in both steps unless
# hifigrad reads the slices from the untransposed stack; see policy._AUTO_STACKS).
MAXTEXT_AXIS0 = ("llama2-full", "mistral")


def _maxtext_check(mm, name) -> dict:
    """The sliced float32 backward on real MaxText, against `jax.grad`: the config computing
    in float32 (``dtype=float32``), codec "none", 2 layers (deepseek: its dense one and an MoE
    one) of 8 x 64 tokens (2 slices), with the slice check on (`Policy(check_slices=True)`):
    norm-wise relative error of every gradient, and the slice report."""
    loss, args = mm.build(name, concrete=True, dtype="float32", **MAXTEXT_CHECK)
    def flat(g):
        return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(g)])

    with jax.set_mesh(loss.mesh):
        cc = hg.compress_checkpoints(loss, "none", backward_slices=2,
                                     policy=hg.Policy(check_slices=True))
        report = sorted(set(hg.slice_report(hg.grad(cc), *args)))
        got = flat(jax.jit(hg.grad(cc))(*args))
        whole = flat(jax.jit(hg.grad(hg.compress_checkpoints(loss, "none",
                                                              backward_slices=1)))(*args))
        want = flat(jax.jit(jax.grad(loss))(*args))
    return {"rel_err": float(np.linalg.norm(got - whole) / np.linalg.norm(whole)),
            "rel_err_vs_jax": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
            "slice_report": report}


def maxtext_section(names, argv) -> dict:
    import maxtext_models as mm
    from peak_live import peak

    out = {"env": env_info(sys.argv if argv is None else argv), "jax": jax.__version__,
           "maxtext": mm.version(), "rows": {}, "checks": {}, "peaks": {}}
    for name in names:
        for layers in MAXTEXT_LAYERS:
            for tiling in (1, 4):
                extra = {} if tiling == 1 else {"num_vocab_tiling": tiling}
                loss, args = mm.build(name, layers, **extra)
                with jax.set_mesh(loss.mesh):
                    def temp(f, args=args):
                        return jax.jit(f).lower(*args).compile().memory_analysis() \
                            .temp_size_in_bytes
                    row = {"remat bf16": temp(jax.grad(loss))}
                    for c in MAXTEXT_CODECS if tiling == 1 else MAXTEXT_CODECS[:1]:
                        row[f"cc {c}"] = temp(hg.grad(hg.compress_checkpoints(loss, c)))
                    row["slice_report"] = sorted(set(hg.slice_report(
                        hg.grad(hg.compress_checkpoints(loss, "int8")), *args)))
                    if layers == MAXTEXT_LAYERS[0] and tiling == 1:
                        out["peaks"][name] = {
                            k: peak(f, *args, top=6) for k, f in (
                                ("remat bf16", jax.grad(loss)),
                                ("cc int8", hg.grad(hg.compress_checkpoints(loss, "int8"))))}
                key = f"{name} {layers} layers" + (f" vocab tiling {tiling}" if extra else "")
                out["rows"][key] = row
                print(f"{key:40s} remat bf16 {row['remat bf16'] / MiB:7.1f} MiB  " +
                      "  ".join(f"{k} {row[k] / row['remat bf16']:.3f}x" for k in row
                                if k.startswith("cc ")) + f"  {row['slice_report']}",
                      flush=True)
        if name in MAXTEXT_AXIS0:
            # MaxText's layers stacked on axis 0 (param_scan_axis=0): neither step holds a
            # transposed copy of the weights, whatever the platform's layouts
            loss, args = mm.build(name, MAXTEXT_LAYERS[0], param_scan_axis=0)
            with jax.set_mesh(loss.mesh):
                row = {"remat bf16": temp(jax.grad(loss), args),
                       "cc int8": temp(hg.grad(hg.compress_checkpoints(loss, "int8")), args),
                       "slice_report": sorted(set(hg.slice_report(
                           hg.grad(hg.compress_checkpoints(loss, "int8")), *args)))}
            key = f"{name} {MAXTEXT_LAYERS[0]} layers param_scan_axis 0"
            out["rows"][key] = row
            print(f"{key:40s} remat bf16 {row['remat bf16'] / MiB:7.1f} MiB  cc int8 "
                  f"{row['cc int8'] / row['remat bf16']:.3f}x", flush=True)
        out["checks"][name] = _maxtext_check(mm, name)
        print(name, "check", out["checks"][name], flush=True)
    return out


def maxtext_targets(result) -> list[tuple[str, str, bool]]:
    out = []
    for key, row in result["rows"].items():
        if "tiling" in key:
            continue
        sliced = all(r.startswith("sliced") for r in row["slice_report"])
        out.append((f"{key}: every checkpoint sliced", "yes" if sliced else "no", sliced))
        r = row["cc int8"] / row["remat bf16"]
        out.append((f"{key} cc int8 <= {MAXTEXT_TARGET}x remat bf16", f"{r:.3f}x",
                    r <= MAXTEXT_TARGET))
        out.append((f"{key} cc int8 never above the remat bf16 step (<= 1.0x)", f"{r:.3f}x",
                    r <= 1.0))
    for name, c in result["checks"].items():
        out.append((f"{name}: float32 gradients sliced = unsliced (rel. err < 1e-6)",
                    f"{c['rel_err']:.1e}", c["rel_err"] < 1e-6))
    return out


def write_maxtext(result, out_dir):
    ver = result["jax"]
    base = os.path.join(out_dir, f"maxtext_jax{ver}")
    write_json(base + ".json", result)
    lines = [f"# Real MaxText {result['maxtext']} under compress_checkpoints (jax {ver}, CPU)",
             "", "Written by `python benchmarks/transformer_memory_bench.py --maxtext` (a Python "
             ">= 3.12 environment with `maxtext` installed: `benchmarks/maxtext_models.py`). "
             "Decoders built from MaxText's own configs (emb 256, mlp 1024, 4 heads of 64, "
             "vocab 256, bf16 compute, float32 weights, `scan_layers=True`, "
             "`attention=dot_product`; deepseek: MLA, one dense layer then MoE layers of 4 "
             "experts, 2 per token, routed dropless by MaxText's dense path), 8 x 256 tokens, "
             "traced under `jax.set_mesh` as "
             "MaxText's trainer does. *remat bf16*: `jax.grad` of MaxText's training loss "
             "(its own bf16 remat step); *cc*: `hg.grad(hg.compress_checkpoints(loss, codec))` "
             "(float32 gradients), peak temp as a ratio; *slicing*: `hg.slice_report`. "
             "MaxText stacks each scanned weight on axis 1 (`param_scan_axis=1`, its "
             "default); XLA:CPU copies such a stack to the front for the scan, in both steps, "
             "and hifigrad's (on CPU and GPU, not on a TPU, whose layouts need no copy) reads "
             "each layer's slice from the untransposed stack instead. The *param_scan_axis 0* "
             "rows stack the layers on axis 0, where neither step holds a copy.", ""]
    rows = []
    for key, row in result["rows"].items():
        b = row["remat bf16"]
        rows.append([key, f"{b / MiB:.1f}",
                     *[f"{row[f'cc {c}'] / b:.3f}x" if f"cc {c}" in row else ""
                       for c in MAXTEXT_CODECS], "; ".join(row["slice_report"])])
    lines += [md_table(["config", "remat bf16 MiB", *[f"cc {c}" for c in MAXTEXT_CODECS],
                        "slicing"], rows), ""]
    lines += ["## What is live at the peak (8 layers)", "",
              "The largest buffers live at each step's peak, read from XLA's buffer "
              "assignment (`benchmarks/peak_live.py`).", ""]
    for name, peaks in result["peaks"].items():
        for k, p in peaks.items():
            lines.append(f"- {name}, {k}: {p['peak_bytes'] / MiB:.1f} MiB; " + ", ".join(
                f"{v['shape'].split('{')[0]} {v['bytes'] / MiB:.1f}" for v in p["top"]))
    lines += ["", "## Gradient check", "",
              "Each config computing in float32, codec 'none', 2 layers (deepseek: its dense one "
              "and an MoE one) of 8 x 64 tokens, 2 slices, the slice check on: `hg.grad` of "
              "the compressed loss sliced against the same "
              "unsliced (`backward_slices=1`), and against `jax.grad` of the loss "
              "(norm-wise relative error over all parameters).", "",
              md_table(["config", "sliced vs unsliced", "vs jax.grad", "slicing"],
                       [[n, f"{c['rel_err']:.1e}", f"{c['rel_err_vs_jax']:.1e}",
                         "; ".join(c["slice_report"])]
                        for n, c in result["checks"].items()]), ""]
    lines += targets_section(maxtext_targets(result))
    write_md(base, lines, result)


# (model, blocks) -> the most peak temp `hg <codec>` may take, as a ratio to `remat bf16`.
VS_REMAT = {("large", 12): {"fp8_e4m3": 0.93, "int8": 0.93, "int4": 0.89},
            ("large", 24): {"fp8_e4m3": 0.87, "int8": 0.87, "int4": 0.79},
            ("small", 16): {c: 0.92 for c in CODECS}}
VS_BF16_BWD = 1.03  # `hg <codec>` over `bf16-bwd <codec>`, at the VS_REMAT depths
SQNR_TOL_DB = 0.1   # `hg <codec>` (sliced) against `hg <codec> unsliced`


def targets(result) -> list[tuple[str, str, bool]]:
    """(target, measured, ok) for each target this benchmark checks."""
    temps, out = result["peak_temp_bytes"], []
    for key, row in temps.items():
        size, blocks = key.split()
        lim = VS_REMAT.get((size, int(blocks)), {})
        for c in CODECS:
            for api in ("hg", "cc"):
                if f"{api} {c}" not in row:
                    continue
                r = row[f"{api} {c}"] / row["remat bf16"]
                out.append((f"{key} {api} {c} <= {lim.get(c, 1.0)}x remat bf16", f"{r:.3f}x",
                            r <= lim.get(c, 1.0)))
                if lim:
                    q = row[f"{api} {c}"] / row[f"bf16-bwd {c}"]
                    out.append((f"{key} {api} {c} <= {VS_BF16_BWD}x bf16-bwd {c}",
                                f"{q:.3f}x", q <= VS_BF16_BWD))
    for c in CODECS if "sqnr" in result else ():
        sq = result["sqnr"]
        if f"cc {c}" in sq:
            d = sq[f"cc {c}"]["sqnr_db"] - sq[f"hg {c}"]["sqnr_db"]
            out.append((f"cc {c} SQNR within {SQNR_TOL_DB} dB of hg {c}", f"{d:+.2f} dB",
                        abs(d) <= SQNR_TOL_DB))
        d = sq[f"hg {c}"]["sqnr_db"] - sq[f"hg {c} unsliced"]["sqnr_db"]
        out.append((f"hg {c} SQNR within {SQNR_TOL_DB} dB of unsliced", f"{d:+.2f} dB",
                    abs(d) <= SQNR_TOL_DB))
        dts = sq[f"hg {c}"]["grad_dtypes"]
        out.append((f"hg {c} gradients float32", ", ".join(dts), dts == ["float32"]))
    return out


def write(result, out_dir):
    ver = result["jax"]
    base = os.path.join(out_dir, f"transformer_memory_jax{ver}")
    write_json(base + ".json", result)
    temps = result["peak_temp_bytes"]
    lines = [f"# bf16 transformer: peak temp against the bf16 remat scan (jax {ver}, CPU)", "",
             "Written by `PYTHONPATH=. python benchmarks/transformer_memory_bench.py "
             "--sqnr --hlo`. Peak temp is `compile().memory_analysis().temp_size_in_bytes` "
             "of one training step; *x*: ratio to `remat bf16`; *vs bf16-bwd*: `hg <codec>` "
             "over `bf16-bwd <codec>` (the same checkpoints with a bf16 backward).", ""]
    header = ["model", "blocks", "remat bf16 MiB", "remat f32"]
    for c in CODECS:
        header += [f"hg {c}", f"{c} unsliced", f"bf16-bwd {c}", f"{c} vs bf16-bwd"]
    rows = []
    for key, row in temps.items():
        size, blocks = key.split()
        b = row["remat bf16"]
        r = [size, blocks, f"{b / MiB:.1f}", f"{row['remat f32'] / b:.2f}x"]
        for c in CODECS:
            r += [f"{row[f'hg {c}'] / b:.3f}x", f"{row[f'hg {c} unsliced'] / b:.3f}x",
                  f"{row[f'bf16-bwd {c}'] / b:.3f}x",
                  f"{row[f'hg {c}'] / row[f'bf16-bwd {c}']:.3f}"]
        rows.append(r)
    lines += [md_table(header, rows), ""]
    if any(f"cc {c}" in row for row in temps.values() for c in CODECS):
        lines += ["The drop-in: `hg.grad` over `hg.compress_checkpoints` of the bf16 remat "
                  "scan itself (*x*: ratio to `remat bf16`; *= hg*: whether its peak temp is "
                  "`hg.scan`'s with the same codec).", ""]
        cc_rows = []
        for key, row in temps.items():
            size, blocks = key.split()
            b = row["remat bf16"]
            r = [size, blocks]
            for c in CODECS:
                r += [f"{row[f'cc {c}'] / b:.3f}x",
                      "yes" if row[f"cc {c}"] == row[f"hg {c}"] else "no"]
            cc_rows.append(r)
        cc_header = ["model", "blocks"]
        for c in CODECS:
            cc_header += [f"cc {c}", "= hg"]
        lines += [md_table(cc_header, cc_rows), ""]
    lines += targets_section(targets(result))
    if "sqnr" in result:
        lines += ["## Gradient SQNR vs the float32 model (small model, 2 blocks)", "",
                  md_table(["variant", "SQNR dB", "gradient dtypes"],
                           [[n, f"{v['sqnr_db']:.2f}", ", ".join(v["grad_dtypes"])]
                            for n, v in result["sqnr"].items()]), ""]
    if "hlo" in result:
        lines += ["## HLO of one training step (large model, 12 blocks)", "",
                  "Ops in the optimized HLO (`compile().as_text()`): the sliced backward has "
                  "the dots of the unsliced one (no matmul recomputed), inside one more while "
                  "loop (the slices)." + (f" Re-measured by `{result['hlo_command']}`."
                                          if "hlo_command" in result else ""), "",
                  md_table(["variant", "dot", "while", "fusion"],
                           [[n, v["dot"], v["while"], v["fusion"]]
                            for n, v in result["hlo"].items()]), ""]
    write_md(base, lines, result)


if __name__ == "__main__":
    main()
