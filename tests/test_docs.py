"""Runs the code in the documentation, and checks that the API reference covers the whole public API.

Every ```python block of `README.md` and of each `docs/**/*.md` page runs, in order, in one namespace per file, as
a reader who pastes them one after the other would run them. A file without such blocks has no test.

A top-level `print(...)` line followed by a `# comment` states its output: the test compares the printed text with
the comment, ignoring differences in whitespace. Prints without a comment, or inside loops and functions, are
only run.
"""

import ast
import contextlib
import html
import inspect
import io
import pathlib
import re
import subprocess
import sys
import types

import pytest

import eqx_quant

from .helpers import slow_unless


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# An opening fence: up to three spaces or a deeper indent (inside a list or an admonition), three or more backticks or
# tildes, and an info string whose first word is the language.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")


def _python_blocks_in(text: str, where: str) -> list[tuple[int, str]]:
    """The ```python blocks of Markdown `text`, as (line number of the first code line, dedented source)."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        start = i + 1
        end = start
        while end < len(lines) and closing.match(lines[end]) is None:
            end += 1
        if end == len(lines):
            raise ValueError(f"{where}:{i + 1}: the code block opened here is never closed.")
        language = info.split(maxsplit=1)[0].lower() if info else ""
        if language in ("python", "py"):
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start:end]]
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


def _python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    return _python_blocks_in(path.read_text(encoding="utf-8"), str(path))


def _doc_id(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


_FILES_WITH_CODE = [p for p in DOC_FILES if p.is_file() and _python_blocks(p)]


def _expected_output(source_lines: list[str], statement: ast.stmt) -> str | None:
    """The comment that states what a top-level `print(...)` line prints, if it has one."""
    if not (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Name)
        and statement.value.func.id == "print"
        and statement.lineno == statement.end_lineno
    ):
        return None
    line = source_lines[statement.lineno - 1]
    assert statement.end_col_offset is not None
    rest = line[statement.end_col_offset :].strip()
    if not rest.startswith("#"):
        return None
    return rest[1:].strip()


def _run_file(path: pathlib.Path) -> None:
    name = "eqx_quant_docs_" + re.sub(r"\W", "_", _doc_id(path))
    # A real module, so that classes defined in the docs (dataclasses, Equinox modules) can find their namespace.
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        for first_line, source in _python_blocks(path):
            # Padding with blank lines makes tracebacks point at the line of the Markdown file.
            padded = "\n" * (first_line - 1) + source
            tree = ast.parse(padded, filename=str(path))
            source_lines = padded.splitlines()
            for statement in tree.body:
                code = compile(ast.Module(body=[statement], type_ignores=[]), str(path), "exec")
                expected = _expected_output(source_lines, statement)
                if expected is None:
                    exec(code, module.__dict__)
                    continue
                buffer = io.StringIO()
                with contextlib.redirect_stdout(buffer):
                    exec(code, module.__dict__)
                printed = buffer.getvalue()
                sys.stdout.write(printed)
                assert printed.split() == expected.split(), (
                    f"{_doc_id(path)}:{statement.lineno}: printed {printed.strip()!r}, the comment says {expected!r}."
                )
    finally:
        del sys.modules[name]


@pytest.mark.parametrize(
    "path", slow_unless([p for p in _FILES_WITH_CODE if p.name == "getting-started.md"], _FILES_WITH_CODE), ids=_doc_id
)
def test_code_blocks_run(path: pathlib.Path) -> None:
    _run_file(path)


def _reexports(package: pathlib.Path) -> list[str]:
    """The public names that a package's `__init__.py` re-exports; a re-exported subpackage contributes its own
    names, dotted (`nn.QuantLinear`), since the reference documents the members of a subpackage."""
    tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.level == 1):
            continue
        for alias in node.names:
            name = alias.asname or alias.name
            if name.startswith("_"):
                continue
            if node.module is None and (package / alias.name / "__init__.py").is_file():
                names += [f"{name}.{sub}" for sub in _reexports(package / alias.name)]
            else:
                names.append(name)
    return sorted(names)


def _public_names() -> list[str]:
    return _reexports(ROOT / "eqx_quant")


def _documented_names() -> dict[str, str]:
    """`NAME -> page` for every `::: eqx_quant.NAME` directive in `docs/api/`."""
    documented = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for match in re.finditer(r"^:::[ \t]+eqx_quant\.([\w.]+)[ \t]*$", page.read_text(encoding="utf-8"), re.M):
            documented[match[1]] = _doc_id(page)
    return documented


def test_public_names_found() -> None:
    # Guards the check below against a parser that finds nothing and so passes vacuously.
    names = _public_names()
    assert {"fake_quant", "int_range"} <= set(names)
    for name in names:
        obj = eqx_quant
        for part in name.split("."):
            obj = getattr(obj, part)


def _is_documented(name: str, documented: dict[str, str]) -> bool:
    # `::: eqx_quant.nn` documents everything in `eqx_quant.nn`.
    parts = name.split(".")
    return any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1))


def test_api_reference_is_complete() -> None:
    documented = _documented_names()
    missing = [name for name in _public_names() if not _is_documented(name, documented)]
    assert not missing, f"public names with no `::: eqx_quant.NAME` entry in docs/api/*.md: {missing}"


def test_api_reference_names_exist() -> None:
    for name, page in _documented_names().items():
        obj = eqx_quant
        for part in name.split("."):
            assert hasattr(obj, part), f"{page} documents `eqx_quant.{name}`, which does not exist."
            obj = getattr(obj, part)


def test_fence_parser() -> None:
    # The parser itself: indented blocks (admonitions), attributes after the language, other languages and tildes.
    text = (
        "Text.\n"
        "```python\nx = 1\n```\n"
        '!!! example\n\n    ```python title="t.py"\n    y = x + 1\n\n    z = 2\n    ```\n'
        "```bash\nexit 1\n```\n"
        "~~~~py\nw = 3\n~~~~\n"
        "````markdown\n```python\nnot_run()\n```\n````\n"
    )
    assert _python_blocks_in(text, "probe") == [(3, "x = 1\n"), (8, "y = x + 1\n\nz = 2\n"), (16, "w = 3\n")]
    with pytest.raises(ValueError, match="never closed"):
        _python_blocks_in("```python\nx = 1\n", "probe")


def test_stated_output_is_checked(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\n```\n\n```python\nprint(x + 1)  # 3\nprint([x,  x])  # [2, 2]\n```\n")
    _run_file(page)
    page.write_text("```python\nprint(1 + 1)  # 3\n```\n")
    with pytest.raises(AssertionError, match="the comment says '3'"):
        _run_file(page)


def _docstrings() -> dict[str, str]:
    """`NAME -> docstring` for every public name and the public methods of public classes."""
    found = {}
    for name in _public_names():
        obj = eqx_quant
        for part in name.split("."):
            obj = getattr(obj, part)
        members = [(name, obj)]
        if isinstance(obj, type):
            members += [
                (f"{name}.{attr}", value)
                for attr, value in vars(obj).items()
                if (not attr.startswith("_") or attr in ("__init__", "__call__")) and getattr(value, "__doc__", None)
            ]
        for member, value in members:
            doc = getattr(value, "__func__", value).__doc__
            if doc and "```python" in doc:
                found[member] = inspect.cleandoc(doc)
    return found


_DOCSTRINGS = _docstrings()


def test_docstrings_with_examples_found() -> None:
    assert {"fake_quant", "quantize", "convert", "FakeQuant"} <= set(_DOCSTRINGS)


@pytest.mark.parametrize("name", sorted(_DOCSTRINGS))
@pytest.mark.slow
def test_docstring_examples_run(name: str, tmp_path: pathlib.Path) -> None:
    # The examples in the docstrings are shown in the API reference, so they run like the pages' code blocks.
    page = tmp_path / f"{name}.md"
    page.write_text(_DOCSTRINGS[name], encoding="utf-8")
    _run_file(page)


@pytest.mark.slow
def test_built_site_renders_every_public_name(tmp_path: pathlib.Path) -> None:
    """`mkdocs build --strict` succeeds and the API pages it writes hold an entry (an anchor with the name's full
    path, which mkdocstrings gives every object it renders) for every public name; the pages have their titles and
    the MathJax bundle is served from the site itself."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    api_html = "".join(page.read_text(encoding="utf-8") for page in (site / "api").rglob("index.html"))
    assert ":::" not in api_html  # every `::: name` directive was rendered
    # Signatures show their jaxtyping annotations, shapes included (the page's text without its markup).
    primitives = html.unescape(re.sub(r"<[^>]+>", "", (site / "api" / "primitives" / "index.html").read_text("utf-8")))
    assert 'scale: Real[ArrayLike, "*scale_shape"]' in primitives and '-> Float[Array, "*shape"]' in primitives
    missing = [name for name in _public_names() if f'id="eqx_quant.{name}"' not in api_html]
    assert not missing, f"public names without an entry in the built API pages: {missing}"
    assert '<h1 id="eqx_quant">eqx_quant' in (site / "index.html").read_text(encoding="utf-8")
    sharded = (site / "how-to" / "sharded" / "index.html").read_text(encoding="utf-8")
    assert '<h1 id="sharded-training">Sharded training' in sharded
    assert (site / "assets" / "mathjax" / "tex-chtml.js").is_file()
    assert (site / "search" / "search_index.json").is_file()
