"""The documentation is tested: docstring examples, the site's code blocks, the API reference.

- Every ``>>>`` example in the package's docstrings runs (doctest, outputs checked where shown,
  ``ELLIPSIS | NORMALIZE_WHITESPACE``), one case per docstring.
- Every ```python block of the site's pages (``docs/**/*.md``) runs: on the pages a reader starts
  from, each block alone in a fresh namespace unless it says which blocks it continues (then
  after them), as a reader pastes them; on the others the blocks of a page in one namespace. A
  block preceded by an ``<!-- no-run: reason -->`` comment is skipped;
  ``docs/guides/frameworks.md`` has its own test (``tests/test_frameworks.py``).
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

import jax
import pytest
from lanes import in_turn

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


# One docstring in two in the default suite, in turn (tests/lanes.py: each CI lane's half is its
# own; issue 48: 43 of the default suite's 1525 s on jax 0.10.2); the `slow` tier runs them all.
@pytest.mark.parametrize("test", [
    pytest.param(t, id=t.name, marks=[] if in_turn(i, 2) else [pytest.mark.slow])
    for i, t in enumerate(_DOCTESTS)])
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


def _needs(blocks) -> None:
    """Skips (with the module's name) where a block imports a framework this machine lacks
    (equinox, haiku or keras on a TPU host's own Python, say)."""
    for mod in ("equinox", "flax", "optax", "haiku", "keras", "diffrax"):
        if any(re.search(rf"^\s*(import|from) {mod}\b", b, re.M) for b in blocks):
            pytest.importorskip(mod)


# Pages whose every section (the text before the first `## ` heading, then each `## ` section)
# runs on its own, in a fresh namespace: a reader who jumps to a section can copy its code.
_SELF_CONTAINED = ["guides/checkpoints.md"]

# A reader pastes one block at a time: each block of the pages a reader starts from runs on its
# own, in a fresh namespace, with JAX's default dtype promotion, unless its first line says
# which block it continues; a block the tests skip says so in its first line, where a reader
# sees it (not only in the HTML comment that marks it).
_READER_PAGES = ["README.md", "docs/getting-started.md",
                 *sorted(f"docs/guides/{p.name}" for p in (DOCS / "guides").glob("*.md"))]
_CONTINUES = re.compile(r"^# \(continues the blocks? above")


def _section_blocks(page: str) -> list[tuple[str, list[str]]]:
    parts = re.split(r"^## ", (DOCS / page).read_text(), flags=re.M)
    out = []
    for i, part in enumerate(parts):
        title = "(intro)" if i == 0 else part.partition("\n")[0].strip()
        blocks = [code for skip, code in _BLOCK.findall(part) if not skip]
        if blocks:
            out.append((title, blocks))
    return out


def _chains(page: str) -> list[list[tuple[str, str]]]:
    """A reader page's runnable blocks as a reader pastes them, as [(where, code), ...] runs:
    a block that does not say it continues the blocks above starts a run of its own, a block
    that says so joins the run of the blocks it continues; on a `_SELF_CONTAINED` page each
    section starts afresh too."""
    sections = (_section_blocks(page) if page in _SELF_CONTAINED
                else [("", _blocks(page))])
    chains: list = []
    for title, blocks in sections:
        fresh = True
        for i, code in enumerate(blocks):
            where = f"docs/{page} [{title + ', ' if title else ''}block {i}]"
            if fresh or not _CONTINUES.match(code.splitlines()[0]):
                chains.append([])
            chains[-1].append((where, code))
            fresh = False
    return chains


def _run_chained(page: str) -> bool:
    """Whether `page`'s blocks run as `_chains` (a reader page of the site, under the suite's
    strict promotion), rather than all in one namespace."""
    return f"docs/{page}" in _READER_PAGES


@pytest.mark.parametrize("page", [p for p in _pages() if _blocks(p)])
def test_page_code_blocks_run(page):
    """Every runnable block of the page, under the suite's strict dtype promotion: a reader
    page's as `_chains` (each block that does not continue another in a fresh namespace, so
    the block runs alone as a reader pastes it: what passes under strict promotion passes under
    JAX's default one too), the other pages' in one namespace."""
    _needs(_blocks(page))
    if not _run_chained(page):
        namespace: dict = {"__name__": "__docs__"}
        for i, block in enumerate(_blocks(page)):
            exec(compile(block, f"docs/{page} [block {i}]", "exec"), namespace)
        return
    for chain in _chains(page):
        namespace = {"__name__": "__docs__"}
        for where, block in chain:
            exec(compile(block, where, "exec"), namespace)


def _reader_blocks():
    out = []
    for page in _READER_PAGES:
        for i, (skip, code) in enumerate(_BLOCK.findall((ROOT / page).read_text())):
            out.append((page, i, bool(skip), code))
    return out


@pytest.mark.parametrize("page, i, skip, code", _reader_blocks(),
                         ids=[f"{p}[{i}]" for p, i, _, _ in _reader_blocks()])
def test_each_block_runs_as_pasted_or_says_it_continues(page, i, skip, code):
    first = code.splitlines()[0]
    if skip:
        assert first.startswith("#") and "not run" in first, (page, i, first)
        return
    if _CONTINUES.match(first):
        assert i > 0, (page, i)
        return  # runs after the blocks it continues (test_page_code_blocks_run)
    if page.startswith("docs/") and page[len("docs/"):] in _pages():
        return  # runs alone, strictly, in test_page_code_blocks_run (`_chains`)
    _needs([code])
    namespace: dict = {"__name__": "__docs__"}
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        exec(compile(code, f"{page} [block {i}, alone]", "exec"), namespace)


# The pages a newcomer reads first: a block there that continues another imports every module
# it uses itself, and its first line names every other value it takes from the blocks above.
_IMPORTS_IN_EACH_BLOCK = ["README.md", "docs/getting-started.md"]


def _free_names(code: str) -> set[str]:
    """Names ``code`` reads that it neither binds nor finds in builtins (its own functions'
    parameters and locals are bound)."""
    import builtins
    import symtable

    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    read: set[str] = set()

    def walk(table):
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                read.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return read - bound - set(dir(builtins))


def _imported_names(code: str) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("page", _IMPORTS_IN_EACH_BLOCK)
def test_a_continuing_block_imports_what_it_uses_and_names_the_rest(page):
    blocks = [code for skip, code in _BLOCK.findall((ROOT / page).read_text()) if not skip]
    for i, code in enumerate(blocks):
        first = code.splitlines()[0]
        if not _CONTINUES.match(first):
            continue
        earlier = "\n".join(blocks[:i])
        free = _free_names(code)
        modules = free & _imported_names(earlier)
        assert not modules, f"{page} [block {i}] uses {sorted(modules)} without importing them"
        listed = set(re.findall(r"\w+", first.partition(":")[2]))
        assert free <= listed, f"{page} [block {i}]: {first!r} does not name {free - listed}"


def test_continuing_block_check_catches_a_missing_import():
    code = "# (continues the block above: x)\ny = jnp.tanh(x)\ndef f(a):\n    return hg.grad(a)\n"
    assert _free_names(code) == {"jnp", "x", "hg"}
    assert _imported_names("import jax, jax.numpy as jnp\nimport hifigrad as hg") == {
        "jax", "jnp", "hg"}


def test_self_contained_pages_have_several_sections():
    for page in _SELF_CONTAINED:
        assert len(_section_blocks(page)) >= 5, page


def test_skipped_blocks_are_rare():
    skipped = sum(len(re.findall(r"<!-- no-run", (DOCS / p).read_text())) for p in _pages())
    assert skipped <= 2


# ------------------------------------------------------------------------------ API reference


def _public_names() -> set[str]:
    codecs = hifigrad.codecs  # an attribute (hifigrad._src.codecs), not a module path
    names = {f"hifigrad.{n}" for n in hifigrad.__all__ if n not in ("codecs", "optim")}
    names |= {f"hifigrad.codecs.{n}" for n in codecs.__all__}
    names |= {f"hifigrad.optim.{n}" for n in hifigrad.optim.__all__}
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


_RELEASE_ROW = re.compile(r"^\| (\d+\.\d+\.\d+(?:\.\d+)?) \| (3\.1\d(?:, 3\.1\d)*) \|", re.M)


def _release_rows(text: str) -> list[str]:
    return [release for release, _ in _RELEASE_ROW.findall(text)]


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


def test_python_versions_agree_between_ci_classifiers_and_release_tables():
    """Each Python version CI tests (.ci/run) is a classifier and in both releases tables."""
    import tomllib

    ci = (ROOT / ".ci" / "run").read_text()
    lanes = set(re.findall(r"\|\$PY3(\d\d)\|", ci))
    tested = {f"3.{v}" for v in lanes}
    classifiers = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["classifiers"]
    declared = {c.rsplit(" :: ", 1)[1] for c in classifiers
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert declared == tested
    for where in ("README.md", "docs/jax-releases.md"):
        cells = _RELEASE_ROW.findall((ROOT / where).read_text())
        assert {v for _, pythons in cells for v in pythons.split(", ")} == tested, where


# ------------------------------------------------------------------------------ rendering
# What the built site shows, checked on the sources: each test below failed on a defect seen
# in the rendered site (API reference, home page, benchmarks page).

def _mkdocs_option(name: str) -> str | None:
    m = re.search(rf"^\s*{name}:\s*(\S+)", (ROOT / "mkdocs.yml").read_text(), re.M)
    return m.group(1) if m else None


def _documented_callables():
    """(name, object) of every function and method the API reference renders."""
    out = []
    for name in sorted(_public_names() | _documented()):
        try:
            obj = _resolve(name)
        except ImportError:
            continue
        out.append((name, obj))
        if inspect.isclass(obj):
            out += [(f"{name}.{k}", v) for k, v in vars(obj).items()
                    if not k.startswith("_") and inspect.isfunction(v)]
    return out


def _returns_items(doc: str, multiple: bool) -> list[list[str]] | None:
    """The items of a Google-style Returns section as griffe (mkdocstrings) splits them: with
    ``returns_multiple_items`` each line at the section's own indentation starts an item."""
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Returns:" and not line.startswith(" "):
            body = []
            for ln in lines[i + 1:]:
                if not ln.strip() or not ln.startswith(" "):
                    break
                body.append(ln)
            if not multiple:
                return [body]
            base = len(body[0]) - len(body[0].lstrip())
            items: list[list[str]] = []
            for ln in body:
                if len(ln) - len(ln.lstrip()) == base:
                    items.append([])
                items[-1].append(ln)
            return items
    return None


def test_returns_sections_render_as_one_paragraph():
    """A prose Returns section is one item without a name or a type (rendered as a paragraph
    by docs/_templates): split per line it rendered as 2-3 broken table rows, and a first line
    ``word: ...`` would render ``word`` as the returned value's name."""
    multiple = _mkdocs_option("returns_multiple_items") != "false"
    assert (ROOT / "docs/_templates/python/material/docstring/returns.html.jinja").exists()
    assert _mkdocs_option("custom_templates") == "docs/_templates"
    bad = []
    for name, obj in _documented_callables():
        items = _returns_items(inspect.getdoc(obj) or "", multiple)
        if items is None:
            continue
        if len(items) != 1:
            bad.append(f"{name}: {len(items)} items")
        elif re.match(r"^\s*(\w+)?\s*(\(.+\))?:", items[0][0]):
            bad.append(f"{name}: first line reads as 'name (type):' {items[0][0].strip()!r}")
    assert not bad, bad


def test_returns_check_catches_a_line_per_item():
    doc = "Summary.\n\nReturns:\n  A function that returns the gradient (with\n  aux).\n"
    assert len(_returns_items(doc, multiple=True)) == 2
    assert len(_returns_items(doc, multiple=False)) == 1


def _private_defaults(obj) -> list[str]:
    """Parameters whose default, as a rendered signature shows it (the source text), is a
    private name or an anonymous sentinel."""
    import ast
    import textwrap

    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return []
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    args = node.args
    pairs = list(zip(reversed(args.args + args.posonlyargs), reversed(args.defaults)))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    bad = []
    for arg, default in pairs:
        text = ast.unparse(default)
        if re.search(r"(^|\.)_[A-Za-z]", text) or "object()" in text:
            bad.append(f"{arg.arg}={text}")
    return bad


def test_no_private_default_in_a_rendered_signature():
    bad = {name: d for name, obj in _documented_callables()
           if (inspect.isfunction(obj) or inspect.isclass(obj)) and (d := _private_defaults(obj))}
    assert not bad, bad


def test_private_default_check_catches_a_sentinel():
    _MISSING = object()

    def f(g=_MISSING, *, h=None):
        return g, h

    assert _private_defaults(f) == ["g=_MISSING"]


def _toc_labels(page: str) -> list[str]:
    """The table of contents of an API page: its headings and each object's short name."""
    text = (DOCS / page).read_text()
    labels = re.findall(r"^#{2,3} (.+)$", text, re.M)
    labels += [m.rsplit(".", 1)[-1] for m in re.findall(r"^::: (\S+)", text, re.M)]
    return labels


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix()
                                        for p in (DOCS / "api").glob("*.md")))
def test_api_page_toc_has_no_duplicate_label(page):
    labels = _toc_labels(page)
    dup = sorted({x for x in labels if labels.count(x) > 1})
    assert not dup, f"docs/{page}: twice in the table of contents: {dup}"


def _code_lines(text: str) -> list[str]:
    return [ln for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
            for ln in block.splitlines()]


# A code line wider than this is cut off (scrolls) in the content column of a 1280-pixel-wide
# window; the site's grid (docs/stylesheets/extra.css) leaves 100 columns on a wide screen.
FIRST_PAGES_CODE_WIDTH = 80
CODE_WIDTH = 100
# Guides whose code has been wrapped to fit beside the site's navigation at 1280 pixels.
NARROW_PAGES_CODE_WIDTH = {"guides/checkpoints.md": 90}


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix()
                                        for p in DOCS.rglob("*.md")))
