"""Check 5 of the pipeline issue: `kforge fit --config configs/pp_debug.yaml --trainer.devices=2` trains on
the bundled real text (two pipeline stages, 1F1B): the loss falls, validation runs, a checkpoint is written."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from tests.procs import run_group

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_pp_recipe_trains_on_two_processes(tmp_path, shakespeare_tokens):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "kempnerforge.cli", "fit", "--config", "configs/pp_debug.yaml", "--trainer.devices=2",
        f"--data.data_dir={shakespeare_tokens}", "--data.seq_len=64", "--data.micro_batch_size=4",
        "--model.config.dim=64", "--model.config.max_seq_len=64", "--model.scheduler.warmup_steps=2",
        "--trainer.max_steps=10", "--trainer.val_check_interval=10", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
        "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}", "--trainer.callbacks.init_args.every_n_train_steps=10",
    ]  # fmt: skip
    proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "pp=2 x dp_replicate=1 x dp_shard=1" in proc.stdout + proc.stderr
    rows: dict[int, dict[str, str]] = {}
    for path in (tmp_path / "runs").rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
    losses = [float(r["train/loss"]) for _, r in sorted(rows.items()) if "train/loss" in r]
    assert len(losses) == 5 and losses[0] > 10.0  # ~ln(50257) at init
    assert losses[-1] < losses[0] - 0.5, losses
    val = [float(r["val/loss"]) for r in rows.values() if "val/loss" in r]
    assert len(val) == 1 and val[0] < losses[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step=000010.ckpt"
