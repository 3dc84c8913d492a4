"""``hifigrad demo``: a scanned-transformer language model trained in every precision mode.

`run` trains one model per mode on the Python standard library's source and measures gradient
fidelity against float32, loss curves, memory and speed; `write_report` writes the report,
``results.json`` and plots. The command line (``hifigrad demo`` / ``python -m hifigrad demo``) is
in `hifigrad.demo.cli`.
"""

from .modes import MODE_NAMES as MODE_NAMES
from .report import write_report as write_report
from .train import QUICK as QUICK
from .train import DemoConfig as DemoConfig
from .train import run as run

__all__ = ["MODE_NAMES", "QUICK", "DemoConfig", "run", "write_report"]
