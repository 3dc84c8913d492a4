"""Which share of a rotated set of cases this CI lane runs in its default suite.

CI runs the default suite in full on three JAX releases and the `slow` tier once (on the newest
release). Where a family of cases is costly and its members exercise the same code path (a
test's eager twin beside its jitted run, the same model under each of several adjoints), the
default suite runs one member in `n`, and which one depends on the lane: `LANE_SEED` is fixed
per JAX release and Python (as tests/test_separable.py's fuzz seed is), so each release's full
lane runs another member, reproducibly, and the `slow` tier runs them all.
``HIFIGRAD_LANE_SEED=S`` picks another rotation (to reproduce another lane's choice).
"""

from __future__ import annotations

import os
import sys
import zlib

import jax

__all__ = ["LANE_SEED", "RELEASE_SEED", "in_turn", "turn"]

# Fixed per JAX release and Python (also the separable fuzzer's default seed).
RELEASE_SEED = zlib.crc32(
    f"jax {jax.__version__} python {sys.version_info[0]}.{sys.version_info[1]}".encode())
LANE_SEED = int(os.environ.get("HIFIGRAD_LANE_SEED") or RELEASE_SEED)


def turn(i: int, n: int) -> int:
    """Member `i`'s place (0 to n - 1) in this lane's turns of `n`."""
    return (i + LANE_SEED) % n


def in_turn(i: int, n: int) -> bool:
    """Whether member `i` of a family rotated in turns of `n` runs in this lane's default
    suite: exactly one of any `n` consecutive members does."""
    return turn(i, n) == 0
