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
    return dict(method=method, layout=layout, n=n, trace_s=t1 - t0, lower_s=t2 - t1,
                compile_s=t3 - t2, instructions=instructions, peak_rss_mib=rss,
                step_ms=1e3 * _best_time(compiled, args, reps))


def _best_time(compiled, args, reps: int) -> float:
    """The fastest of `reps` calls (on shared cores the minimum is the least noisy)."""
    import jax

    jax.block_until_ready(compiled(*args))
    best = math.inf
    for _ in range(reps):
        s = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - s)
    return best


def paired_step(layout: str, n: int, reps: int = 20) -> dict:
    """Step time of both methods' compiled programs in one process, calls alternated, so that
    the ratio sees the same load."""
    import jax

    progs = {}
    for m in METHODS:
        g, args = build(m, layout, n)
        progs[m] = (jax.jit(g).lower(*args).compile(), args)
    best = {m: math.inf for m in METHODS}
    for _ in range(reps):
        for m, (c, args) in progs.items():
            best[m] = min(best[m], _best_time(c, args, 1))
    return dict(layout=layout, n=n, **{f"{m} step_ms": 1e3 * t for m, t in best.items()},
                ratio=best["hg.grad"] / best["jax.grad"])


def trace_times(n: int, reps: int = 5) -> dict:
    """Trace time alone (no compile) of both methods at unrolled depth `n`, alternated in one
    process, fastest of `reps` each. Each trace starts after a full garbage collection (so
    neither pays for the other's garbage) and runs with the collector on, as a user's does;
    the same traces with the collector off (as `timeit` times) are reported too."""
    import gc

    import jax

    best = {m: math.inf for m in METHODS}
    best_nogc = {m: math.inf for m in METHODS}
    for _ in range(reps):
        for m in METHODS:
            for table, collect in ((best, True), (best_nogc, False)):
                g, args = build(m, "unrolled", n)
                gc.collect()
                if not collect:
                    gc.disable()
                try:
                    s = time.perf_counter()
                    jax.jit(g).trace(*args)
                    table[m] = min(table[m], time.perf_counter() - s)
                finally:
                    gc.enable()
    return dict(n=n, **{f"{m} trace_s": t for m, t in best.items()},
                ratio=best["hg.grad"] / best["jax.grad"],
                **{f"{m} trace_s no gc": t for m, t in best_nogc.items()},
                ratio_no_gc=best_nogc["hg.grad"] / best_nogc["jax.grad"])


def eager_times(n: int, reps: int = 10) -> list[dict]:
    """Later (un-jitted) calls at unrolled depth `n`, hg against jax, alternated in one
    process, fastest of `reps` each: grad, value_and_grad, a reused vjp function, and
    `precise_backward` under `jax.grad`."""
    import jax
    import jax.numpy as jnp

    import hifigrad as hg

    params = init_params(n, 64)
    x = jax.random.normal(jax.random.key(1), (4, 32, 64))
    loss = make_loss("unrolled", 4, jnp.bfloat16)
    one = jnp.ones((), jnp.float32)
    _, jax_vjp = jax.vjp(loss, params, x)
    _, hg_vjp = hg.vjp(loss, params, x)
    wrapped = hg.precise_backward(loss)
    cases = {
        "grad": (lambda: jax.grad(loss)(params, x), lambda: hg.grad(loss)(params, x)),
        "value_and_grad": (lambda: jax.value_and_grad(loss)(params, x),
                           lambda: hg.value_and_grad(loss)(params, x)),
        "reused vjp_fn": (lambda: jax_vjp(one), lambda: hg_vjp(one)),
        "jax.grad(precise_backward(f))": (lambda: jax.grad(loss)(params, x),
                                          lambda: jax.grad(wrapped)(params, x)),
    }
    out = []
    for name, (fj, fh) in cases.items():
        jax.block_until_ready((fj(), fh()))  # first calls: compile op by op, trace, cache
        best = [math.inf, math.inf]
        for _ in range(reps):
            for i, f in enumerate((fj, fh)):
                s = time.perf_counter()
                jax.block_until_ready(f())
                best[i] = min(best[i], time.perf_counter() - s)
        out.append(dict(case=name, n=n, jax_ms=1e3 * best[0], hg_ms=1e3 * best[1],
                        ratio=best[1] / best[0]))
    return out


def measure_in_subprocess(method, layout, n, reps, timeout_s) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--row", method, layout, str(n),
           "--reps", str(reps)]
    return _run_json(cmd, timeout_s, dict(method=method, layout=layout, n=n))


def _run_json(cmd, timeout_s, what: dict) -> dict:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(what, error=f"timed out after {timeout_s} s")
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(what, error=tail[0][:200])
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


