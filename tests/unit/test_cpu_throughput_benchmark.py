"""benchmarks/cpu_throughput.py finishes at a tiny shape for the step counts people pass (it once crashed on
``--steps 10 --warmup 2``: kforge's start-to-start meter records one closing iteration more than the plain loop)
and writes its JSON, with kforge's losses equal to the plain loop's at every measured step."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2", "--vocab", "512", "--seq-len", "16",
        "--batch-size", "2", "--only", "a,b", "--peak-n", "64"]  # fmt: skip


@pytest.mark.parametrize("counts", [["--steps", "4", "--warmup", "1"]], ids=["4+1"])  # one launch: ~25 s each
def test_tiny_run_writes_its_json_with_equal_losses(tmp_path, counts):
    out = tmp_path / "ct.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "cpu_throughput.py"), *TINY, *counts, "--json", str(out)]
    proc = run_group(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    steps = int(counts[1])
    assert result["steps"] == steps
    for key in ("a", "b"):
        run = result["trainers"][key]["runs"][0]
        assert len(run["losses"]) == result["warmup"] + steps
    assert result["losses_equal_1e-5"] is True
