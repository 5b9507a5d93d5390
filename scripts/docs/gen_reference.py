"""Generate the reference pages of the docs site from the code: the CLI and configuration references from the parsers
``kforge`` runs, the catalogue of ``kforge: error:`` messages from the raise sites, and the API pages (mkdocstrings).

The MkDocs hook (``scripts/docs/hooks.py``) calls :func:`generate` on every build, so these pages are never written by
hand and never committed. To look at them without building the site:

    python scripts/docs/gen_reference.py --out /tmp/reference
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

REPO = HERE.parents[1]


def generate(repo: Path = REPO) -> dict[str, str]:
    """``{path under docs/: markdown}`` of every generated page."""
    if str(HERE) not in sys.path:  # MkDocs loads hooks with this folder on sys.path only while importing them
        sys.path.insert(0, str(HERE))
    import jsonargparse
    from api_pages import api_pages
    from cli_reference import cli_markdown
    from config_reference import config_markdown
    from error_catalogue import errors_markdown

    from kempnerforge.console import filter_harmless_warnings

    filter_harmless_warnings()
    # The help of each field is its dataclass / constructor docstring (kforge reads them only for --help).
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    pages = {
        "reference/cli.md": cli_markdown(),
        "reference/config.md": config_markdown(),
        "reference/errors.md": errors_markdown(repo),
    }
    pages.update(api_pages(repo))
    return pages


def main(argv: list[str] | None = None) -> None:
    """Write the generated pages under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the pages into")
    args = parser.parse_args(argv)
    for path, text in generate().items():
        target = args.out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(target)


if __name__ == "__main__":
    main()