def report(rows, env, paired=(), extra=None) -> str:
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
    if paired:
        lines += ["## Step time, both programs in one process (calls alternated, fastest of "
                  "each)", ""]
        lines += [md_table(["layout", "N", "jax.grad ms", "hg.grad ms", "hg / jax"],
                           [[p["layout"], p["n"], f(p.get("jax.grad step_ms"), ".2f"),
                             f(p.get("hg.grad step_ms"), ".2f"), f(p.get("ratio"), ".2f")]
                            if "error" not in p else [p["layout"], p["n"], p["error"], "", ""]
                            for p in paired]), ""]
    extra = extra or {}
    if extra.get("trace"):
        lines += ["## Trace time alone (both in one process, alternated, fastest of 5; each "
                  "after a full garbage collection, with the collector on, and off as `timeit` "
                  "times)", ""]
        lines += [md_table(["N", "jax.grad s", "hg.grad s", "hg / jax",
                            "jax.grad s, gc off", "hg.grad s, gc off", "hg / jax, gc off"],
                           [[t["n"], f(t.get("jax.grad trace_s"), ".2f"),
                             f(t.get("hg.grad trace_s"), ".2f"), f(t.get("ratio"), ".2f"),
                             f(t.get("jax.grad trace_s no gc"), ".2f"),
                             f(t.get("hg.grad trace_s no gc"), ".2f"),
                             f(t.get("ratio_no_gc"), ".2f")]
                            if "error" not in t else [t["n"], t["error"], "", "", "", "", ""]
                            for t in extra["trace"]]), ""]
    if extra.get("eager"):
        lines += ["## Later eager calls (un-jitted; alternated, fastest of 10)", ""]
        lines += [md_table(["case", "N", "jax ms", "hg ms", "hg / jax"],
                           [[e.get("case", "-"), e["n"], f(e.get("jax_ms"), ".1f"),
                             f(e.get("hg_ms"), ".1f"), f(e.get("ratio"), ".2f")]
                            if "error" not in e else ["-", e["n"], e["error"], "", ""]
                            for e in extra["eager"]]), ""]
    lines += ["## Growth exponents (metric ~ N**e, least squares over the N swept)", ""]
    lines += [md_table(["method", "layout", *METRICS],
                       [[e["method"], e["layout"], *[f(e[k], ".2f") for k in METRICS]]
                        for e in exponents(rows)]), ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    choices=METHODS + EXTRA_METHODS)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timeout-s", type=int, default=600)
    ap.add_argument("--out", default=None, help="path prefix for .md and .json")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="write --out from these runs' JSON files (one per JAX release)")
    ap.add_argument("--paired-ns", type=int, nargs="*", default=[32],
                    help="unrolled depths whose step time is also measured with both programs "
                         "in one process")
    ap.add_argument("--trace-ns", type=int, nargs="*", default=[64],
                    help="unrolled depths whose trace time alone is measured, both in one "
                         "process")
    ap.add_argument("--eager-n", type=int, nargs="*", default=[2],
                    help="unrolled depths whose later eager calls are timed")
    ap.add_argument("--extra", nargs=2, metavar=("KIND", "N"),
                    help="internal: one trace or eager measurement in this process")
    ap.add_argument("--paired", nargs=2, metavar=("LAYOUT", "N"),
                    help="internal: measure one paired step time in this process")
    ap.add_argument("--row", nargs=3, metavar=("METHOD", "LAYOUT", "N"),
                    help="internal: measure one row in this process and print it as JSON")
    args = ap.parse_args(argv)
    if args.extra:
        kind, n = args.extra[0], int(args.extra[1])
        print(json.dumps(trace_times(n) if kind == "trace" else eager_times(n)))
        return None
    if args.paired:
        print(json.dumps(paired_step(args.paired[0], int(args.paired[1]))))
        return None
    if args.row:
        m, layout, n = args.row
        print(json.dumps(measure(m, layout, int(n), reps=args.reps)))
        return None
    from _common import env_info, write_json

    if args.merge:
        runs = {}
        for path in args.merge:  # runs of one release (a sweep, extra measurements) combine
            r = json.load(open(path))
            into = runs.setdefault(r["env"]["jax"], dict(env=dict(r["env"])))
            if into["env"] is not r["env"] and r["env"]["command"] not in into["env"]["command"]:
                into["env"]["command"] += "`, then `" + r["env"]["command"]
            for k in ("rows", "paired", "trace", "eager"):
                into[k] = into.get(k, []) + r.get(k, [])
        runs = list(runs.values())
        text = "\n\n".join(report(r["rows"], r["env"], r.get("paired", ()),
                                    dict(trace=r.get("trace", []), eager=r.get("eager", [])))
                             for r in runs)
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        write_json(args.out + ".json", {f"jax {r['env']['jax']}": r for r in runs})
        return None
    rows = []
    for layout in args.layouts:
        for n in args.ns:
            for m in args.methods:
                r = measure_in_subprocess(m, layout, n, args.reps, args.timeout_s)
                print(json.dumps(r), flush=True)
                rows.append(r)
    paired = []
    for n in args.paired_ns:
        cmd = [sys.executable, os.path.abspath(__file__), "--paired", "unrolled", str(n)]
        p = _run_json(cmd, args.timeout_s, dict(layout="unrolled", n=n))
        print(json.dumps(p), flush=True)
        paired.append(p)
    extra = dict(trace=[], eager=[])
    for kind, ns in (("trace", args.trace_ns), ("eager", args.eager_n)):
        for n in ns:
            cmd = [sys.executable, os.path.abspath(__file__), "--extra", kind, str(n)]
            r = _run_json(cmd, args.timeout_s, dict(layout="unrolled", n=n))
            print(json.dumps(r), flush=True)
            extra[kind] += r if isinstance(r, list) else [r]
    env = env_info(sys.argv if argv is None else ["benchmarks/scaling_bench.py", *argv])
    text = report(rows, env, paired, extra)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as fh:
            fh.write(text)
        write_json(args.out + ".json", dict(env=env, rows=rows, ratios=ratios(rows),
                                            exponents=exponents(rows), paired=paired,
                                            **extra))
    return rows


if __name__ == "__main__":
    main()
