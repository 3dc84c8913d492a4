"""The ``hifigrad`` command (also ``python -m hifigrad``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs the ``hifigrad`` command line; returns the exit status."""
    from hifigrad.demo.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
