"""Check 8 of the MoE issue: `kforge fit --config configs/moe_debug.yaml` on the bundled real text: the
loss falls, the per-layer expert-load metrics are logged, and a resumed run repeats the losses of an
uninterrupted one exactly."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from tests.procs import run_group

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _fit(tmp_path: Path, tokens: Path, name: str, steps: int, *extra: str) -> dict[int, dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "kempnerforge.cli", "fit", "--config", "configs/moe_debug.yaml",
        f"--data.data_dir={tokens}", "--data.seq_len=64", "--data.micro_batch_size=4",
        "--model.config.dim=64", "--model.config.max_seq_len=64", "--model.scheduler.warmup_steps=2",
        "--model.scheduler.total_steps=12",
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=100", "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false",
        "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", f"--trainer.logger.init_args.name={name}",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / ('ckpt_' + name)}",
        "--trainer.callbacks.init_args.every_n_train_steps=6", *extra,
    ]  # fmt: skip
    proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows: dict[int, dict[str, str]] = {}
    for path in sorted((tmp_path / "runs" / name).rglob("metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                step = int(row["step"])
                rows.setdefault(step, {}).update({k: v for k, v in row.items() if v != ""})
    return rows


def test_moe_recipe_trains_logs_expert_load_and_resumes_identically(tmp_path, shakespeare_tokens):
    full = _fit(tmp_path, shakespeare_tokens, "full", 12)
    losses = {s: float(r["train/loss"]) for s, r in full.items() if "train/loss" in r}
    steps = sorted(losses)
    assert len(steps) == 6  # logged every 2 steps
    first, last = losses[steps[0]], losses[steps[-1]]
    assert last < first - 0.5, losses
    logged = set().union(*full.values())
    for layer in ("layers.1.moe", "layers.3.moe"):
        for stat in ("load_max_ratio", "load_min_ratio", "load_entropy", "dropped_frac", "lb_loss", "z_loss",
                     "bias_range"):  # fmt: skip
            assert f"moe/{layer}/{stat}" in logged, (layer, stat, sorted(logged))
    assert "train/moe_aux_loss" in logged
    assert not any(k.startswith("moe/layers.0.") for k in logged)  # moe_frequency=2: block 0 is dense
    bias_range = [float(r["moe/layers.1.moe/bias_range"]) for r in full.values() if "moe/layers.1.moe/bias_range" in r]
    assert max(bias_range) > 0  # the aux-loss-free bias moved

    ckpt = tmp_path / "ckpt_full" / "step=000006.ckpt"
    assert ckpt.is_dir()
    resumed = _fit(tmp_path, shakespeare_tokens, "resumed", 12, f"--ckpt_path={ckpt}")
    again = {s: float(r["train/loss"]) for s, r in resumed.items() if "train/loss" in r}
    assert sorted(again) == [s for s in steps if s >= 6]
    for s in again:
        assert again[s] == losses[s], (s, again[s], losses[s])
