"""The README's quickstart runs as written."""

import pathlib
import re

import jax


def test_quickstart_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", text, re.S).group(1)
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(block, "README.md", "exec"), {})
