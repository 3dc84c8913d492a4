"""HLO census: what the CUDA program of each benchmark row multiplies, read from its StableHLO.

No GPU is needed: JAX lowers a function for a platform it is not running on,
``jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',))`` (works on jax 0.10.2, 0.11.2
and 0.12.0.1; ``jax.export.export(jax.jit(f), platforms=['cuda'])`` works too;
``jax.jit(f).lower(*args, _platforms=...)`` does not). The rows are `benchmarks/gpu_bench.py`'s
(both models, at its ``--small`` sizes unless given others), each lowered for CUDA, and the
StableHLO text is counted:

* ``stablehlo.dot_general`` ops by operand and result element types and precision config:
  ``bf16 x bf16 -> f32`` runs on bf16 tensor cores with f32 accumulation; ``f32 x f32`` at
  ``DEFAULT`` precision runs as TF32 on NVIDIA GPUs, at ``HIGHEST`` as true f32;
* ``stablehlo.convert`` ops by (from, to) type, with their total elements;
* the f32 elements flowing through dots (sum of the operand sizes of dots with an f32 operand)
  beside the bf16 ones.

Counts are static: each op of the program text once (a scanned block's body appears once
however many blocks there are), so rows compare on equal terms. `lax.platform_dependent`
branches (``Policy(matmul='fast')`` keeps f32 operands on CPU only) lower to the CUDA branch.

Caveat for ``Policy(matmul='auto')`` (and the default policy where it is 'auto'): hifigrad
resolves it from `jax.default_backend()` while tracing, so on a CPU host it traces as 'exact'
even when lowering for CUDA; on the GPU machine it resolves to 'fast'. The table says which.

Run from the repository root::

    PYTHONPATH=. python benchmarks/hlo_census.py      # writes benchmarks/results/hlo_census.md
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import time
import warnings

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402
from _common import env_info, md_table, write_json  # noqa: E402

import hifigrad as hg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_TENSOR = r"tensor<([^>]*)>"
_DOT = re.compile(r":\s*\(" + _TENSOR + r", " + _TENSOR + r"\)\s*->\s*" + _TENSOR + r"\s*$")
_CALL = re.compile(r"stablehlo\.custom_call @([\w.$-]+)")
_PREC = re.compile(r"precision = \[(\w+), (\w+)\]")
_CONVERT = re.compile(r"stablehlo\.convert [^:]*:\s*\(" + _TENSOR + r"\)\s*->\s*" + _TENSOR)


def parse_type(t: str) -> tuple[tuple[int, ...], str]:
    """``'2x32x64xbf16'`` -> ((2, 32, 64), 'bf16'); ``'f32'`` -> ((), 'f32')."""
    t = t.split(",")[0].strip()
    parts = t.split("x")
    dims = tuple(int(p) for p in parts[:-1] if p.isdigit())
    return dims, parts[-1]


def lower_for_cuda(fn, args, precision=None) -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for CUDA (no GPU needed)."""
    ctx = jax.default_matmul_precision(precision) if precision else _null()
    with ctx:
        traced = jax.jit(fn).trace(*args)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def census(text: str) -> dict:
    dots, dot_elems = collections.Counter(), collections.Counter()
    converts, conv_elems = collections.Counter(), collections.Counter()
    calls = collections.Counter()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = _DOT.search(line)
            if not m:
                dots[("unparsed", "", "", "")] += 1
                continue
            pm = _PREC.search(line)
            prec = "DEFAULT" if pm is None else (
                pm.group(1) if pm.group(1) == pm.group(2) else f"{pm.group(1)},{pm.group(2)}")
            (ls, lt), (rs, rt), (_, ot) = (parse_type(m.group(i)) for i in (1, 2, 3))
            alg = " alg" if "algorithm = <" in line else ""
            key = (lt, rt, ot, prec + alg)
            dots[key] += 1
            dot_elems[key] += math.prod(ls) + math.prod(rs)
        elif "stablehlo.custom_call" in line:
            m = _CALL.search(line)
            if m:
                ops = re.findall(_TENSOR, line.split("->")[0].rsplit(": (", 1)[-1])
                types = sorted({parse_type(t)[1] for t in ops})
                calls[f"{m.group(1)} ({','.join(types)})"] += 1
        elif "stablehlo.convert" in line:
            m = _CONVERT.search(line)
            if not m:
                continue
            (s, a), (_, b) = parse_type(m.group(1)), parse_type(m.group(2))
            converts[(a, b)] += 1
            conv_elems[(a, b)] += math.prod(s)
    f32_dot = sum(n for k, n in dot_elems.items() if "f32" in k[:2])
    low_dot = sum(n for k, n in dot_elems.items() if "f32" not in k[:2])
    return {
        "dots": {" x ".join(k[:2]) + f" -> {k[2]} [{k[3]}]": v for k, v in dots.items()},
        "dot_operand_elements": {" x ".join(k[:2]) + f" -> {k[2]} [{k[3]}]": v
                                 for k, v in dot_elems.items()},
        "converts": {f"{a} -> {b}": v for (a, b), v in converts.items()},
        "convert_elements": {f"{a} -> {b}": v for (a, b), v in conv_elems.items()},
        "n_dots": sum(dots.values()),
        "n_dots_f32_operand": sum(v for k, v in dots.items() if "f32" in k[:2]),
        "n_dots_low_operands": sum(v for k, v in dots.items() if "f32" not in k[:2]),
        "n_dots_highest": sum(v for k, v in dots.items() if k[3].startswith("HIGHEST")),
        "f32_dot_operand_elements": f32_dot,
        "low_dot_operand_elements": low_dot,
        "custom_calls": dict(calls),
        "n_converts": sum(converts.values()),
        "converted_elements": sum(conv_elems.values()),
    }


