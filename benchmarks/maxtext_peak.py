"""Where real MaxText's step and hifigrad's peak: XLA's schedule cut at its loops.

``python benchmarks/maxtext_peak.py [CONFIG] [LAYERS]`` (a Python >= 3.12 environment with
MaxText 0.2.5: `maxtext_models.py`) compiles MaxText's own bf16 remat step (``jax.grad`` of its
loss) and ``hg.grad(hg.compress_checkpoints(loss, "int8"))`` of the config (default
llama2-full, 8 layers; 8 x 256 tokens as in `transformer_memory_bench.py --maxtext`), with
XLA's dump on, and prints each one's temp size and `peak_live.regions`: the most bytes live
before and inside each while loop (the forward's scan, the backward's), with the largest
values live there and their live ranges.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _one(name, layers, which, dump):
    import jax

    # a compilation served from the persistent cache dumps nothing
    jax.config.update("jax_enable_compilation_cache", False)
    import maxtext_models as mm

    import hifigrad as hg

    loss, args = mm.build(name, layers)
    with jax.set_mesh(loss.mesh):
        f = jax.grad(loss) if which == "bf16" else hg.grad(hg.compress_checkpoints(loss, "int8"))
        c = jax.jit(f).lower(*args).compile()
    print(f"temp {c.memory_analysis().temp_size_in_bytes / 2**20:.1f} MiB", flush=True)


def main(argv=None):
    import subprocess

    from peak_live import format_regions, regions

    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else "llama2-full"
    layers = int(argv[1]) if len(argv) > 1 else 8
    for which, tag in (("bf16", "MaxText bf16 remat step (jax.grad)"),
                       ("cc", "hg.grad(compress_checkpoints(loss, 'int8'))")):
        with tempfile.TemporaryDirectory() as d:
            # XLA's dump options apply per process (read when its backend starts): a child
            # compiles each step
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                              f" --xla_dump_to={d} --xla_dump_hlo_as_text"),
                       PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                                   os.environ.get("PYTHONPATH", "")]))
            code = (f"import maxtext_peak; maxtext_peak._one({name!r}, {layers}, {which!r}, "
                    f"{d!r})")
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            temp = [ln for ln in proc.stdout.splitlines() if ln.startswith("temp ")][-1]
            print(f"== {name}, {layers} layers, {tag}: {temp}")
            print(format_regions(regions(d)), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
