"""Issue 29, checks 1 and 2: the docs site builds with ``mkdocs build --strict`` (broken links, missing API objects
fail it) with its reference pages generated from the code, and the README reaches every page in one click.

The site is built once for the module (about 15 s of CPU: the reference pages import kempnerforge and build its
parsers, mkdocstrings reads every module)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` of the repository into a temporary folder (nothing is written into the repository)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]' (dev has it)")
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    print(f"mkdocs build --strict: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    return out


def _text(path: Path) -> str:
    return re.sub(r"<[^>]+>", " ", path.read_text())


def test_the_reference_pages_are_generated_from_the_code(site):
    from kempnerforge.commands import LIGHTNING_COMMANDS, TOOLS
    from kempnerforge.config import ModelConfig

    cli = _text(site / "reference" / "cli.html")
    for name in [*LIGHTNING_COMMANDS, *TOOLS]:
        assert f"kforge {name}" in cli, name
    for option in ("--num_nodes", "--devices_per_node", "--max_new_tokens", "--hf_dir", "--format", "--ckpt_path"):
        assert option in cli, option
    config = _text(site / "reference" / "config.html")
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"--model.config.{f.name}" not in config]
    assert not missing, missing
    for field in ("--trainer.strategy.init_args.tp", "--model.init_args.vlm.arch", "--data.init_args.packing",
                  "--init_args.max_consecutive", "--trainer.max_steps", "--data.seq_len"):  # fmt: skip
        assert field in config, field
    errors = (site / "reference" / "errors.html").read_text()
    assert errors.count("<tr>") > 200 and "model.config.n_heads" in errors
    api = site / "reference" / "api"
    for page, name in (("strategies", "KempnerStrategy"), ("callbacks", "NaNGuard"), ("model", "Transformer"),
                       ("estimate", "estimate"), ("config", "ModelConfig")):  # fmt: skip
        assert f'id="kempnerforge.{page}' in (api / f"{page}.html").read_text() and name in _text(api / f"{page}.html")
    assert (site / "search" / "search_index.js").is_file()  # the offline plugin's index, readable from file://


def test_no_page_loads_an_outside_resource(site):
    """No Google Fonts, no CDN script or stylesheet: what a page loads (``<script src>``, ``<link href>``, ``<img
    src>``) is this site's own; links to other sites (``<a href>``) are only followed when clicked."""
    loads = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']((?:https?:)?//[^"']+)""")
    outside = {str(p.relative_to(site)): found for p in site.rglob("*.html") if (found := loads.findall(p.read_text()))}
    assert not outside, outside


def test_the_readme_reaches_every_page_in_one_click():
    """Check 1: the README is a front page (at most ~200 lines) and links every how-to, concepts, performance and
    tutorial page of the site (the reference pages are generated: it names them)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    pages = {str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")}
    broken = links - pages
    assert not broken, broken
    unlinked = sorted(p for p in pages if p not in links and not p.endswith("/index.md"))
    assert not unlinked, f"pages the README does not link: {unlinked}"
