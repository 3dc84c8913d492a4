"""Training text that every machine already has: the Python standard library's own source.

The corpus is a deterministic selection of the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (a walk in sorted order; test suites, ``site-packages`` and
non-UTF-8 files left out), read up to ``max_bytes``. Tokens are bytes (vocabulary 256). Every
tenth file goes to the validation split, so no file is in both.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "load_corpus", "sample_batches"]

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Byte tokens of the train and validation splits."""

    train: np.ndarray  # uint8[n_train]
    val: np.ndarray  # uint8[n_val]
    n_files: int
    source: str

    def describe(self) -> str:
        """One line for reports."""
        return (f"{self.n_files} files of the Python {sys.version_info.major}."
                f"{sys.version_info.minor} standard library ({self.source}): "
                f"{self.train.size / 1e6:.2f} MB train, {self.val.size / 1e6:.2f} MB validation")


def _stdlib_files(root: Path):
    """Yields the ``.py`` files under ``root`` (relative paths) in a fixed order: a top-down
    walk with directory and file names sorted, skipped directories pruned."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        here = Path(dirpath)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield (here / name).relative_to(root)


def load_corpus(max_bytes: int = 4_000_000, val_every: int = 10) -> Corpus:
    """Reads up to ``max_bytes`` of standard-library source and splits it by file.

    Raises:
      RuntimeError: if the standard library's source cannot be found (for example a Python
        built without its ``.py`` files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    n = 0
    for rel in _stdlib_files(root):
        try:
            data = (root / rel).read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data.strip():
            continue
        chunk = b"# file: " + rel.as_posix().encode() + b"\n" + data + b"\n"
        (val if n % val_every == val_every - 1 else train).append(chunk)
        n += 1
        total += len(chunk)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(
            f"Found too little Python source under {root} to build the demo corpus; this Python "
            f"installation seems to ship without its standard library's .py files.")
    return Corpus(train=np.frombuffer(b"".join(train), np.uint8),
                  val=np.frombuffer(b"".join(val), np.uint8), n_files=n, source=str(root))


def sample_batches(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int,
                   seed: int) -> np.ndarray:
    """``n_batches`` batches of random windows, as int32 ``[n_batches, batch, seq_len + 1]``.

    Inputs are ``[..., :-1]`` and next-byte targets ``[..., 1:]``. The same ``seed`` gives the same
    batches, so every mode trains on exactly the same data in the same order.
    """
    if tokens.size < seq_len + 2:
        raise ValueError(f"split of {tokens.size} bytes is shorter than one sequence")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, tokens.size - seq_len - 1, size=(n_batches, batch_size))
    idx = starts[..., None] + np.arange(seq_len + 1)
    return tokens[idx].astype(np.int32)
