"""What is live at the peak of a compiled step: XLA's own buffer assignment, read back.

`memory_analysis()` says how large a compiled program's temp allocation is, not what fills it.
`peak(fn, *args)` compiles ``jax.jit(fn)`` with XLA's dump switched on for that one
compilation (``xla_dump_to`` as a compiler option) and reads two of the files XLA writes:
the buffer assignment (each HLO value's size and offset) and the live ranges (each value's
first and last position in the program's schedule). At each position the live temp values
are summed; the position with the largest sum is the peak, and its live
values, largest first, are what the step's memory is made of there.

Used by `transformer_memory_bench.py --maxtext`; ``python benchmarks/peak_live.py DUMP_DIR``
reads a dump made with ``XLA_FLAGS=--xla_dump_to=DUMP_DIR --xla_dump_hlo_as_text``. Read on
XLA:CPU; other backends write the same files.
"""

from __future__ import annotations

import glob
import os
import re
from collections import defaultdict

_VALUE = re.compile(r"value: <\d+ (\S+?)(?:\{[^}]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
_RANGE = re.compile(r"^\s+(\S+?)\{([^}]*)\}:(\d+)-(\d+)")
_ALLOC = re.compile(
    r"allocation (\d+): size (\d+).*?(preallocated-temp|parameter|maybe-live-out)?:?$")


def _read_temp_values(path: str) -> dict:
    """HLO value name -> (size, shape) for the values of the temp allocation."""
    values: dict = {}
    in_temp = False
    with open(path) as f:
        for line in f:
            if line.startswith("allocation "):
                in_temp = "preallocated-temp" in line
                continue
            m = _VALUE.search(line)
            if m and in_temp:
                name, size, _, shape = m.groups()
                values.setdefault(name, (int(size), shape.strip()))
    return values


def _read_ranges(path: str) -> dict:
    """HLO value name -> (start, end) in the schedule."""
    ranges: dict = {}
    started = False
    with open(path) as f:
        for line in f:
            if "BufferLiveRange" in line:
                started = True
                continue
            m = _RANGE.match(line) if started else None
            if m:
                name, _, a, b = m.groups()
                lo, hi = ranges.get(name, (int(a), int(b)))
                ranges[name] = (min(lo, int(a)), max(hi, int(b)))
    return ranges


def peak_from_dump(dump_dir: str, top: int = 12) -> dict:
    """The peak of the largest module in `dump_dir` (an ``--xla_dump_to`` folder): its
    position, the bytes live there, and the `top` largest live values (name, bytes, shape)."""
    assigns = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
    if not assigns:
        raise FileNotFoundError(f"no buffer assignment in {dump_dir}")
    best = None
    for a in assigns:
        live = a.replace("-buffer-assignment.txt", "-live-range.txt")
        if not os.path.exists(live):
            continue
        values, ranges = _read_temp_values(a), _read_ranges(live)
        events = defaultdict(int)
        for name, (size, _) in values.items():
            if name in ranges:
                lo, hi = ranges[name]
                events[lo] += size
                events[hi + 1] -= size
        total, peak, at = 0, 0, 0
        for pos in sorted(events):
            total += events[pos]
            if total > peak:
                peak, at = total, pos
        live_at = sorted(((values[n][0], n, values[n][1]) for n in values
                          if n in ranges and ranges[n][0] <= at <= ranges[n][1]),
                         reverse=True)
        if best is None or peak > best["peak_bytes"]:
            best = {"module": os.path.basename(a), "position": at, "peak_bytes": peak,
                    "top": [{"name": n, "bytes": s, "shape": sh} for s, n, sh in live_at[:top]]}
    return best


def peak(fn, *args, top: int = 12) -> dict:
    """`peak_from_dump` of ``jax.jit(fn)`` compiled for `args` (XLA's dump options passed to
    this one compilation, into a temporary folder)."""
    import tempfile

    import jax

    # (A compilation served from JAX's persistent cache runs no XLA pass and dumps nothing:
    # where the cache is on, e.g. MaxText's default ~/jax_cache, turn it off first.)
    with tempfile.TemporaryDirectory() as d:
        jax.jit(fn).lower(*args).compile(compiler_options={"xla_dump_to": d,
                                                           "xla_dump_hlo_as_text": True})
        return peak_from_dump(d, top)


def format_peak(p: dict) -> str:
    lines = [f"peak {p['peak_bytes'] / 2**20:.1f} MiB at position {p['position']} "
             f"({p['module']})"]
    for v in p["top"]:
        lines.append(f"  {v['bytes'] / 2**20:7.2f} MiB  {v['shape']:40s} {v['name']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(format_peak(peak_from_dump(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2
                                     else 12)))
