"""HealthCheck on 2 gloo ranks: a sick device stops both ranks with one complete checkpoint; a stalled rank
makes the liveness all-reduce raise within its timeout instead of hanging. MFUMonitor's degrees under TP."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.distributed.launch import launch

SCRIPT = Path(__file__).resolve().parent / "health_script.py"

pytestmark = pytest.mark.distributed


def test_sick_rank_stops_all_ranks_with_a_checkpoint(tmp_path, shakespeare_tokens):
    out = tmp_path / "rec.json"
    launch(2, SCRIPT, ["--data", str(shakespeare_tokens), "--out", str(out), "--mode", "sick", "--tp", "2"])
    rec = json.loads(out.read_text())
    assert rec["global_step"] == 2
    assert rec["failure"] == {"step": 2, "ranks": [1], "reason": ""}  # rank 0 was healthy; it learns rank 1's state
    ckpt = Path(rec["checkpoint"])
    assert ckpt.name == "health-step=000002.ckpt" and (ckpt / ".metadata").is_file()  # a complete DCP save
    written = sorted(p.name for p in ckpt.glob("*.distcp"))  # both ranks wrote (two files each: WRITER_THREADS)
    assert written == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    # MFUMonitor under tp=2: one data shard, so per-device throughput is half the global figure.
    assert rec["dp"] == 1 and rec["non_dp"] == 2
    assert rec["last"]["tokens_per_s_per_device"] == pytest.approx(rec["last"]["tokens_per_s"] / 2)


def test_stalled_rank_times_out_instead_of_hanging(tmp_path, shakespeare_tokens):
    out = tmp_path / "rec.json"
    args = ["--data", str(shakespeare_tokens), "--out", str(out), "--mode", "stalled"]
    start = time.perf_counter()
    proc = launch(2, SCRIPT, args, timeout=180, check=False)
    wall = time.perf_counter() - start
    assert proc.returncode != 0 and not out.exists()
    assert "liveness all-reduce did not complete within 2.0 s" in proc.stdout + proc.stderr
    assert wall < 120, wall  # rank 1 sleeps 30 s; the process-group timeout would be 30 minutes
