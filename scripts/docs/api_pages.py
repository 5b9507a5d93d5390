"""The generated Python API pages: one page per package, one mkdocstrings section per public module, so a new module
is documented from its docstrings with nothing to list by hand."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Folders of the repository and the package name each installs as (``pyproject.toml``'s package-dir mapping).
PACKAGE_DIRS = {
    "kempnerforge": "kempnerforge",
    "strategies": "kempnerforge.strategies",
    "callbacks": "kempnerforge.callbacks",
}
#: Options of every module section (mkdocstrings-python).
OPTIONS = """    options:
      show_root_heading: true
      show_root_full_path: true
      show_submodules: false
      members_order: source
      heading_level: 2"""


def public_modules(repo: Path) -> list[str]:
    """Every importable module of the package whose dotted name has no part starting with ``_``."""
    names = []
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(repo / folder).with_suffix("").parts if p != "__init__"]
            if not any(p.startswith("_") for p in parts):
                names.append(".".join([package, *parts]))
    return names


def _page_of(module: str) -> str:
    """The page a module is listed on: its sub-package (``kempnerforge.model.vlm.mot`` -> ``model``), or
    ``kempnerforge`` for the top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "kempnerforge"


#: Sub-packages that get a page of their own (the rest of the top level shares ``kempnerforge``).
PACKAGES = ("config", "model", "parallel", "data", "training", "checkpoint", "metrics", "resilience", "estimate",
            "tools", "strategies", "callbacks")  # fmt: skip


def api_pages(repo: Path) -> dict[str, str]:
    """``{"reference/api/<page>.md": markdown}`` for every page, and the index page listing them."""
    pages: dict[str, list[str]] = {}
    for module in public_modules(repo):
        pages.setdefault(_page_of(module), []).append(module)
    out = {}
    for page, modules in pages.items():
        title = "kempnerforge (top level)" if page == "kempnerforge" else f"kempnerforge.{page}"
        body = [f"# {title}", "", "Generated from the docstrings by mkdocstrings (`scripts/docs/api_pages.py`).", ""]
        body += [f"::: {m}\n{OPTIONS}\n" for m in modules]
        out[f"reference/api/{page}.md"] = "\n".join(body)
    index = [
        "# Python API",
        "",
        "Every public module, from its docstrings (shapes, units, errors raised, sources):",
        "",
    ]
    index += [f"- [`{'kempnerforge' if p == 'kempnerforge' else 'kempnerforge.' + p}`]({p}.md): "
              f"{len(pages[p])} modules" for p in sorted(pages)]  # fmt: skip
    out["reference/api/index.md"] = "\n".join(index) + "\n"
    return out


def source_tree(repo: Path) -> Path:
    """A folder where ``kempnerforge/`` holds the package as it installs (``strategies`` and ``callbacks`` inside it,
    as symlinks), for griffe, which reads the source statically and does not follow the package-dir mapping."""
    root = Path(tempfile.mkdtemp(prefix="kforge-api-src-"))
    package = root / "kempnerforge"
    package.mkdir()
    for entry in (repo / "kempnerforge").iterdir():
        os.symlink(entry, package / entry.name)
    for folder, name in PACKAGE_DIRS.items():
        if name != "kempnerforge":
            os.symlink(repo / folder, package / name.rsplit(".", 1)[1])
    return root
