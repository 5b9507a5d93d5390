"""benchmarks/cp_step.py runs at a tiny shape (two 2-process launches: cp=2 and dp_shard=2 at the same tokens per
step) and writes its report with both step times and their ratio."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_cp_and_dp_step_times(tmp_path):
    out = tmp_path / "cp_step.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "cp_step.py"), "--seq-len", "64", "--dim", "32", "--n-layers", "1",
           "--vocab", "512", "--steps", "4", "--warmup", "1", "--json", str(out)]  # fmt: skip
    proc = run_group(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tokens_per_step"] == 2 * 64
    for kind in ("cp", "dp"):
        assert report[kind]["steps_timed"] == 2 and report[kind]["median_step_s"] > 0
    assert report["cp_over_dp_step_time"] == report["cp"]["median_step_s"] / report["dp"]["median_step_s"]
