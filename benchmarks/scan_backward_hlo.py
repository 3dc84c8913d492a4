"""Op counts of the backward scan of `jax.grad` over a scanned bf16-compute MLP, from HLO.

`hg.scan(codec='fp8_e4m3' / 'int8', policy=Policy(matmul=MODE))` against the bf16
`lax.scan(jax.checkpoint(block))`, for the seed's blocks ``c + W2 gelu(W1 LN(c))`` (f32 carry,
bf16 compute; the reference carries bf16). Two views of the backward while loop's body (and the
functions / fused computations it calls):

* CUDA StableHLO, lowered without a GPU: ``jax.jit(f).trace(*args).lower(
  lowering_platforms=('cuda',)).as_text()`` (before XLA's optimizations);
* XLA:CPU's optimized HLO, ``jax.jit(f).lower(*args).compile().as_text()``: kernels (``body
  ...``: the loop body's own instructions, i.e. buffers) and converts inside fusions.

Run from the repository root (prints markdown; benchmarks/results/scan_backward_hlo.md)::

    PYTHONPATH=. python benchmarks/scan_backward_hlo.py fast [DUMP_DIR]
"""

from __future__ import annotations

import collections
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import hifigrad as hg

N, B, D, H = 4, 256, 128, 512
BF = jnp.bfloat16


def ln(x, eps=1e-5):
    mu = jnp.mean(x, -1, keepdims=True)
    return (x - mu) * lax.rsqrt(jnp.mean(jnp.square(x - mu), -1, keepdims=True) + eps)


def block(c, p):  # the seed's: f32 carry, bf16 compute
    x = c.astype(BF)
    return c + (jax.nn.gelu(ln(x) @ p[0].astype(BF)) @ p[1].astype(BF)).astype(jnp.float32), None


def block_bf16(c, p):  # the bf16 remat reference: bf16 carry
    return c + jax.nn.gelu(ln(c) @ p[0].astype(BF)) @ p[1].astype(BF), None


def variants(mode):
    pol = hg.Policy(matmul=mode)
    return {
        "remat bf16": lambda p, x: lax.scan(jax.checkpoint(block_bf16), x.astype(BF), p)[0]
        .astype(jnp.float32),
        "hg.scan fp8_e4m3": lambda p, x: hg.scan(block, x, p, codec="fp8_e4m3", policy=pol)[0],
        "hg.scan int8": lambda p, x: hg.scan(block, x, p, codec="int8", policy=pol)[0],
    }


ARGS = ((jax.ShapeDtypeStruct((N, D, H), jnp.float32),
         jax.ShapeDtypeStruct((N, H, D), jnp.float32)),
        jax.ShapeDtypeStruct((B, D), jnp.float32))


def grad_of(fn):
    return jax.jit(jax.grad(lambda p, x: jnp.mean(fn(p, x) ** 2)))


def nel(dims):
    return int(np.prod([int(s) for s in dims if s])) if dims else 1


