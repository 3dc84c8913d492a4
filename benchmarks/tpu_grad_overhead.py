"""Where hg.grad's time goes against bf16 jax.grad on a TPU: the 12-block scanned GPT of
`gpu_bench.py` (d=1024, 16 heads, 8 x 512 tokens, vocab 8192, bf16 compute from float32
masters), each step compiled and timed in one process (median of 10 steps after 2 warm-up
calls), with XLA's cost analysis (bytes accessed, flops), the temp allocation, and the
optimized HLO of each (``--hlo-dir``).

Variants: ``jax.grad``; ``hg.grad`` with the default policy and with each ``coefficients``
choice; ``hg.grad`` with ``matmul='exact'``. Run on the device machine from the repository
root::

    PYTHONPATH=. python3 benchmarks/tpu_grad_overhead.py --out-dir $OUT

It writes ``tpu_grad_overhead.json`` (and the HLO, tarred, with ``--hlo-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

import hifigrad as hg  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--hlo-dir", default=None)
    args = ap.parse_args(argv)
    L, d, H, V, B, T = args.blocks, 1024, 16, 8192, 8, 512
    params = gb.gpt_init(jax.random.key(3), blocks=L, d=d, mlp=4, vocab=V)
    k1, k2 = jax.random.split(jax.random.key(4))
    toks = jax.random.randint(k1, (B, T), 0, V)
    tgts = jax.random.randint(k2, (B, T), 0, V)
    plain = gb.make_gpt_loss(heads=H)
    rows = {"jax.grad": jax.grad(plain), "hg.grad": hg.grad(plain),
            "hg.grad coefficients=forward": hg.grad(
                plain, policy=hg.Policy(coefficients="forward")),
            "hg.grad coefficients=tangent": hg.grad(
                plain, policy=hg.Policy(coefficients="tangent")),
            "hg.grad matmul=exact": hg.grad(plain, policy=hg.Policy(matmul="exact"))}
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name, f in rows.items():
        opts = {}
        if args.hlo_dir:
            opts = {"xla_dump_to": os.path.join(args.hlo_dir, name.replace(" ", "_")),
                    "xla_dump_hlo_as_text": True}
        c = jax.jit(f).lower(params, toks, tgts).compile(compiler_options=opts)
        ca = c.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        jax.block_until_ready(c(params, toks, tgts))
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(c(params, toks, tgts))
            ts.append(time.perf_counter() - t0)
        res[name] = {"ms": 1e3 * statistics.median(ts[2:]),
                     "bytes_accessed": ca.get("bytes accessed"), "flops": ca.get("flops"),
                     "temp_MiB": c.memory_analysis().temp_size_in_bytes / 2 ** 20}
        print(name, json.dumps(res[name]), flush=True)
    base = res["jax.grad"]
    for k in rows:
        v = res[k]
        print(f"{k:32s} {v['ms']:7.2f} ms {v['ms'] / base['ms']:.3f}x  bytes "
              f"{v['bytes_accessed'] / base['bytes_accessed']:.3f}x  temp {v['temp_MiB']:.0f} MiB")
    with open(os.path.join(args.out_dir, "tpu_grad_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    if args.hlo_dir:
        with tarfile.open(os.path.join(args.out_dir, "hlo.tar.gz"), "w:gz") as t:
            for root, _, files in os.walk(args.hlo_dir):
                for fn in files:
                    if fn.endswith("after_optimizations.txt"):
                        t.add(os.path.join(root, fn),
                              arcname=os.path.relpath(os.path.join(root, fn), args.hlo_dir))


if __name__ == "__main__":
    main()
