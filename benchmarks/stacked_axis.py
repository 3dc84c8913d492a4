"""A scan over layers whose weights are stacked on axis 1: does the step hold a transposed copy?

``PYTHONPATH=. python benchmarks/stacked_axis.py`` compiles the training step of a stack of
bf16 MLP blocks (``L=8`` layers, d=256, hidden 1024, SwiGLU, float32 weights: 3 x 8 MiB;
8 x 256 tokens), ``lax.scan(jax.checkpoint(layer))`` over the weights stacked on axis 0, or on
axis 1 and moved to the front before the scan (what ``nnx.scan(in_axes=1)``,
``nn.scan(variable_axes={"params": 1})`` and MaxText's ``param_scan_axis=1`` stage), and
prints, on the default backend, each step's ``memory_analysis()`` temp and peak: ``jax.grad``
(the bf16 remat step) and ``hg.grad(hg.compress_checkpoints(loss, "int8"))`` with each of the
two ways `compress_checkpoints` runs such a scan (``auto_choices(platform)["stacks"]``:
'slices' reads each step's slice from the untransposed stack, 'as written' scans the moved
one), whatever the platform's own choice. A TPU reports its temp as 0 (jax 0.10.2): read the
peak there, which includes the arguments (25 MiB) and outputs (24 MiB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import hifigrad as hg
from hifigrad._src import policy as _policy

L, D, F, B, T = 8, 256, 1024, 8, 256


def make(axis: int):
    k = jax.random.split(jax.random.key(0), 3)

    def shape(a, b):
        return (L, a, b) if axis == 0 else (a, L, b)

    p = dict(wi=jax.random.normal(k[0], shape(D, F)) * 0.02,
             wg=jax.random.normal(k[1], shape(D, F)) * 0.02,
             wo=jax.random.normal(k[2], shape(F, D)) * 0.02)

    def layer(h, w):
        h32 = h.astype(jnp.float32)
        n = (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)).astype(h.dtype)
        a, g = n @ w["wi"].astype(h.dtype), n @ w["wg"].astype(h.dtype)
        return h + (jax.nn.silu(a) * g) @ w["wo"].astype(h.dtype), None

    def loss(p, x):
        xs = p if axis == 0 else jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), p)
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, xs)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.bfloat16)
    return loss, p, x


def main():
    platform = _policy.current_platform()
    saved = dict(_policy._AUTO_STACKS)
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print("| step | weights on axis 0: temp / peak MiB | on axis 1 |")
    print("|---|---:|---:|")
    try:
        for name in ("jax.grad (bf16 remat)", "cc int8, stacks 'slices'",
                     "cc int8, stacks 'as written'"):
            cells = []
            for axis in (0, 1):
                loss, p, x = make(axis)
                if name.startswith("jax"):
                    step = jax.grad(loss)
                else:
                    _policy._AUTO_STACKS[platform] = name.split("'")[1]
                    step = hg.grad(hg.compress_checkpoints(loss, "int8"))
                m = jax.jit(step).lower(p, x).compile().memory_analysis()
                cells.append(f"{m.temp_size_in_bytes / 2**20:.1f} / "
                             f"{getattr(m, 'peak_memory_in_bytes', 0) / 2**20:.1f}")
            print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)
    finally:
        _policy._AUTO_STACKS.clear()
        _policy._AUTO_STACKS.update(saved)


if __name__ == "__main__":
    main()
