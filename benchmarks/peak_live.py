"""What is live at the peak of a compiled step: XLA's own buffer assignment, read back.

`memory_analysis()` says how large a compiled program's temp allocation is, not what fills it.
`peak(fn, *args)` compiles ``jax.jit(fn)`` with XLA's dump switched on for that one
compilation (``xla_dump_to`` as a compiler option) and reads two of the files XLA writes:
the buffer assignment (each HLO value's size and offset) and the live ranges (each value's
first and last position in the program's schedule). At each position the live temp values
are summed; the position with the largest sum is the peak, and its live
values, largest first, are what the step's memory is made of there.

Used by `transformer_memory_bench.py --maxtext`; ``python benchmarks/peak_live.py DUMP_DIR``
reads a dump made with ``XLA_FLAGS=--xla_dump_to=DUMP_DIR --xla_dump_hlo_as_text``, and
``... DUMP_DIR --regions`` the peak of each stretch of the schedule between while loops (the
forward's loop, the backward's), with each live value's range. Read on
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


def _events(values: dict, ranges: dict) -> dict:
    """Position -> the change in live temp bytes there (a value counts from its first position
    to its last)."""
    events: dict = defaultdict(int)
    for name, (size, _) in values.items():
        if name in ranges:
            lo, hi = ranges[name]
            events[lo] += size
            events[hi + 1] -= size
    return events


def _live_at(values: dict, ranges: dict, at: int) -> list:
    """(bytes, name, shape, live range) of the values live at position `at`, largest first."""
    return sorted(((values[n][0], n, values[n][1], ranges[n]) for n in values
                   if n in ranges and ranges[n][0] <= at <= ranges[n][1]), reverse=True)


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
        events = _events(values, ranges)
        total, peak, at = 0, 0, 0
        for pos in sorted(events):
            total += events[pos]
            if total > peak:
                peak, at = total, pos
        live_at = [(b, n, sh) for b, n, sh, _ in _live_at(values, ranges, at)]
        if best is None or peak > best["peak_bytes"]:
            best = {"module": os.path.basename(a), "position": at, "peak_bytes": peak,
                    "top": [{"name": n, "bytes": s, "shape": sh} for s, n, sh in live_at[:top]]}
    return best


def _sequence(live_path: str) -> list:
    """The schedule's instruction names, by position (the live-range file's sequence)."""
    seq, started = [], False
    with open(live_path) as f:
        for line in f:
            if "InstructionSequence" in line:
                started = True
                continue
            if "BufferLiveRange" in line:
                break
            m = re.match(r"\s+(\d+):(\S+)", line)
            if started and m:
                seq.append(m.group(2))
    return seq


def regions(dump_dir: str, top: int = 8) -> list:
    """The largest module's schedule cut at its while loops (a loop's body is scheduled just
    before the loop instruction: the regions are, in order, what runs before and inside each
    loop): for each region of at least one position, the most bytes live there, where, and
    the `top` largest values live at that point with their live ranges (a value live from
    early in the program, such as a loop's zero-initialized accumulator, shows here)."""
    assigns = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
    best = None
    for a in assigns:
        live = a.replace("-buffer-assignment.txt", "-live-range.txt")
        if os.path.exists(live):
            size = os.path.getsize(a)
            if best is None or size > best[0]:
                best = (size, a, live)
    if best is None:
        raise FileNotFoundError(f"no buffer assignment in {dump_dir}")
    _, a, live = best
    values, ranges, seq = _read_temp_values(a), _read_ranges(live), _sequence(live)
    events = _events(values, ranges)
    prof, total = [], 0
    for pos in range(len(seq)):
        total += events.get(pos, 0)
        prof.append(total)
    loops = [i for i, name in enumerate(seq) if name.startswith("while")]
    out = []
    for lo, hi in zip([0] + [w + 1 for w in loops], loops + [len(seq)]):
        if hi - lo < 2:
            continue
        at = max(range(lo, hi), key=lambda i: prof[i])
        live_at = _live_at(values, ranges, at)
        out.append({"from": lo, "to": hi, "peak_bytes": prof[at], "position": at,
                    "instruction": seq[at], "ends_at": seq[hi] if hi < len(seq) else "end",
                    "top": [{"name": n, "bytes": b, "shape": sh, "live": list(r)}
                            for b, n, sh, r in live_at[:top]]})
    return out


def format_regions(rs: list) -> str:
    lines = []
    for r in rs:
        lines.append(f"positions {r['from']}-{r['to'] - 1} (up to {r['ends_at']}): "
                     f"{r['peak_bytes'] / 2**20:.1f} MiB at {r['position']} ({r['instruction']})")
        for v in r["top"]:
            lines.append(f"  {v['bytes'] / 2**20:7.2f} MiB  {v['shape']:36s} live "
                         f"{v['live'][0]}-{v['live'][1]}  {v['name']}")
    return "\n".join(lines)


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

    if "--regions" in sys.argv[1:]:
        print(format_regions(regions(sys.argv[1])))
    else:
        print(format_peak(peak_from_dump(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2
                                         else 12)))