def model_data(model, cfg):
    if model == "gpt":
        params = gb.gpt_init(jax.random.key(0), blocks=cfg.blocks, d=cfg.d, mlp=cfg.mlp,
                             vocab=cfg.vocab)
        tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq), 0, cfg.vocab)
        return gb.gpt_rows(cfg), (params, tokens, jnp.roll(tokens, -1, axis=1))
    params = gb.mlp_init(jax.random.key(0), blocks=cfg.mlp_blocks, d=cfg.mlp_d,
                         hidden=cfg.mlp_hidden)
    x = jax.random.normal(jax.random.key(1), (cfg.tokens, cfg.mlp_d), jnp.float32)
    return gb.mlp_rows(cfg), (params, x)


class auto_as_on_gpu:
    """Makes ``Policy(matmul='auto')`` resolve as it does on a GPU host ('fast') while tracing
    here, by emptying hifigrad's per-platform table (`_AUTO_MATMUL`; absent in a hifigrad
    without 'auto', where this does nothing)."""

    def __enter__(self):
        from hifigrad._src import policy as P

        self.mod, self.saved = P, getattr(P, "_AUTO_MATMUL", None)
        if self.saved is not None:
            P._AUTO_MATMUL = {}
        return self.saved is not None

    def __exit__(self, *a):
        if self.saved is not None:
            self.mod._AUTO_MATMUL = self.saved
        return False


class cudnn_on_cpu:
    """Lets JAX trace its cuDNN attention on a host without cuDNN (as tests/test_attention.py
    does): the cuDNN version check is stubbed (9.10) while tracing; nothing runs."""

    def __enter__(self):
        from jax._src.cudnn import fused_attention_stablehlo as fa

        self.fa, self.saved = fa, fa.check_cudnn_version
        fa.check_cudnn_version = lambda *a, **k: 91000
        return self

    def __exit__(self, *a):
        self.fa.check_cudnn_version = self.saved
        return False


def _census_row(r, data, gpu_auto=False) -> dict:
    res = {"status": "ok"}
    t0 = time.perf_counter()
    try:
        if r.build is None:
            raise RuntimeError(r.skip)
        with warnings.catch_warnings(), (auto_as_on_gpu() if gpu_auto else _null()), \
                (cudnn_on_cpu() if "cudnn" in r.name else _null()):
            warnings.simplefilter("ignore")
            text = lower_for_cuda(r.build(), data, r.precision)
        res.update(census(text))
    except Exception as e:  # noqa: BLE001 - reported in the table
        res["status"] = f"error: {gb._short(e, 160)}"
    res["lower_s"] = time.perf_counter() - t0
    return res


def run(models, cfg, rows_filter=None, gpu_auto=True):
    """Census of every row; rows that use hifigrad are lowered a second time with 'auto'
    resolved as on a GPU host, kept (as ``<row> [auto as on GPU]``) when the program differs."""
    out = []
    for model in models:
        rows, data = model_data(model, cfg)
        for r in rows:
            if rows_filter and r.name not in rows_filter:
                continue
            variants = [(r.name, False)]
            if gpu_auto and "hg." in r.name:
                variants.append((f"{r.name} [auto as on GPU]", True))
            first = None
            for name, patched in variants:
                res = {"model": model, "row": name, "what": r.what, **_census_row(r, data,
                                                                                  patched)}
                if patched and first is not None and all(
                        res.get(k) == first.get(k) for k in ("status", "dots", "converts")):
                    continue  # same program: 'auto' does not enter this row
                first = first or res
                print(f"[{model}] {name}: {res['status']}"
                      + (f"; dots {res['n_dots']} (f32-operand {res['n_dots_f32_operand']}, "
                         f"low-precision {res['n_dots_low_operands']}), converts "
                         f"{res['n_converts']}" if res["status"] == "ok" else ""), flush=True)
                out.append(res)
    return out