def test_page_code_lines_fit(page):
    limit = FIRST_PAGES_CODE_WIDTH if page in ("index.md", "getting-started.md") else \
        NARROW_PAGES_CODE_WIDTH.get(page, CODE_WIDTH)
    long = [ln for ln in _code_lines((DOCS / page).read_text()) if len(ln) > limit]
    assert not long, f"docs/{page}: code lines over {limit} columns: {long}"


def test_readme_code_lines_fit():
    text = (ROOT / "README.md").read_text()
    long = [ln for ln in _code_lines(text) if len(ln) > FIRST_PAGES_CODE_WIDTH]
    assert not long, long


def _table_min_width_px(rows: list[list[str]]) -> int:
    """The narrowest a Markdown table renders on the site: per column, its longest unbreakable
    token (a word, or a code span's word: extra.css keeps code from breaking inside a name) at
    ~7 px a character in table type, plus cell padding, and at least a header cell's 3.5rem."""
    width = 0
    for col in range(len(rows[0])):
        longest = 0
        for row in rows:
            cell = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", row[col] if col < len(row) else "")
            longest = max([longest] + [len(w) for w in cell.replace("`", " ").split()])
        width += max(70, 7 * longest + 40)
    return width


# The content column of the site's 1440-pixel grid beside both sidebars.
TABLE_WIDTH_PX = 900


