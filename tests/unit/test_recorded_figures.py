"""The machine-measured figures the docs quote are the ones the benchmark scripts recorded.

Timings cannot be re-measured in the suite (they depend on the machine and its load), so the benchmarks write their
results to ``benchmarks/results/*.json`` and the docs quote them; these tests recompute every quoted figure from
that JSON with the docs' own rounding, so a table edited by hand, or a JSON refreshed without its table, fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def _doc(name: str) -> str:
    return " ".join((REPO / "docs" / name).read_text().split())


def _checkpoint_rows() -> list[dict]:
    return json.loads((RESULTS / "checkpoint_io_2core.json").read_text())["results"]


def _stall_over_copy(row: dict) -> float:
    return row["async_stall_median_s"] / row["copy_floor_s"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_checkpoint_speed_table_is_the_recorded_run(nproc):
    (r,) = [row for row in _checkpoint_rows() if row["nproc"] == nproc]
    assert r["restored_equal"]
    row = (
        f"| {nproc} | {r['disk_write_gb_s']:.2f} / {r['disk_read_gb_s']:.2f} | {r['save_gb_s']:.2f} "
        f"({r['save_of_disk']:.0%}) | {r['save_plain_gb_s']:.2f} | {r['restore_gb_s']:.2f} ({r['restore_of_disk']:.0%}) "
        f"| {r['restore_plain_gb_s']:.2f} | {r['async_stall_median_s'] * 1e3:.0f} ms, {r['copy_floor_s'] * 1e3:.0f} ms, "
        f"{r['step_s']:.1f} s ({r['async_stall_of_step']:.1%}) |"
    )
    assert row in _doc("how-to/checkpoints.md")
    # the ratios are the JSON's own: save / disk write, restore / disk read
    assert r["save_of_disk"] == pytest.approx(r["save_gb_s"] / r["disk_write_gb_s"], abs=0.01)
    assert r["restore_of_disk"] == pytest.approx(r["restore_gb_s"] / r["disk_read_gb_s"], abs=0.01)


def test_checkpoint_summaries_quote_the_recorded_run():
    one, two = sorted(_checkpoint_rows(), key=lambda row: row["nproc"])
    summary = (
        f"save {one['save_of_disk']:.0%} / {two['save_of_disk']:.0%} of the disk, restore {one['restore_of_disk']:.0%} "
        f"/ {two['restore_of_disk']:.0%}, async stall {_stall_over_copy(one):.1f}x / {_stall_over_copy(two):.1f}x the host copy"
    )
    assert summary in _doc("performance/index.md")
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (
        f"save {one['save_of_disk']:.0%} of its fsync-ed write bandwidth, restore {one['restore_of_disk']:.0%} of its read"
        in readme
    )
    prose = f"{_stall_over_copy(one):.1f}x the plain host copy on one process, {_stall_over_copy(two):.1f}x on two"
    assert prose in _doc("how-to/checkpoints.md")


def test_prepare_data_ratios_are_the_recorded_run():
    best = json.loads((RESULTS / "data_io_2core.json").read_text())["tokenize"]["best"]
    rate = {name: run["tokens_per_s"] for name, run in best.items()}
    two_over_one = rate["prepare@2"] / rate["prepare@1"]
    over_raw = rate["prepare@2"] / rate["encode_batch@2"]
    over_map = rate["prepare@2"] / rate["datasets_map@2"]
    prose = f"Two workers run {two_over_one:.2f}x one"
    assert prose in _doc("how-to/data.md")
    assert f"{over_raw:.2f}x the tokenizer's raw `encode_batch` on two threads and {over_map:.2f}x" in _doc(
        "how-to/data.md"
    )
    summary = f"2 workers {two_over_one:.2f}x one, {over_raw:.2f}x raw `encode_batch` on 2 threads, {over_map:.2f}x"
    assert summary in _doc("performance/index.md")
    # the targets, on the recorded run
    assert two_over_one >= 1.8 and over_raw >= 0.9 and over_map >= 1.0


def test_every_results_file_a_doc_names_exists():
    names = set()
    for page in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        names |= set(re.findall(r"`(?:benchmarks/results/)?(\w[\w.]*_2core\.json|\w+\.json)`", page.read_text()))
    recorded = {p.name for p in RESULTS.glob("*.json")}
    quoted = {n for n in names if n in recorded or n.endswith("_2core.json")}
    assert quoted and quoted <= recorded, quoted - recorded
