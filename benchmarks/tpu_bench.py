"""TPU benchmark: activation codecs and compressed scans against a bf16 rematerialized scan, side
by side in one process, on whatever device JAX picks (written for one TPU v5e chip).

Sections (``--sections``, comma-separated):

* ``codecs``: each codec's ``encode``, ``decode`` and encode+decode of one activation
  (``--act-shape``, float32 by default), each jitted on its own: median wall time of
  ``--reps`` calls after a warm-up, the bytes the codec stores (``nbytes``) and the bytes XLA
  allocates for the encoding (``compile().memory_analysis()`` output size: on a TPU an array
  with a narrow minor dimension is padded to 128 lanes, so this can exceed ``nbytes``).
* ``mlp``: a training step (``jax.grad``, and ``hg.grad`` where named) of a scanned MLP
  (benchmarks/gpu_bench.py's ``c + W2 gelu(W1 LN(c))``, float32 carry, bf16 compute), over
  ``lax.scan(jax.checkpoint(body))`` (the baseline), ``hg.scan(body, codec=...)`` and
  ``hg.compress_checkpoints`` of the baseline: peak temp bytes
  (``compile().memory_analysis().temp_size_in_bytes``) and median step time of ``--steps``
  calls after a warm-up, each as a ratio to the baseline.
* ``gpt_policy``: the GPT's bf16 remat scan against ``hg.compress_checkpoints`` of it (int8,
  none) under ``hg.grad`` with each policy (default, coefficients forward / tangent, exact
  matmuls) and under ``jax.grad``, at 12 and 24 blocks, with each row's ``hg.slice_report``;
  at 12 blocks also bf16 ``jax.grad`` against ``hg.grad`` per policy (`bench_gpt_policy`).
* ``gpt``: the scanned GPT of benchmarks/gpu_bench.py (bf16 model, bf16 carry for jax.grad /
  hg.grad, float32 master parameters): ``jax.grad`` vs ``hg.grad`` (default policy) at
  ``--gpt-blocks``, and at ``--gpt-compress-blocks`` the bf16 remat scan vs
  ``hg.compress_checkpoints`` of it (int8, fp8) under ``jax.grad`` and ``hg.grad``.

* ``flash``: Pallas flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`,
  causal, bf16 q/k/v of ``--flash-shapes`` B x H x T x D): the attention's own gradient step
  under ``jax.grad`` (its bf16 backward kernels) and ``hg.grad`` (the same kernels built for
  float32 operands: a custom_vjp backward holding a Pallas kernel is re-traced at the promoted
  dtype), with each gradient's SQNR in dB against a float32 reference (the XLA attention of
  the same bf16 inputs in float32, matmuls at ``highest``); then the GPT (``--flash-blocks``,
  plain ``lax.scan``) with that kernel as its attention, ``jax.grad`` vs ``hg.grad``.

``--legacy`` adds int4/int2 codecs with the interleaved ``[groups, group_size * bits / 8]``
packing that hifigrad used before (for a before/after comparison in the same run).

Run from the repository root::

    PYTHONPATH=. python benchmarks/tpu_bench.py --out-dir benchmarks/results

It prints markdown tables and writes ``tpu_bench.md`` / ``tpu_bench.json`` into ``--out-dir``
(rewritten after every row, so a cut run keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402
from _common import sqnr_db  # noqa: E402

import hifigrad as hg  # noqa: E402
from hifigrad._src import codecs as _codecs  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
MiB = 2**20


# ----------------------------------------------------------------------------- legacy packing

@dataclasses.dataclass(frozen=True, init=False)
class LegacyIntCodec(hg.codecs.IntCodec):
    """`IntCodec` with the interleaved packing hifigrad used before: codes ``2i, 2i + 1`` (int4)
    in byte ``i`` of a ``[groups, group_size * bits / 8]`` array. For comparison only. Its
    encode runs the current encode and then converts its planar rows to that layout (unpack,
    interleave), so its encode time is an upper bound on the former code's; its stored array
    and its decode are the former's."""

    @property
    def name(self) -> str:
        return super().name + "_legacy"

    @property
    def _layout(self) -> str:
        return f"legacy_int{self.bits}_g{self.group_size}"

    def _encode(self, x, key, state):
        enc = super()._encode(x, key, state)
        ng = self._num_groups(x.size)
        q = _codecs._unpack(enc.data, self.bits)[: ng * self.group_size]
        k = 8 // self.bits
        q = q.reshape(ng, self.group_size // k, k)
        packed = q[..., 0]
        for j in range(1, k):
            packed = packed | (q[..., j] << np.uint8(self.bits * j))
        return dataclasses.replace(enc, data=packed, layout=self._layout)

    def decode(self, enc, dtype):
        return _codecs._decode_kernel(self, enc, jnp.dtype(dtype))

    def _decode(self, enc, dtype):
        k, mask = 8 // self.bits, np.uint8((1 << self.bits) - 1)
        parts = [(enc.data >> np.uint8(self.bits * j)) & mask for j in range(k)]
        q = jnp.stack(parts, axis=-1).reshape(enc.data.shape[:-1] + (-1,))
        q = q.astype(F32) - np.float32(self._qmax)
        out = q * enc.scale.astype(F32)[..., None]
        n = int(np.prod(enc.shape))
        batch = tuple(enc.data.shape[:-2])
        out = out.reshape(batch + (-1,))[..., :n]
        return out.reshape(batch + tuple(enc.shape)).astype(dtype)

    def nbytes(self, shape, dtype):
        return self._num_groups(int(np.prod(shape))) * (self.group_size * self.bits // 8 + 2)


def codec_list(names, legacy):
    out = [(n, hg.get_codec(n)) for n in names]
    if legacy:
        out += [("int4_legacy", LegacyIntCodec(4)), ("int2_legacy", LegacyIntCodec(2))]
    return out


# ----------------------------------------------------------------------------- measuring

def timed(fn, args, reps):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def compiled_of(fn, args):
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile()
    return c, time.perf_counter() - t0


def mem(c):
    try:
        m = c.memory_analysis()
        return int(m.temp_size_in_bytes), int(m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend has it
        return None, None


class Report:
    def __init__(self, out_dir, argv):
        self.out_dir, self.argv = out_dir, argv
        self.sections: dict[str, list[dict]] = {}
        self.t0 = time.time()
        dev = jax.devices()[0]
        self.env = {"jax": jax.__version__, "device": dev.device_kind, "platform": dev.platform,
                    "python": sys.version.split()[0],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def add(self, section, row):
        self.sections.setdefault(section, []).append(row)
        self.write()

    def markdown(self):
        md = [f"# tpu_bench: {self.env['device']} ({self.env['platform']}), jax {self.env['jax']}, "
              f"{self.env['date']}", "",
              "Command: `PYTHONPATH=. python benchmarks/tpu_bench.py "
              + " ".join(self.argv) + "`", ""]
        for sec, rows in self.sections.items():
            md += [f"## {sec}", ""]
            cols = [k for k in rows[0] if k != "traceback"]
            for r in rows[1:]:
                cols += [k for k in r if k not in cols and k != "traceback"]
            md.append("| " + " | ".join(cols) + " |")
            md.append("|" + "---|" * len(cols))
            for r in rows:
                md.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
            md.append("")
        return "\n".join(md)

    def write(self):
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "tpu_bench.md"), "w") as f:
            f.write(self.markdown() + "\n")
        with open(os.path.join(self.out_dir, "tpu_bench.json"), "w") as f:
            json.dump({"env": self.env, "argv": self.argv, "sections": self.sections}, f,
                      indent=1, default=str)


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ----------------------------------------------------------------------------- codecs

def bench_codecs(rep, args):
    shape = tuple(int(s) for s in args.act_shape.split("x"))
    x = jax.random.normal(jax.random.key(0), shape, F32)
    dt = F32
    print(f"\n== codecs on f32{list(shape)} ({x.nbytes / MiB:.0f} MiB)", flush=True)
    base = None
    for name, codec in codec_list(args.codecs.split(","), args.legacy):
        row = {"codec": name}
        try:
            enc_fn = lambda x, c=codec: c.encode(x)
            enc_c, _ = compiled_of(enc_fn, (x,))
            enc = enc_c(x)
            dec_fn = lambda e, c=codec: c.decode(e, dt)
            dec_c, _ = compiled_of(dec_fn, (enc,))
            rt_c, _ = compiled_of(lambda x, c=codec: c.decode(c.encode(x), dt), (x,))
            row["nbytes MiB"] = codec.nbytes(shape, dt) / MiB
            row["stored leaves MiB"] = sum(leaf.nbytes for leaf in jax.tree.leaves(enc)) / MiB
            row["encode out (XLA) MiB"] = (mem(enc_c)[1] or 0) / MiB
            row["encode temp MiB"] = (mem(enc_c)[0] or 0) / MiB
            row["encode ms"] = 1e3 * timed(enc_c, (x,), args.reps)
            row["decode ms"] = 1e3 * timed(dec_c, (enc,), args.reps)
            row["enc+dec ms"] = 1e3 * timed(rt_c, (x,), args.reps)
            err = rt_c(x) - x
            row["SQNR dB"] = float(10 * jnp.log10(jnp.sum(x * x) / jnp.sum(err * err)))
            if name == "int8":
                base = row
            if base is not None:
                row["enc+dec / int8"] = row["enc+dec ms"] / base["enc+dec ms"]
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            row["traceback"] = traceback.format_exc(limit=6)
        print(row, flush=True)
        rep.add("codecs", row)


# ----------------------------------------------------------------------------- steps

def step_rows(rep, section, rows, args_, steps, baseline):
    base = None
    for name, build in rows:
        row = {"row": name}
        try:
            g = build()
            c, comp_s = compiled_of(g, args_)
            temp, _ = mem(c)
            row["temp MiB"] = None if temp is None else temp / MiB
            row["step ms"] = 1e3 * timed(c, args_, steps)
            row["compile s"] = comp_s
            if name == baseline:
                base = row
            if base is not None and base.get("step ms"):
                row["time / base"] = row["step ms"] / base["step ms"]
                if temp is not None and base.get("temp MiB"):
                    row["temp / base"] = row["temp MiB"] / base["temp MiB"]
            del c
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            row["traceback"] = traceback.format_exc(limit=6)
        print(f"[{section}] {row}", flush=True)
        rep.add(section, row)


def bench_mlp(rep, args):
    L, d, h, T = args.mlp_blocks, args.mlp_d, args.mlp_hidden, args.tokens
    params = gb.mlp_init(jax.random.key(1), blocks=L, d=d, hidden=h)
    x = jax.random.normal(jax.random.key(2), (T, d), F32)
    print(f"\n== mlp: {L} blocks, d={d}, hidden={h}, {T} tokens", flush=True)
    remat = gb.make_mlp_loss()
    rows = [("bf16 remat scan", lambda: jax.grad(remat))]
    for name, codec in codec_list(args.mlp_codecs.split(","), args.legacy):
        loss = gb.make_mlp_loss(scan="hg", codec=codec)
        rows.append((f"jax.grad hg.scan {name}", functools.partial(jax.grad, loss)))
    for name in args.mlp_compress.split(","):
        if name:
            rows.append((f"jax.grad compress_checkpoints {name}",
                         functools.partial(jax.grad, hg.compress_checkpoints(remat, name))))
            rows.append((f"hg.grad compress_checkpoints {name}",
                         functools.partial(hg.grad, hg.compress_checkpoints(remat, name))))
    step_rows(rep, "mlp", rows, (params, x), args.steps, "bf16 remat scan")


def make_gpt_remat(heads):
    return gb.make_gpt_loss(heads=heads, scan="remat")


def bench_gpt(rep, args):
    H = args.gpt_heads
    for L, section in ((args.gpt_blocks, "gpt"), (args.gpt_compress_blocks, "gpt_compress")):
        if not L:
            continue
        params = gb.gpt_init(jax.random.key(3), blocks=L, d=args.gpt_d, mlp=4, vocab=args.vocab)
        k1, k2 = jax.random.split(jax.random.key(4))
        toks = jax.random.randint(k1, (args.batch, args.seq), 0, args.vocab)
        tgts = jax.random.randint(k2, (args.batch, args.seq), 0, args.vocab)
        print(f"\n== {section}: {L} blocks, d={args.gpt_d}, {args.batch}x{args.seq} tokens",
              flush=True)
        if section == "gpt":
            plain = gb.make_gpt_loss(heads=H)
            remat = make_gpt_remat(H)
            rows = [("jax.grad bf16", functools.partial(jax.grad, plain)),
                    ("hg.grad bf16 default", functools.partial(hg.grad, plain)),
                    ("jax.grad bf16 remat scan", functools.partial(jax.grad, remat)),
                    ("hg.grad bf16 remat scan", functools.partial(hg.grad, remat))]
            base = "jax.grad bf16"
        else:
            remat = make_gpt_remat(H)
            rows = [("jax.grad bf16 remat scan", functools.partial(jax.grad, remat))]
            for name in args.gpt_codecs.split(","):
                f = hg.compress_checkpoints(remat, name)
                rows.append((f"jax.grad compress_checkpoints {name}",
                             functools.partial(jax.grad, f)))
                rows.append((f"hg.grad compress_checkpoints {name}",
                             functools.partial(hg.grad, f)))
            base = "jax.grad bf16 remat scan"
        step_rows(rep, section, rows, (params, toks, tgts), args.steps, base)


_POLICIES = {
    "default": None,
    "forward": hg.Policy(coefficients="forward"),
    "tangent": hg.Policy(coefficients="tangent"),
    # what a checkpoint's recomputed backward ran before the transform's policy reached it
    # (issue 51): exact matmuls
    "exact": hg.Policy(matmul="exact"),
}


def bench_gpt_policy(rep, args):
    """The GPT at each of ``--policy-blocks``: the bf16 remat scan (the baseline) against
    `hg.compress_checkpoints` of it (``--policy-codecs``) under ``hg.grad`` with each policy of
    ``--policies`` (`_POLICIES`) and under ``jax.grad``; at the first block count also bf16
    ``jax.grad`` without remat against ``hg.grad`` of it. Each row's `hg.slice_report` is
    printed (``sliced`` in the table: how many checkpoints sliced)."""
    H = args.gpt_heads
    for n, L in enumerate(int(b) for b in args.policy_blocks.split(",")):
        params = gb.gpt_init(jax.random.key(3), blocks=L, d=args.gpt_d, mlp=4, vocab=args.vocab)
        k1, k2 = jax.random.split(jax.random.key(4))
        toks = jax.random.randint(k1, (args.batch, args.seq), 0, args.vocab)
        tgts = jax.random.randint(k2, (args.batch, args.seq), 0, args.vocab)
        section = f"gpt_policy_{L}"
        print(f"\n== {section}: {L} blocks, d={args.gpt_d}, {args.batch}x{args.seq} tokens",
              flush=True)
        remat = make_gpt_remat(H)
        rows = [("jax.grad bf16 remat scan", functools.partial(jax.grad, remat))]
        for codec in args.policy_codecs.split(","):
            f = hg.compress_checkpoints(remat, codec)
            rows.append((f"jax.grad compress_checkpoints {codec}", functools.partial(jax.grad, f)))
            for pol in args.policies.split(","):
                policy = _POLICIES[pol]
                rows.append((f"hg.grad compress_checkpoints {codec} {pol}",
                             functools.partial(hg.grad, f, policy=policy)))
        if n == 0:
            plain = gb.make_gpt_loss(heads=H)
            rows.append(("jax.grad bf16", functools.partial(jax.grad, plain)))
            for pol in args.policies.split(","):
                rows.append((f"hg.grad bf16 {pol}",
                             functools.partial(hg.grad, plain, policy=_POLICIES[pol])))
        for name, build in rows:
            if "compress" in name:
                report = hg.slice_report(build(), params, toks, tgts)
                print(f"[{section}] {name}: {report}", flush=True)
        step_rows(rep, section, rows, (params, toks, tgts), args.steps,
                  "jax.grad bf16 remat scan")


def _flash(q, k, v, *, block):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    bs = fa.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                       block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
                       block_q_dkv=block, block_k_major_dq=block, block_k_dq=block,
                       block_q_dq=block)
    return fa.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5,
                              block_sizes=bs)