def _tables(text: str) -> list[list[list[str]]]:
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|[-:| ]+\|", line):
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix()
                                        for p in DOCS.rglob("*.md")))
def test_page_tables_fit_the_page(page):
    wide = [(t[0], _table_min_width_px(t)) for t in _tables((DOCS / page).read_text())
            if _table_min_width_px(t) > TABLE_WIDTH_PX]
    assert not wide, f"docs/{page}: tables wider than the page (scroll): {wide}"


def test_table_width_check_catches_the_twelve_column_demo_table():
    header = ["mode", "SQNR@0 dB", "SQNR dB", "final loss", "Δfinal", "mean|Δ|", "val loss",
              "saved MB", "blocks MB", "temp MB", "step ms", "compile s"]
    row = ["fp16 jax.grad loss-scaled"] + ["-0.00058"] * 11
    assert _table_min_width_px([header, row]) > TABLE_WIDTH_PX


def test_site_opens_from_disk_and_names_its_server():
    """Pages link to files (page.html), not directories, so site/ works from file://; the
    README says how to serve it with search."""
    assert _mkdocs_option("use_directory_urls") == "false"
    assert "make docs-serve" in (ROOT / "README.md").read_text()
    assert re.search(r"^docs-serve:", (ROOT / "Makefile").read_text(), re.M)


