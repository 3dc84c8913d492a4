"""Helpers shared by the benchmarks: byte counts, SQNR, environment notes, markdown tables."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys

import jax
import numpy as np


def nbytes(x) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def residual_leaves(vjp_fn) -> list:
    """The residuals a vjp function holds: its pytree leaves, each array counted once."""
    seen, out = set(), []
    for leaf in jax.tree_util.tree_leaves(vjp_fn):
        if not hasattr(leaf, "dtype") or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        out.append(leaf)
    return out


def is_input(leaf, inputs) -> bool:
    """Whether a residual is one of the inputs: the same array, or an equal copy of one."""
    for x in inputs:
        if leaf is x:
            return True
    for x in inputs:
        if (np.shape(leaf) == np.shape(x) and leaf.dtype == x.dtype
                and np.array_equal(np.asarray(leaf), np.asarray(x))):
            return True
    return False


def sqnr_db(ref, got) -> float:
    """10*log10(|ref|^2 / |got - ref|^2) over all leaves, in float64."""
    r = np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(ref)])
    g = np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(got)])
    err = float(np.sum((g - r) ** 2))
    sig = float(np.sum(r ** 2))
    if not np.all(np.isfinite(g)):
        return float("nan")
    return math.inf if err == 0.0 else 10.0 * math.log10(sig / err)


def fmt_db(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf (bitwise)"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return f"{v:.1f}"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.3f} MiB"


def cpu_note() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = "load average {:.2f}/{:.2f}/{:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average n/a"
    return (f"{model}, {os.cpu_count()} logical cores visible ({load} at start; the cores are "
            f"shared with other jobs, so timings are noisy)")


def env_info(argv) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "PYTHONPATH=. " + " ".join(
            [os.path.basename(sys.executable)] + [shlex.quote(a) for a in argv]),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu": cpu_note(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # pragma: no cover
        return None


def md_table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path, obj):
    def default(o):
        if isinstance(o, (np.integer,)):
            return int(o)
        if isinstance(o, (np.floating,)):
            return float(o)
        return str(o)

    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    with open(path, "w") as f:
        json.dump(clean(obj), f, indent=2, default=default)
        f.write("\n")
