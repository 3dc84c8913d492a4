"""hifigrad: high-fidelity (float32) gradients for JAX models computed in bf16, fp16 or fp8."""

from importlib import metadata as _metadata

from . import codecs as codecs
from . import optim as optim
from ._src.api import grad as grad
from ._src.api import precise_backward as precise_backward
from ._src.api import value_and_grad as value_and_grad
from ._src.api import vjp as vjp
from ._src.checkpoint import SliceCheckError as SliceCheckError
from ._src.checkpoint import SliceWarning as SliceWarning
from ._src.checkpoint import checkpoint as checkpoint
from ._src.checkpoint import scan as scan
from ._src.checkpoint import slice_report as slice_report
from ._src.codecs import get_codec as get_codec
from ._src.compat import JaxCompatibilityError as JaxCompatibilityError
from ._src.compat import UntestedJaxWarning as UntestedJaxWarning
from ._src.compat import check_jax_version as _check_jax_version
from ._src.compress import compress_checkpoints as compress_checkpoints
from ._src.interpreter import PrecisionFallbackWarning as PrecisionFallbackWarning
from ._src.interpreter import UnsupportedPrimitiveError as UnsupportedPrimitiveError
from ._src.policy import Policy as Policy
from ._src.report import fidelity_report as fidelity_report
from ._src.rules import promote_rule as promote_rule
from ._src.rules import register_rule as register_rule


def _version() -> str:
    """The installed distribution's version; from a source tree that is not installed (run
    with its folder on PYTHONPATH), its pyproject.toml's; else ``0.0.0+unknown``."""
    try:
        return _metadata.version("hifigrad")
    except _metadata.PackageNotFoundError:
        pass
    import pathlib
    import tomllib

    try:
        path = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        project = tomllib.loads(path.read_text())["project"]
        if project.get("name") == "hifigrad":
            return str(project["version"])
    except (OSError, KeyError, ValueError):
        pass
    return "0.0.0+unknown"


__version__ = _version()

_check_jax_version()  # one UntestedJaxWarning when the installed JAX is outside the tested range


def __getattr__(name):
    # `hifigrad.flax` and `hifigrad.equinox` need Flax / Equinox, optional dependencies:
    # imported on first use.
    if name in ("flax", "equinox"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hifigrad' has no attribute {name!r}")


__all__ = [
    "Policy",
    "PrecisionFallbackWarning",
    "checkpoint",
    "codecs",
    "compress_checkpoints",
    "fidelity_report",
    "get_codec",
    "JaxCompatibilityError",
    "optim",
    "scan",
    "SliceCheckError",
    "SliceWarning",
    "slice_report",
    "UnsupportedPrimitiveError",
    "UntestedJaxWarning",
    "grad",
    "precise_backward",
    "promote_rule",
    "register_rule",
    "value_and_grad",
    "vjp",
]
