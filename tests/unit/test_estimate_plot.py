"""``kforge estimate --plot`` (issue 27 check 5): the plotted series read back from the figure equal the report's
numbers, the PNG and the HTML page are written, the page fetches nothing, and a missing matplotlib is one line.

Oracles: the tracker's own peak (``get_tracker_snapshot("peak")``, the report's ``peak_bytes`` and breakdown), its
per-module high-point snapshots, the printed report, and the 1F1B action order of
:func:`~kempnerforge.estimate.pipeline_sim.single_stage_actions`. Estimates of the 2-7M-parameter debug recipes,
a second each.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.distributed.pipelining.schedules import FORWARD, REDUCE_GRAD

from kempnerforge.estimate import (
    estimate,
    format_text,
    plot,  # matplotlib is imported inside its functions only
)
from kempnerforge.estimate.allowance import Allowance
from kempnerforge.estimate.pipeline_sim import single_stage_actions
from kempnerforge.estimate.report import gb
from kempnerforge.estimate.tracker import CATEGORY
from kempnerforge.estimate.verdict import role_needed
from tests.e2e.inprocess import kforge_in_process

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug.yaml")
PP_DEBUG = str(REPO / "configs" / "pp_debug.yaml")
SHORT = ["--data.seq_len=64", "--data.micro_batch_size=2"]
FP32 = "--trainer.strategy.init_args.mixed_precision_param=float32"
#: GB values go through float64 once (bytes / 1e9, < 1e12 bytes): relative rounding ~1e-16.
REL = 1e-12


@pytest.fixture(scope="module")
def mpl():
    """matplotlib (the dev extra installs it); without it these tests skip and --plot is refused (the last test)."""
    pytest.importorskip("matplotlib")
    import matplotlib.colors
    import matplotlib.image

    return matplotlib


@pytest.fixture(scope="module")
def debug_est():
    """FSDP2 over dp_shard=2 (the FSDP tracker); 2.3 GB GPUs put the capacity lines in range of a 0.15 GB peak."""
    return estimate(["--config", DEBUG, *SHORT], 1, 2, gpu_memory_gb=2.3, alternatives=False)


@pytest.fixture(scope="module")
def pp_est():
    """pp=2 x 1F1B, 4 micro-batches: two roles, capacity far above the peak (the off-scale note)."""
    return estimate(["--config", PP_DEBUG], 1, 2, alternatives=False)


def _stack_at(ax, n: int) -> dict[str, np.ndarray]:
    """Each stacked area's thickness (GB) at x = 0..n-1, read from the polygons matplotlib drew."""
    out = {}
    for coll in ax.collections:
        (path,) = coll.get_paths()
        v = path.vertices
        out[coll.get_label()] = np.array([np.ptp(v[v[:, 0] == i][:, 1]) for i in range(n)])
    return out


def _bars(ax) -> dict[str, float]:
    """Ranking panel: each row's label and its stacked bar's length (GB)."""
    labels = [t.get_text() for t in ax.get_yticklabels()]
    totals = [0.0] * len(labels)
    for rect in ax.patches:
        if rect.get_height() < 1:  # the bars (0.7 high); the axes' own background is not in patches
            totals[round(rect.get_y() + rect.get_height() / 2)] += rect.get_width()
    return dict(zip(labels, totals, strict=True))


def _module_peak_oracle(memory: dict) -> dict[str, int]:
    """The tracker's high point per module (largest ``Peak Forward`` / ``Peak Backward`` snapshot), grouped by
    block index as the report groups them, the largest member per group."""
    groups: dict[str, list[int]] = {}
    for fqn, stats in memory["modules"].items():
        highs = [s["total"] for state in ("Peak Forward", "Peak Backward") for s in stats["snapshots"].get(state, [])]
        name = fqn.split(".", 1)[1] if "." in fqn else f"{fqn} (root)"
        name = name.replace("_checkpoint_wrapped_module.", "")
        groups.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "N", name), []).append(max(highs))
    return {k if len(v) == 1 else f"{k} (x{len(v)})": max(v) for k, v in groups.items()}


