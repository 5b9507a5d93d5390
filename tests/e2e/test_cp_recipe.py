"""Issue 26: `kforge fit --config configs/cp_debug.yaml --trainer.devices=2` (each sequence split over cp=2 processes)
trains on the bundled real text with the one-process losses of configs/debug.yaml, validates, and checkpoints.

Both recipes at a small shape (dim 64, 64-token sequences, 8 steps), CSV-logged every 2 steps: the cp run's
train/loss and val/loss equal the single-process run's within 1e-5 relative, and it writes its checkpoint.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from tests.procs import run_group

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _fit(config: str, devices: int, root: Path, tokens: Path) -> dict[int, dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "kempnerforge.cli", "fit", "--config", config, f"--trainer.devices={devices}",
        f"--data.data_dir={tokens}", "--data.seq_len=64", "--data.micro_batch_size=4",
        "--model.config.dim=64", "--model.config.max_seq_len=64", "--model.scheduler.warmup_steps=2",
        f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={STEPS}", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
        "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={root / 'runs'}",
        f"--trainer.callbacks.init_args.dirpath={root / 'ckpt'}",
        f"--trainer.callbacks.init_args.every_n_train_steps={STEPS}",
    ]  # fmt: skip
    proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows: dict[int, dict[str, float]] = {}
    for path in (root / "runs").rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                rows.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v != ""})
    return rows


def _metric(rows: dict[int, dict[str, float]], name: str) -> list[float]:
    return [r[name] for _, r in sorted(rows.items()) if name in r]


def test_cp_debug_recipe_equals_the_one_process_debug_recipe(tmp_path, shakespeare_tokens):
    one = _fit("configs/debug.yaml", 1, tmp_path / "one", shakespeare_tokens)
    cp = _fit("configs/cp_debug.yaml", 2, tmp_path / "cp", shakespeare_tokens)
    for name in ("train/loss", "val/loss"):
        want, got = _metric(one, name), _metric(cp, name)
        assert len(got) == len(want) >= 1, (name, got, want)
        assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) <= 1e-5, (name, got, want)
    assert _metric(cp, "train/tokens_seen") == _metric(one, "train/tokens_seen")
    assert len(_metric(cp, "train/loss")) == STEPS // 2
    assert (tmp_path / "cp" / "ckpt" / "latest").read_text().strip() == f"step={STEPS:06d}.ckpt"
