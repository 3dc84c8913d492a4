"""``hifigrad demo``: a byte-level language model trained in every precision mode.

Two tasks: a scanned GPT-style decoder (the default) and an LRU-style linear recurrence over a
1024-byte context (``--task recurrent``, `recurrent`).

`run` trains one model per mode on the Python standard library's source and measures gradient
fidelity against float32, loss curves, memory and speed; `write_report` writes the report,
``results.json`` and plots. The command line (``hifigrad demo`` / ``python -m hifigrad demo``) is
in `hifigrad.demo.cli`.
"""

from .modes import MODE_NAMES as MODE_NAMES
from .report import write_report as write_report
from .train import QUICK as QUICK
from .train import RECURRENT as RECURRENT
from .train import RECURRENT_QUICK as RECURRENT_QUICK
from .train import DemoConfig as DemoConfig
from .train import run as run

__all__ = ["MODE_NAMES", "QUICK", "RECURRENT", "RECURRENT_QUICK", "DemoConfig", "run",
           "write_report"]