def _check_panels(est, fig) -> None:
    text = format_text(est)
    axes = fig.get_axes()
    assert len(axes) == 2 * len(est.roles)  # one row per role: timeline, modules
    for role, left, right in zip(est.roles, axes[0::2], axes[1::2], strict=True):
        n = len(role.timeline)
        stack = _stack_at(left, n)
        assert list(stack) == list(plot.GROUPS)  # no "other" layer: every tracker category is in a group
        top = sum(stack.values())
        # Every event's stack adds up to the tracked total there; the highest is the report's peak.
        np.testing.assert_allclose(top, [e["total"] / 1e9 for e in role.timeline], rtol=REL, atol=1e-15)
        assert top.max() == pytest.approx(role.peak_bytes / 1e9, rel=REL)
        assert max(e["total"] for e in role.timeline) == role.peak_bytes
        # At the peak the layers are the printed breakdown (``peak memory = ...``), grouped.
        at = int(np.argmax(top))
        for group, value in plot.grouped(role.peak_breakdown).items():
            assert stack.get(group, np.zeros(n))[at] == pytest.approx(value / 1e9, rel=REL, abs=1e-15), group
        assert re.search(rf"peak memory +{re.escape(gb(role.peak_bytes))}  = ", text)
        assert f"peak {gb(role.peak_bytes)}" in left.get_title(loc="left")
        # The modules' ranking: the tracker's high point per module group; each printed row's peak is its bar.
        oracle = _module_peak_oracle(role.memory)
        bars = _bars(right)
        assert list(bars) == sorted(oracle, key=oracle.get, reverse=True)[: plot.TOP_MODULES]
        for label, length in bars.items():
            assert length == pytest.approx(oracle[label] / 1e9, rel=REL)
            assert oracle[label] <= role.peak_bytes
        for m in role.largest_modules:
            assert m.peak_bytes == oracle[m.module] and f"; peak {gb(m.peak_bytes)}" in text
        # Phase marks in step order; the GPU's memory and capacity - allowance as lines, or named off scale.
        labels = {t.get_text() for t in left.texts}
        assert {"forward", "backward", "optimizer"} <= labels
        allowance = role_needed(Allowance(**est.allowance), role) - role.peak_bytes
        budget = est.gpu_memory_bytes - allowance
        lines = sorted(line.get_ydata()[0] for line in left.get_lines() if line.get_label().startswith("GPU memory"))
        if budget <= 4 * role.peak_bytes:
            assert lines == pytest.approx([budget / 1e9, est.gpu_memory_bytes / 1e9], rel=REL)
        else:
            assert not lines and any(f"GPU memory {gb(est.gpu_memory_bytes)} ({gb(budget)}" in t for t in labels)


def test_every_tracker_category_is_in_one_plotted_group():
    named = [c for cats in plot.GROUPS.values() for c in cats]
    assert sorted(named) == sorted(set(CATEGORY.values())) and len(named) == len(set(named))


def test_timeline_peak_is_the_trackers_peak_with_its_breakdown(debug_est, pp_est):
    """The timeline's first highest event is the tracker's peak moment: same total, same bytes by category; on
    the plain ``MemTracker`` too (one rank in fp32: FSDP2 is skipped)."""
    plain = estimate(["--config", DEBUG, *SHORT, FP32], 1, 1, alternatives=False)
    for est in (debug_est, pp_est, plain):
        for role in est.roles:
            tl = role.timeline
            top = max(e["total"] for e in tl)
            first = next(e for e in tl if e["total"] == top)
            assert top == role.peak_bytes and first["bytes"] == role.peak_breakdown
            assert all(e["total"] == sum(e["bytes"].values()) for e in tl)
    phases = [e["phase"] for e in debug_est.roles[0].timeline]  # no pipeline: forward, then backward, then optimizer
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    for role in pp_est.roles:  # 1F1B: one forward and one backward mark per micro-batch, in the schedule's order
        marks = [e["label"] for e in role.timeline if e["label"].startswith("stage ")]
        stage = int(role.role.split("stages ")[1].rstrip(")"))
        order = [m for m in marks if "micro-batch" in m]
        want = [f"stage {stage} {'forward' if a.computation_type == FORWARD else 'backward'}, "
                f"micro-batch {a.microbatch_index}" for a in single_stage_actions("1f1b", stage, 2, 4)
                if a.computation_type != REDUCE_GRAD]  # fmt: skip
        assert order == want


