"""docs/guides/frameworks.md: every section's python blocks run as written (so the recipes cannot
rot), and the page has the sections the README's feature table points to."""

import importlib.util
import pathlib
import re

import jax
import pytest

_DOC = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "frameworks.md"
_SECTIONS = ["Flax linen", "Flax NNX", "Equinox", "dm-haiku", "Keras 3 (JAX backend)", "optax"]


def _sections() -> dict[str, list[str]]:
    """{section title: [python blocks]} for each `## ` section of the page."""
    out: dict[str, list[str]] = {}
    for part in re.split(r"^## ", _DOC.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        out[title.strip()] = re.findall(r"```python\n(.*?)```", body, re.S)
    return out


def test_page_has_a_runnable_section_per_framework():
    sections = _sections()
    assert list(sections) == _SECTIONS
    assert all(sections.values())


# The libraries a section's recipe imports beyond jax/hifigrad: skipped, naming the library,
# where one is not installed (the GPU machine has no dm-haiku, jmp or keras).
_REQUIRES = {"Flax linen": ("flax",), "Flax NNX": ("flax",), "Equinox": ("equinox",),
             "dm-haiku": ("haiku", "jmp"), "Keras 3 (JAX backend)": ("keras",),
             "optax": ("optax",)}


@pytest.mark.parametrize("title", _SECTIONS)
def test_recipe_runs(title):
    for module in _REQUIRES.get(title, ()):
        # find_spec, not an import: keras picks its backend when first imported, and the
        # recipe sets KERAS_BACKEND itself before importing it.
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    namespace: dict = {}
    # As a user runs them: JAX's default dtype and rank promotion (Flax, Haiku, Keras and
    # optax mix dtypes and broadcast ranks implicitly), not the suite's strict modes.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        for i, block in enumerate(_sections()[title]):
            where = f"docs/guides/frameworks.md [{title}, block {i}]"
            exec(compile(block, where, "exec"), namespace)
