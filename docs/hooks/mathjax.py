"""MkDocs hook that serves MathJax from a locally installed copy, so that building and reading the site need no network.

The MathJax 3 browser build ships in the `django-static-mathjax` wheel (a plain data package; Django is not needed).
`on_files` adds the TeX-to-CommonHTML component and everything it can load lazily (TeX extensions, fonts, the menu,
accessibility modules) to the site under `assets/mathjax/`, where `mkdocs.yml` points `extra_javascript`. Nothing is
copied into `docs/` and nothing is fetched from outside.
"""

import importlib.metadata
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files


DISTRIBUTION = "django-static-mathjax"
SITE_DIR = "assets/mathjax"
ENTRY_POINT = "tex-chtml.js"


def _mathjax_root() -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PluginError(
            f"The documentation renders math with the MathJax copy in `{DISTRIBUTION}`, which is not installed. "
            "Install the docs dependencies: `pip install -e '.[docs]'`."
        ) from None
    root = Path(str(dist.locate_file("mathjax/static/mathjax/es5")))
    if not (root / ENTRY_POINT).is_file():
        raise PluginError(f"`{DISTRIBUTION}` is installed but has no `es5/{ENTRY_POINT}` under {root}.")
    return root


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    root = _mathjax_root()
    # The entry point itself, plus every folder it may load from at run time. The other top-level bundles
    # (SVG output, MathML input, ...) are alternatives to the entry point and are left out.
    sources = [root / ENTRY_POINT]
    sources += sorted(p for d in root.iterdir() if d.is_dir() for p in d.rglob("*") if p.is_file())
    for path in sources:
        src_uri = f"{SITE_DIR}/{path.relative_to(root).as_posix()}"
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files