# ------------------------------------------------------------------------------ README, sdist

def _site_url() -> str:
    return _mkdocs_option("site_url")


def _anchors(page: pathlib.Path) -> set[str]:
    """Heading ids as Python-Markdown's toc extension makes them."""
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        h = re.sub(r"`|\*", "", h).strip().lower()
        h = re.sub(r"[^\w\s-]", "", h)
        out.add(re.sub(r"[-\s]+", "-", h).strip("-"))
    return out


def test_readme_links_resolve_in_a_clone():
    """hifigrad is not on a package index yet and its site is not published: the README's
    links are relative paths to files of the clone (the docs' Markdown sources, which GitHub
    and editors render), each target present and each #anchor a heading it has; no link
    points at the unpublished site."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert len(links) >= 10
    assert _site_url() not in text, "the docs site is not published: link docs/*.md instead"
    for url in links:
        assert not re.match(r"^[a-z]+://", url), f"{url}: link a file of the clone instead"
        path, _, anchor = url.partition("#")
        target = ROOT / path
        assert target.is_file(), url
        assert not anchor or anchor in _anchors(target), url


def test_readme_link_check_catches_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## The `hg.scan` section\n")
    assert _anchors(page) == {"title", "the-hgscan-section"}


def test_readme_says_how_to_install_without_a_package_index():
    text = (ROOT / "README.md").read_text()
    assert "not on PyPI" in text
    assert re.search(r"^pip install '\.\[flax\]'", text, re.M)
    assert "pip install '/path/to/hifigrad[flax]'" in text
    assert not re.search(r"^pip install (hifigrad|'hifigrad\[)", text, re.M)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def test_sdist_selection_holds_sources_and_nothing_machine_specific():
    """pyproject.toml's sdist list: the package, tests, examples, benchmark scripts and docs
    sources (with the site's templates and stylesheet); no CI scripts or pins (interpreter
    paths), images or measured results."""
    import fnmatch
    import tomllib

    sdist = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"]["sdist"]
    include = [p.lstrip("/") for p in sdist["include"]]

    def shipped(path: str) -> bool:
        # gitignore-style patterns, as hatchling reads them: `**/` also matches no folder
        return any(path == p or path.startswith(p + "/") or fnmatch.fnmatch(path, p)
                   or fnmatch.fnmatch(path, p.replace("**/", "")) for p in include)

    import os

    skip = {".git", "__pycache__", "site", ".pytest_cache", ".hypothesis", ".ruff_cache"}
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]
        rel = pathlib.Path(folder).relative_to(ROOT)
        files += [(rel / n).as_posix() for n in names]
    for must in ("hifigrad/__init__.py", "hifigrad/py.typed", "tests/test_docs.py",
                 "docs/index.md", "docs/stylesheets/extra.css", "mkdocs.yml", "LICENSE",
                 "docs/_templates/python/material/docstring/returns.html.jinja"):
        assert shipped(must), must
    never = [f for f in files if shipped(f) and (
        f.startswith((".ci/", "ci/", "benchmarks/results/", "docs/img/", "demo-out/"))
        or f.endswith((".png", ".json")))]
    assert not never, never


def _links_that_fail_from_disk(site: pathlib.Path) -> list[str]:
    """Links between the built site's pages that a browser cannot follow from file://: a
    target that is a folder (it shows a directory listing) or that does not exist."""
    bad = []
    for page in site.rglob("*.html"):
        if page.name == "404.html":  # a web server's page (links from the site's root URL)
            continue
        for href in re.findall(r'href="([^"]+)"', page.read_text(encoding="utf-8")):
            if re.match(r"^(?:[a-z]+:|#|//)", href):
                continue
            path = href.split("#", 1)[0].split("?", 1)[0]
            if not path:
                continue
            target = (page.parent / path).resolve()
            if not target.is_file():
                bad.append(f"{page.relative_to(site)} -> {href}")
    return bad


def test_disk_link_check_catches_a_directory_url(tmp_path):
    (tmp_path / "getting-started").mkdir()
    (tmp_path / "getting-started" / "index.html").write_text("<p>hi</p>")
    (tmp_path / "index.html").write_text('<a href="getting-started/">x</a>'
                                         '<a href="getting-started/index.html#a">y</a>')
    assert _links_that_fail_from_disk(tmp_path) == ["index.html -> getting-started/"]


def test_built_site_navigates_from_disk():
    """The site `make docs` built (site/, where present): every link between its pages opens
    a file."""
    site = ROOT / "site"
    if not (site / "index.html").exists():
        pytest.skip("no built site: run `make docs` first")
    assert not _links_that_fail_from_disk(site)
