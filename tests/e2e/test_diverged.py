"""Issue 28 check 3: a diverging run (lr=1e3 on the debug recipe's model) stops with the "diverged" status (3) and
one line naming the step, and every checkpoint it left holds finite weights (NaNGuard is on by default)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kempnerforge.exit_status import DIVERGED
from tests.e2e.preempt_helpers import REPO, write_config
from tests.procs import run_group

pytestmark = pytest.mark.slow


def test_lr_1e3_exits_3_naming_the_step_and_writes_no_nonfinite_checkpoint(tmp_path, shakespeare_tokens):
    cfg = write_config(tmp_path, shakespeare_tokens, preemption=False)
    data = yaml.safe_load(cfg.read_text())
    data["trainer"].update(devices=1, max_steps=20)
    cfg.write_text(yaml.safe_dump(data))
    args = ["--model.optimizer.lr=1e3", "--model.scheduler.warmup_steps=1"]
    proc = run_group(
        [sys.executable, "-m", "kempnerforge.cli", "fit", "--config", str(cfg), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == DIVERGED, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("kforge: training diverged")]
    assert len(line) == 1 and "non-finite steps in a row, the first at step" in line[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    saved = sorted(p for p in (tmp_path / "ckpt").glob("step=*.ckpt") if (p / "COMPLETE").is_file())
    assert saved, "the run diverged before its first checkpoint: the test would prove nothing"
    for ckpt in saved:
        flat = tmp_path / f"{ckpt.name}.pt"
        dcp_to_torch_save(ckpt, flat)
        state = torch.load(flat, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if torch.is_tensor(t)), ckpt
