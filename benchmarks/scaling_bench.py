"""How compile time and size grow with depth: `hg.grad` vs `jax.grad` of a bf16 transformer.

N pre-LN blocks (layer norm, causal multi-head attention, GELU MLP 4x), float32 master
parameters cast to bf16 inside the loss, unrolled (a Python loop over blocks) or scanned
(`lax.scan` over stacked blocks). Each row runs in its own subprocess (a fresh process after
`jax.clear_caches()` is not enough for a fair peak RSS) and reports: trace, lower and compile
time, the compiled program's HLO instruction count, the subprocess's peak RSS
(`resource.getrusage(...).ru_maxrss`) and the compiled step time (median of `--reps` calls).
Growth exponents are least-squares slopes of log(metric) over log(N).

    python benchmarks/scaling_bench.py --ns 8 16 32 --out benchmarks/results/scaling_cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

METHODS = ("jax.grad", "hg.grad")
# Not run by default: a float32 model under plain jax.grad, as written and with each block's
# output divided by an opaque 1 (`split_blocks`), the docs' advice for such models on CPU.
EXTRA_METHODS = ("jax.grad f32", "jax.grad f32 split")
LAYOUTS = ("unrolled", "scanned")
METRICS = ("trace_s", "lower_s", "compile_s", "instructions", "peak_rss_mib", "step_ms")


# ------------------------------------------------------------------------------ the model

def init_params(n: int, d: int, seed: int = 0):
    import jax

    s = 0.02
    keys = jax.random.split(jax.random.key(seed), 4 * n)

    def blk(i):
        k = keys[4 * i:4 * i + 4]
        return dict(ln1=np.ones(d, np.float32), ln2=np.ones(d, np.float32),
                    qkv=jax.random.normal(k[0], (d, 3 * d)) * s,
                    o=jax.random.normal(k[1], (d, d)) * s,
                    w1=jax.random.normal(k[2], (d, 4 * d)) * s,
                    w2=jax.random.normal(k[3], (4 * d, d)) * s)

    return [blk(i) for i in range(n)]


def _layer_norm(x, g):
    import jax

    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g[None, None]


def block(p, x, heads: int, dtype):
    """One pre-LN block on `x` [batch, seq, d] in `dtype` (parameters cast to it here)."""
    import jax
    import jax.numpy as jnp

    b, t, d = x.shape
    p = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)
    h = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, -1)

    def heads_first(a):
        return a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    s = (q @ k.transpose(0, 1, 3, 2)) / np.asarray(np.sqrt(d // heads), dtype)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s, jnp.asarray(-1e4, dtype))
    a = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + a @ p["o"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def split_blocks(x):
    """`x` unchanged, divided by a 1 that XLA only sees after its algebraic simplifier: a
    divide, which XLA:CPU's instruction fusion never duplicates, so the float32 residual
    stream (and its cotangent) is computed once per block instead of once per consumer."""
    import jax

    return x / jax.lax.optimization_barrier(jax.lax.full_like(x, 1))


def make_loss(layout: str, heads: int, dtype, split: bool = False):
    import jax
    import jax.numpy as jnp

    def loss(params, x):
        x = x.astype(dtype)
        if layout == "unrolled":
            for p in params:
                x = block(p, x, heads, dtype)
                x = split_blocks(x) if split else x
        else:
            x, _ = jax.lax.scan(lambda c, p: (block(p, c, heads, dtype), None), x, params)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    return loss


def build(method: str, layout: str, n: int, d: int = 64, seq: int = 32, batch: int = 4,
          heads: int = 4):
    """(gradient function, its arguments) for one row."""
    import jax
    import jax.numpy as jnp

    import hifigrad as hg

    params = init_params(n, d)
    if layout == "scanned":
        params = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params)
    x = jax.random.normal(jax.random.key(1), (batch, seq, d))
    f32 = method.startswith("jax.grad f32")
    loss = make_loss(layout, heads, jnp.float32 if f32 else jnp.bfloat16,
                     split=method.endswith("split"))
    grad = hg.grad if method == "hg.grad" else jax.grad
    return grad(loss), (params, x)


def count_instructions(hlo_text: str) -> int:
    """HLO instructions (lines ``%name = ...``) of a compiled module's text, fusion bodies
    included."""
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo_text, re.M))


def measure(method: str, layout: str, n: int, reps: int = 5, **kw) -> dict:
    """One row, in this process (run it in a fresh one: peak RSS is the process's)."""
    import resource

    import jax

    g, args = build(method, layout, n, **kw)
    jitted = jax.jit(g)
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    instructions = count_instructions(compiled.as_text())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        s = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - s)
    return dict(method=method, layout=layout, n=n, trace_s=t1 - t0, lower_s=t2 - t1,
                compile_s=t3 - t2, instructions=instructions, peak_rss_mib=rss,
                step_ms=1e3 * float(np.median(times)))


