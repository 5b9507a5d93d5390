"""MkDocs hooks (``mkdocs.yml``: ``hooks``): the generated reference pages join the site's files on every build, and
mkdocstrings reads the package from a folder laid out as it installs (``scripts/docs/api_pages.py``)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from api_pages import source_tree  # noqa: E402
from gen_reference import REPO, generate  # noqa: E402

_SOURCE_TREES: list[Path] = []


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    """Point mkdocstrings' Python handler at the package as it installs (strategies and callbacks inside it)."""
    tree = source_tree(REPO)
    _SOURCE_TREES.append(tree)
    handlers = config.plugins["mkdocstrings"].config.handlers
    handlers.setdefault("python", {})["paths"] = [str(tree)]
    return config


def on_files(files, config):
    """Add the generated pages (never files under docs/)."""
    for path, text in generate(REPO).items():
        files.append(File.generated(config, path, content=text))
    return files


def on_post_build(config):
    """Remove the source trees made for mkdocstrings."""
    while _SOURCE_TREES:
        shutil.rmtree(_SOURCE_TREES.pop(), ignore_errors=True)