def test_plot_panels_match_the_printed_figures(mpl, debug_est, pp_est):
    """Issue 27 check 5: the stacked areas, peak, lines and module bars read back from the figure."""
    for est in (debug_est, pp_est):
        _check_panels(est, plot.draw(est, "configs/x.yaml"))


def test_cli_writes_the_png_and_the_timeline_in_json(mpl, tmp_path):
    png, out = tmp_path / "memory.png", tmp_path / "est.json"
    proc = kforge_in_process("estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "2", *SHORT,
                             "--plot", str(png), "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[estimate] wrote {png}" in proc.stderr
    image = mpl.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[:2] == (550, 1650)  # 15 x 5 in at 110 dpi
    assert (image[..., :3] < 0.9).mean() > 0.05  # drawn on, not a blank page
    (role,) = json.loads(out.read_text())["roles"]
    assert max(e["total"] for e in role["timeline"]) == role["peak_bytes"]


def test_html_is_self_contained_and_carries_the_plotted_numbers(mpl, pp_est, tmp_path):
    page = tmp_path / "memory.html"
    plot.write(pp_est, str(page), "configs/pp_debug.yaml")
    text = page.read_text()
    # Nothing fetched: every link is a fragment of the page; the only URLs are the SVG's XML namespace names.
    assert {v[:1] for v in re.findall(r'(?:href|src)\s*=\s*"([^"]*)"', text)} == {"#"}
    assert set(re.findall(r"https?://[^\s\"'<>)]*", text)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }
    assert not re.search(r"<link|@import|url\(\s*['\"]?(?!#)|@font-face", text)
    assert re.findall(r"<script[^>]*>", text) == ['<script type="application/json" id="kforge-estimate-plot">']
    assert "<svg" in text and "<text" not in text  # text drawn as paths: no font to fetch
    data = json.loads(text.split('id="kforge-estimate-plot">')[1].split("</script>")[0])
    for role, shown in zip(pp_est.roles, data["roles"], strict=True):
        assert shown["peak_bytes"] == role.peak_bytes == max(shown["total"])
        assert [sum(col) for col in zip(*shown["stack"].values(), strict=True)] == shown["total"]
    assert format_text(pp_est).splitlines()[1] in text  # the printed report, below the figure


def test_html_renders_in_chromium_without_network(mpl, pp_est, tmp_path):
    """Optional: a real browser in a network namespace with no interfaces draws the page (skipped where chromium or
    unshare is missing or not permitted; the suite installs nothing)."""
    chromium, unshare = shutil.which("chromium"), shutil.which("unshare")
    if chromium is None or unshare is None:
        pytest.skip("chromium or unshare not installed")
    if subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n not permitted here (no network namespace)")
    page, shot = tmp_path / "memory.html", tmp_path / "shot.png"
    plot.write(pp_est, str(page))
    proc = subprocess.run([unshare, "-n", chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--screenshot={shot}", "--window-size=1400,900", page.as_uri()],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    pixels = mpl.image.imread(shot)[..., :3]
    # The figure's stacked areas (orange activations, pink optimizer states) are on the screen.
    for color in ("#E69F00", "#CC79A7"):
        rgb = np.array(mpl.colors.to_rgb(color))
        assert (np.abs(pixels - rgb).max(axis=-1) < 0.02).mean() > 0.005, color


def test_plot_refused_in_one_line_before_anything_is_simulated(tmp_path, monkeypatch):
    import kempnerforge.estimate.run as run

    def never(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(run, "parallelize", never)
    base = ["estimate", "--config", DEBUG, "--num_nodes", "1", "--devices_per_node", "2"]
    cases = [
        (str(tmp_path / "m.pdf"), f"kforge: error: --plot={tmp_path / 'm.pdf'}: give a path ending in .png or .html"),
        (str(tmp_path / "no" / "m.png"), f"kforge: error: --plot={tmp_path / 'no' / 'm.png'}: the folder"),
    ]
    for path, line in cases:
        proc = kforge_in_process(*base, "--plot", path)
        assert proc.returncode == 2 and proc.stderr.startswith(line), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails, find_spec finds nothing
    proc = kforge_in_process(*base, "--plot", str(tmp_path / "m.png"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("kforge: error: --plot: needs matplotlib, which is not installed"), proc.stderr
    assert not (tmp_path / "m.png").exists()
