"""Issue 29, checks 1, 2 and 8: the docs site builds with ``mkdocs build --strict`` (broken links, missing API objects
fail it) with its reference pages generated from the code, the README reaches every page in one click, and in a real
browser (headless Chromium, tests/cdp.py) the home page, a tutorial, the CLI reference and an API page render, log no
console error, request nothing outside the machine, and search works from the built folder (file://).

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

from tests.cdp import Chromium, ensure_chromium

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


PAGES = ("index.html", "tutorials/pretrain.html", "reference/cli.html", "reference/api/strategies.html")


def test_pages_render_offline_in_headless_chromium(site, tmp_path):
    """Check 8: each page loads from the built folder with no console error and no request that leaves the machine;
    the search box finds pages, and a navigation link opens its page. Screenshots are kept in the test's folder."""
    executable, why = ensure_chromium()
    if executable is None:
        pytest.skip(why)
    browser = Chromium(executable, tmp_path / "profile")
    try:
        for page in PAGES:
            browser.open((site / page).as_uri())
            assert browser.wait_for("document.querySelector('article h1') !== null"), page
            title = browser.evaluate("document.querySelector('article h1').textContent")
            assert title.strip(), page
            shot = browser.screenshot(tmp_path / (page.replace("/", "_") + ".png"))
            assert shot.stat().st_size > 20_000, page  # a rendered page, not a blank one
        browser.open((site / "index.html").as_uri())
        browser.evaluate("""(() => { const box = document.querySelector('.md-search__input'); box.focus();
            box.value = 'checkpoint'; box.dispatchEvent(new Event('input', {bubbles: true})); return true; })()""")
        assert browser.wait_for("document.querySelectorAll('.md-search-result__item').length > 0", 20), "no results"
        browser.screenshot(tmp_path / "search.png")
        browser.evaluate("setTimeout(() => document.querySelector('a[href$=\"coming-from.html\"]').click(), 0)")
        assert browser.wait_for("location.href.endsWith('coming-from.html') && document.readyState === 'complete'")
        assert "torchtitan" in browser.evaluate("document.querySelector('article h1').textContent")
    finally:
        browser.close()
    print(f"screenshots in {tmp_path}")
    assert not browser.log.errors, browser.log.errors
    outside = [u for u in browser.log.requests if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert not outside, outside
    assert sum(u.startswith("file:") for u in browser.log.requests) >= len(PAGES)  # the requests were recorded
