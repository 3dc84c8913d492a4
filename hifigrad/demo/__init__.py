"""``hifigrad demo``: a byte-level language model trained in every precision mode.

Two tasks: a scanned GPT-style decoder (the default) and an LRU-style linear recurrence over a
1024-byte context (``--task recurrent``, `recurrent`).

`run` trains one model per mode on the Python standard library's source and measures gradient
fidelity against float32, loss curves, memory and speed; `write_report` writes the report,
``results.json`` and plots. The command line (``hifigrad demo`` / ``python -m hifigrad demo``) is
in `hifigrad.demo.cli`.

The demo needs the ``demo`` extra (``pip install -e '.[demo]'`` in a clone: flax, optax, rich,
matplotlib). Its names are imported on first use, so that ``hifigrad --help`` and
``hifigrad demo --help`` (which import this package) work on a plain install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .modes import MODE_NAMES as MODE_NAMES
    from .report import write_report as write_report
    from .train import QUICK as QUICK
    from .train import RECURRENT as RECURRENT
    from .train import RECURRENT_QUICK as RECURRENT_QUICK
    from .train import DemoConfig as DemoConfig
    from .train import run as run

__all__ = ["MODE_NAMES", "QUICK", "RECURRENT", "RECURRENT_QUICK", "DemoConfig", "run",
           "write_report"]

_LAZY = {"MODE_NAMES": "modes", "write_report": "report", "QUICK": "train",
         "RECURRENT": "train", "RECURRENT_QUICK": "train", "DemoConfig": "train", "run": "train"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