def bench_flash(rep, args):
    """Pallas flash attention's gradient under jax.grad and hg.grad (`--sections flash`)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    blk = args.flash_block
    for shape in args.flash_shapes.split(","):
        B, H, T, D = (int(n) for n in shape.split("x"))
        ks = jax.random.split(jax.random.key(7), 4)
        q, k, v = (jax.random.normal(kk, (B, H, T, D), F32).astype(BF16) for kk in ks[:3])
        w = jax.random.normal(ks[3], (B, H, T, D), F32)

        def loss(q, k, v, w=w):
            return jnp.sum(_flash(q, k, v, block=blk).astype(F32) * w)

        def ref_loss(q, k, v, w=w, D=D):
            with jax.default_matmul_precision("highest"):
                o = fa.mha_reference_no_custom_vjp(q, k, v, None, None, causal=True,
                                                   sm_scale=D ** -0.5)
            return jnp.sum(o * w)

        ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(
            *(t.astype(F32) for t in (q, k, v)))
        section = "flash"
        print(f"\n== {section}: {B}x{H}x{T}x{D}, block {blk}", flush=True)
        base = None
        highest = hg.Policy(matmul_precision="highest")
        for name, tr in (("jax.grad", jax.grad), ("hg.grad", hg.grad),
                         ("hg.grad, matmul_precision='highest'",
                          functools.partial(hg.grad, policy=highest))):
            row = {"shape": shape, "row": name}
            try:
                g = tr(loss, argnums=(0, 1, 2))
                c, comp_s = compiled_of(g, (q, k, v))
                temp, _ = mem(c)
                row["temp MiB"] = None if temp is None else temp / MiB
                row["step ms"] = 1e3 * timed(c, (q, k, v), args.steps)
                grads = c(q, k, v)
                row["dtype"] = str(grads[0].dtype)
                for nm, gx, r in zip(("dq", "dk", "dv"), grads, ref):
                    row[f"SQNR {nm} dB"] = sqnr_db(r, gx)
                if base is None:
                    base = row
                row["time / jax.grad"] = row["step ms"] / base["step ms"]
            except Exception as e:  # noqa: BLE001 - reported in the table
                row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                row["traceback"] = traceback.format_exc(limit=6)
            print(f"[{section}] {row}", flush=True)
            rep.add(section, row)

    if args.flash_blocks:
        H = args.gpt_heads

        def attn(q, k, v):  # [B, T, H, D] -> the kernel's [B, H, T, D] and back
            o = _flash(*(t.transpose(0, 2, 1, 3) for t in (q, k, v)), block=blk)
            return o.transpose(0, 2, 1, 3)

        L = args.flash_blocks
        params = gb.gpt_init(jax.random.key(3), blocks=L, d=args.gpt_d, mlp=4, vocab=args.vocab)
        k1, k2 = jax.random.split(jax.random.key(4))
        toks = jax.random.randint(k1, (args.batch, args.seq), 0, args.vocab)
        tgts = jax.random.randint(k2, (args.batch, args.seq), 0, args.vocab)
        loss = gb.make_gpt_loss(heads=H, attn=attn)
        print(f"\n== flash_gpt: {L} blocks, d={args.gpt_d}, {args.batch}x{args.seq} tokens",
              flush=True)
        rows = [("jax.grad bf16, Pallas flash attention", functools.partial(jax.grad, loss)),
                ("hg.grad bf16, Pallas flash attention", functools.partial(hg.grad, loss)),
                ("hg.grad bf16, Pallas flash attention, matmul_precision='highest'",
                 functools.partial(hg.grad, loss,
                                   policy=hg.Policy(matmul_precision="highest")))]
        step_rows(rep, "flash_gpt", rows, (params, toks, tgts), args.steps, rows[0][0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="codecs,mlp,gpt")
    ap.add_argument("--act-shape", default="8x512x1024")
    ap.add_argument("--codecs", default="bf16,fp8_e4m3,int8,int4,int2")
    ap.add_argument("--legacy", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mlp-blocks", type=int, default=32)
    ap.add_argument("--mlp-d", type=int, default=1024)
    ap.add_argument("--mlp-hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mlp-codecs", default="bf16,fp8_e4m3,int8,int4,int2")
    ap.add_argument("--mlp-compress", default="")
    ap.add_argument("--gpt-blocks", type=int, default=12)
    ap.add_argument("--gpt-compress-blocks", type=int, default=24)
    ap.add_argument("--gpt-codecs", default="int8,fp8_e4m3")
    ap.add_argument("--gpt-d", type=int, default=1024)
    ap.add_argument("--gpt-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--policy-blocks", default="12,24")
    ap.add_argument("--policy-codecs", default="int8,none")
    ap.add_argument("--policies", default="default,forward,tangent,exact")
    ap.add_argument("--flash-shapes", default="8x16x2048x128,8x16x512x64")
    ap.add_argument("--flash-block", type=int, default=128)
    ap.add_argument("--flash-blocks", type=int, default=12)
    ap.add_argument("--out-dir", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    rep = Report(args.out_dir, [a for a in argv if not a.startswith("--out-dir")
                                and a != args.out_dir])
    print(rep.env, flush=True)
    for sec in args.sections.split(","):
        {"codecs": bench_codecs, "mlp": bench_mlp, "gpt": bench_gpt,
         "gpt_policy": bench_gpt_policy, "flash": bench_flash}[sec](rep, args)
    print("\n" + rep.markdown())
    print(f"\ntpu_bench done in {time.time() - rep.t0:.0f} s")


if __name__ == "__main__":
    main()
