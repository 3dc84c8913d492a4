"""The documentation is tested: docstring examples, the site's code blocks, the API reference.

- Every ``>>>`` example in the package's docstrings runs (doctest, outputs checked where shown,
  ``ELLIPSIS | NORMALIZE_WHITESPACE``), one case per docstring.
- Every ```python block of the site's pages (``docs/**/*.md``) runs, the blocks of a page in one
  namespace, as a reader runs them. A block preceded by an ``<!-- no-run: reason -->`` comment is
  skipped; ``docs/guides/frameworks.md`` has its own test (``tests/test_frameworks.py``).
- The API reference (``docs/api/*.md``) documents every public name, and every public function
  and class has a runnable example.
- The supported-releases tables (README and site) list the tested JAX releases.

Both example kinds run under the suite's strict dtype promotion (``tests/conftest.py``).
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import hifigrad
from hifigrad._src import compat

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"

# ------------------------------------------------------------------------------ docstrings


def _modules():
    """Every module of the package (the optional framework modules where importable)."""
    names = ["hifigrad"] + [m.name for m in pkgutil.walk_packages(hifigrad.__path__, "hifigrad.")]
    out = []
    for name in names:
        if name.endswith("__main__"):
            continue
        try:
            out.append(importlib.import_module(name))
        except ImportError:  # hifigrad.flax / hifigrad.equinox without their extra
            continue
    return out


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for module in _modules():
        tests += [t for t in finder.find(module) if t.examples]
    return sorted(tests, key=lambda t: t.name)


_DOCTESTS = _doctests()


@pytest.mark.parametrize("test", _DOCTESTS, ids=[t.name for t in _DOCTESTS])
def test_docstring_examples(test):
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    out: list[str] = []
    result = runner.run(test, out=out.append, clear_globs=True)
    assert result.failed == 0, "".join(out)


# ------------------------------------------------------------------------------ site pages

# Pages whose blocks another test runs (with the frameworks' own dtype promotion).
_TESTED_ELSEWHERE = {"guides/frameworks.md"}
_BLOCK = re.compile(r"^(<!-- no-run[^\n]*-->\n)?```python\n(.*?)^```", re.S | re.M)


def _pages():
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    return [p for p in pages if p not in _TESTED_ELSEWHERE and not p.startswith("api/")]


def _blocks(page: str) -> list[str]:
    return [code for skip, code in _BLOCK.findall((DOCS / page).read_text()) if not skip]


@pytest.mark.parametrize("page", [p for p in _pages() if _blocks(p)])
def test_page_code_blocks_run(page):
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(_blocks(page)):
        exec(compile(block, f"docs/{page} [block {i}]", "exec"), namespace)


def test_skipped_blocks_are_rare():
    skipped = sum(len(re.findall(r"<!-- no-run", (DOCS / p).read_text())) for p in _pages())
    assert skipped <= 2


# ------------------------------------------------------------------------------ API reference


def _public_names() -> set[str]:
    codecs = hifigrad.codecs  # an attribute (hifigrad._src.codecs), not a module path
    names = {f"hifigrad.{n}" for n in hifigrad.__all__ if n != "codecs"}
    names |= {f"hifigrad.codecs.{n}" for n in codecs.__all__}
    for mod in ("flax", "equinox"):
        try:
            m = importlib.import_module(f"hifigrad.{mod}")
        except ImportError:
            continue
        names |= {f"hifigrad.{mod}.{n}" for n in m.__all__}
    return names


def _documented() -> set[str]:
    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    return set(re.findall(r"^::: (\S+)", text, re.M))


def test_api_reference_lists_every_public_name():
    missing = sorted(_public_names() - _documented())
    assert not missing, f"public names missing from docs/api/*.md: {missing}"


def _resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_api_reference_targets_exist():
    for path in sorted(_documented()):
        try:
            _resolve(path)
        except ImportError:
            if path.startswith(("hifigrad.flax", "hifigrad.equinox")):
                continue
            raise


@pytest.mark.parametrize("name", sorted(_public_names()))
def test_public_docstring_is_complete(name):
    obj = _resolve(name)
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{name}: no runnable example in its docstring"
    if inspect.isfunction(obj):
        for section in ("Args:", "Returns:"):
            assert section in doc, f"{name}: no {section} section"


# ------------------------------------------------------------------------------ JAX releases


def _release_rows(text: str) -> list[str]:
    return re.findall(r"^\| (\d+\.\d+\.\d+(?:\.\d+)?) \| 3\.1\d \|", text, re.M)


@pytest.mark.parametrize("where", ["README.md", "docs/jax-releases.md"])
def test_release_table_lists_the_tested_releases(where):
    rows = _release_rows((ROOT / where).read_text())
    assert rows == list(compat.TESTED_JAX)
    pins = sorted(p.name[len("jax-"):-len(".txt")] for p in (ROOT / "ci").glob("jax-*.txt"))
    assert sorted(rows) == pins


def test_version_lives_in_pyproject_only():
    """The changelog and the site never write the package version by hand (it is
    pyproject.toml's `version`, read by `hifigrad.__version__`), except as a changelog release
    heading, which must then be that version or an older one."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == "Unreleased"
    released = headings[1:]
    assert not released or released[0] == version