INSTR = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\((.*)")


def computations(text):
    comps, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None and line.startswith("  "):
            comps[cur].append(line)
    return comps


def cpu_body_counts(text):
    """Counts over the backward while body (transpose(jvp())/while) and what it calls."""
    comps = computations(text)
    body = None
    for lines in comps.values():
        for l in lines:
            if " while(" in l and "transpose(jvp())/while" in l:
                body = re.search(r"body=%?([\w.\-]+)", l).group(1)
    c = collections.Counter()
    seen, stack = set(), [body]
    shapes = {}
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        fused = name != body
        for l in comps[name]:
            for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", l):
                stack.append(callee)
            m = INSTR.match(l)
            if not m:
                continue
            var, dt, shp, op, rest = m.groups()
            shapes[var] = dt
            if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            if not fused:  # kernels / buffers of the loop body
                c[f"body {op}" if op != "fusion" else "body fusion"] += 1
                if op == "fusion":
                    k = re.search(r"kind=(\w+)", l).group(1)
                    c[f"body fusion {k}"] += 1
                c["body f32 buffer elements" if dt == "f32" else f"body {dt} buffer elements"] += \
                    nel(shp.split(","))
            if op == "convert":
                c["convert (incl. fused)"] += 1
                c["convert elements (incl. fused)"] += nel(shp.split(","))
            if op == "dot":
                srcs = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
                c[f"dot {'x'.join(shapes.get(s, '?') for s in srcs[:2])}->{dt}"] += 1
    return c


def stablehlo_body_counts(text):
    """Counts over the second stablehlo.while (the backward scan) and the functions it calls."""
    lines = text.splitlines()
    funcs, cur = {}, None
    for l in lines:
        m = re.match(r"\s*func\.func (?:public|private) @([\w.\-]+)\(", l)
        if m:
            cur = m.group(1)
            funcs[cur] = []
        elif cur:
            funcs[cur].append(l)
    main = funcs["main"]
    starts = [i for i, l in enumerate(main) if "stablehlo.while" in l]
    i0 = starts[1]
    depth, body = 0, []
    for l in main[i0:]:
        body.append(l)
        depth += l.count("{") - l.count("}")
        if depth <= 0 and len(body) > 1 and l.strip().startswith("}"):
            break
    c = collections.Counter()
    stack, seen = [body], set()
    while stack:
        blk = stack.pop()
        for l in blk:
            for f in re.findall(r"func\.call @([\w.\-]+)", l):
                if f not in seen:
                    seen.add(f)
                    stack.append(funcs.get(f, []))
            m = re.search(r"= \"?(stablehlo|chlo)\.(\w+)\"?", l)
            if not m:
                continue
            op = m.group(2)
            if op in ("constant", "return"):
                continue
            c[op] += 1
            t = re.search(r": \(([^)]*)\) -> (.*)$", l.split(" loc(")[0])
            if op == "convert" and t:
                src = t.group(1).split("x")[-1].rstrip(">")
                out = t.group(2)
                dst = out.split("x")[-1].rstrip(">")
                c[f"convert {src}->{dst}"] += 1
                c["convert elements"] += nel(re.findall(r"(\d+)x", out))
            if op == "dot_general" and t:
                a, b2 = [s.split("x")[-1].rstrip(">") for s in t.group(1).split(", ")]
                c[f"dot_general {a}x{b2}->{t.group(2).split('x')[-1].rstrip('>')}"] += 1
    return c


def show(title, counts):
    names = list(counts)
    keys = sorted({k for cc in counts.values() for k in cc})
    print(f"\n### {title}\n")
    print("| op | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for k in keys:
        print(f"| {k} | " + " | ".join(str(counts[n].get(k, 0)) for n in names) + " |")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fast"
    dump = sys.argv[2] if len(sys.argv) > 2 else None
    print(f"jax {jax.__version__}; Policy(matmul={mode!r}); {N} blocks, batch {B}, d={D}, "
          f"hidden {H}")
    cpu, cuda = {}, {}
    for name, fn in variants(mode).items():
        g = grad_of(fn)
        comp = g.lower(*ARGS).compile()
        cpu[name] = cpu_body_counts(comp.as_text())
        cpu[name]["(whole program) temp KiB"] = comp.memory_analysis().temp_size_in_bytes // 1024
        low = g.trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()
        cuda[name] = stablehlo_body_counts(low)
        if dump:
            os.makedirs(dump, exist_ok=True)
            tag = name.replace(" ", "_")
            open(f"{dump}/{tag}.cpu.hlo", "w").write(comp.as_text())
            open(f"{dump}/{tag}.cuda.stablehlo", "w").write(low)
    show("CUDA StableHLO, backward scan body "
         "(`jit(f).trace(*args).lower(lowering_platforms=('cuda',))`)", cuda)
    show("XLA:CPU optimized HLO, backward while body and its fusions "
         "(`jit(f).lower(*args).compile().as_text()`)", cpu)


if __name__ == "__main__":
    main()