def _fmt_counter(d: dict) -> str:
    return "; ".join(f"{v}x {k}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def write_report(results, cfg, env, path):
    head = ["model", "row", "dots", "f32-operand dots (of which HIGHEST)",
            "low-precision-operand dots", "f32 dot operand elements",
            "low-precision dot operand elements", "converts", "converted elements"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["model"], r["row"], r["status"].replace("|", "/")] + ["-"] * 6)
            continue
        rows.append([r["model"], r["row"], r["n_dots"],
                     f"{r['n_dots_f32_operand']} ({r['n_dots_highest']})",
                     r["n_dots_low_operands"], f"{r['f32_dot_operand_elements']:,}",
                     f"{r['low_dot_operand_elements']:,}", r["n_converts"],
                     f"{r['converted_elements']:,}"])
    detail = [[r["model"], r["row"], _fmt_counter(r["dots"]), _fmt_counter(r["converts"]),
               _fmt_counter(r.get("custom_calls", {}))]
              for r in results if r["status"] == "ok"]
    p = hg.Policy()
    resolved = p.resolved_matmul() if hasattr(p, "resolved_matmul") else p.matmul
    on_gpu = p.resolved_matmul("gpu") if hasattr(p, "resolved_matmul") else p.matmul
    md = [
        "# HLO census: the CUDA programs of the GPU benchmark's rows, lowered on CPU",
        "",
        f"- date: {env['date']}; command: `{env['command']}` (from the repository root)",
        f"- jax {env['jax']}, jaxlib {env['jaxlib']}, Python {env['python']}; lowered with "
        f"`jax.jit(g).trace(*args).lower(lowering_platforms=('cuda',))` on "
        f"{env['backend']}; nothing ran on a GPU.",
        f"- sizes: GPT {cfg.blocks} blocks, d={cfg.d}, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"batch {cfg.batch} x {cfg.seq}; MLP {cfg.mlp_blocks} blocks, d={cfg.mlp_d}, hidden "
        f"{cfg.mlp_hidden}, {cfg.tokens} tokens. Counts are static (each op of the program "
        f"text once; a scan body once), element counts are per op occurrence.",
        f"- `hg.Policy()` here: matmul={p.matmul!r}, traced on this host as {resolved!r}; on a "
        f"GPU host it resolves to {on_gpu!r}. Rows whose policy is 'auto' (the default policy, "
        f"and `hg.scan`'s backward, which runs under `Policy()` unless given one) are lowered "
        f"twice: as traced on this host, and as `<row> [auto as on GPU]` with 'auto' resolved "
        f"as on a GPU host (hifigrad's per-platform table emptied while tracing); the second "
        f"is listed only where the program differs.",
        "- `bf16 x bf16 -> f32`: bf16 tensor cores, f32 accumulation. `f32 x f32` at "
        "DEFAULT precision: TF32 on NVIDIA GPUs; at HIGHEST: full f32. `alg`: the dot carries "
        "an explicit `algorithm` attribute. The cuDNN rows are traced with JAX's cuDNN version "
        "check stubbed (as tests/test_attention.py does); their attention runs in the "
        "`custom_call`s listed in the second table, not in `dot_general`s.",
        "",
        md_table(head, rows),
        "",
        "## Dots and converts by type",
        "",
        md_table(["model", "row", "dot_general (lhs x rhs -> out [precision])",
                  "convert (from -> to)", "custom_call (operand types)"], detail),
        "",
    ]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    write_json(path + ".json", {"env": env, "config": vars(cfg.args), "rows": results})
    print("\n".join(md[:13]))
    print(f"wrote {path}.md and {path}.json")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    ap.add_argument("--full", action="store_true",
                    help="the GPU sizes instead of gpu_bench's --small sizes (slower)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "hlo_census"),
                    help="output path without extension (.md and .json)")
    args, rest = ap.parse_known_args(argv)
    bench_args = gb.parse(rest + ([] if args.full else ["--small"]))
    cfg = gb.Config(bench_args)
    env = env_info([os.path.relpath(os.path.abspath(__file__))] + argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rows = set(args.rows.split(",")) if args.rows else None
    results = run(models, cfg, rows)
    write_report(results, cfg, env, args.out)
    return results


if __name__ == "__main__":
    main()