def measure_in_subprocess(method, layout, n, reps, timeout_s) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--row", method, layout, str(n),
           "--reps", str(reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(method=method, layout=layout, n=n, error=f"timed out after {timeout_s} s")
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(method=method, layout=layout, n=n, error=tail[0][:200])
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ analysis

def growth_exponent(ns, values) -> float | None:
    """Least-squares slope of log(value) over log(n): value ~ n**slope."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v and v > 0]
    if len(pts) < 2:
        return None
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def ratios(rows) -> list[dict]:
    """hg.grad / jax.grad for each (layout, n) that has both rows."""
    by = {(r["method"], r["layout"], r["n"]): r for r in rows if "error" not in r}
    out = []
    for (m, layout, n), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        j = by.get(("jax.grad", layout, n))
        if m != "hg.grad" or j is None:
            continue
        out.append(dict(layout=layout, n=n, **{k: r[k] / j[k] for k in METRICS if j[k]}))
    return out


def exponents(rows) -> list[dict]:
    out = []
    for m in METHODS + EXTRA_METHODS:
        for layout in LAYOUTS:
            rs = sorted((r for r in rows if r["method"] == m and r["layout"] == layout
                         and "error" not in r), key=lambda r: r["n"])
            if len(rs) < 2:
                continue
            ns = [r["n"] for r in rs]
            out.append(dict(method=m, layout=layout, **{
                k: growth_exponent(ns, [r[k] for r in rs]) for k in METRICS}))
    return out


def report(rows, env) -> str:
    from _common import md_table

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"# Scaling with depth: hg.grad vs jax.grad (CPU, jax {env['jax']})", "",
             f"Command: `{env['command']}`", "", f"Machine: {env['cpu']}", "",
             "Model: N pre-LN blocks (d=64, 4 heads, seq 32, batch 4, MLP 4x, GELU), float32 "
             "master parameters cast to bf16 inside the loss; one subprocess per row.", ""]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["method"], r["layout"], r["n"], r["error"], "", "", "", "", ""])
            continue
        body.append([r["method"], r["layout"], r["n"], f(r["trace_s"], ".2f"),
                     f(r["lower_s"], ".2f"), f(r["compile_s"], ".2f"),
                     f"{r['instructions']:,}", f(r["peak_rss_mib"], ".0f"),
                     f(r["step_ms"], ".2f")])
    lines += [md_table(["method", "layout", "N", "trace s", "lower s", "compile s",
                        "instructions", "peak RSS MiB", "step ms"], body), ""]
    lines += ["## hg.grad / jax.grad", ""]
    lines += [md_table(["layout", "N", *METRICS],
                       [[r["layout"], r["n"], *[f(r.get(k), ".2f") for k in METRICS]]
                        for r in ratios(rows)]), ""]
    lines += ["## Growth exponents (metric ~ N**e, least squares over the N swept)", ""]
    lines += [md_table(["method", "layout", *METRICS],
                       [[e["method"], e["layout"], *[f(e[k], ".2f") for k in METRICS]]
                        for e in exponents(rows)]), ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout-s", type=int, default=600)
    ap.add_argument("--out", default=None, help="path prefix for .md and .json")
    ap.add_argument("--row", nargs=3, metavar=("METHOD", "LAYOUT", "N"),
                    help="internal: measure one row in this process and print it as JSON")
    args = ap.parse_args(argv)
    if args.row:
        m, layout, n = args.row
        print(json.dumps(measure(m, layout, int(n), reps=args.reps)))
        return None
    from _common import env_info, write_json

    rows = []
    for layout in args.layouts:
        for n in args.ns:
            for m in args.methods:
                r = measure_in_subprocess(m, layout, n, args.reps, args.timeout_s)
                print(json.dumps(r), flush=True)
                rows.append(r)
    env = env_info(sys.argv if argv is None else ["benchmarks/scaling_bench.py", *argv])
    text = report(rows, env)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        write_json(args.out + ".json", dict(env=env, rows=rows, ratios=ratios(rows),
                                            exponents=exponents(rows)))
    return rows


if __name__ == "__main__":
    main()
