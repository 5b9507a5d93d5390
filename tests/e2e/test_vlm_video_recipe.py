"""Check 1 (video): `kforge fit --config configs/vlm_video.yaml` on the 3 bundled clips (decoded by PyAV in
loader workers, 2-4 frames each, padded and masked): the training loss falls by at least 30% for every
arch with only `--model.init_args.vlm.arch` changed. Few steps (10 of the recipe's 20) to stay fast."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kempnerforge.model.vlm import ARCHS

pytestmark = pytest.mark.slow
pytest.importorskip("av")

REPO = Path(__file__).resolve().parents[2]
STEPS = 10


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_vlm_video_recipe_loss_falls_30_percent(arch, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "kempnerforge.cli", "fit", "--config", str(REPO / "configs" / "vlm_video.yaml"),
        f"--model.init_args.vlm.arch={arch}", f"--trainer.max_steps={STEPS}",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
        "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", "--trainer.logger.init_args.name=vlm",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    losses, skipped = {}, []
    for path in (tmp_path / "runs" / "vlm").rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    losses[int(row["step"])] = float(row["train/loss"])
                if row.get("data/skipped_clips"):
                    skipped.append(float(row["data/skipped_clips"]))
    steps = sorted(losses)
    assert steps == list(range(STEPS)), steps
    assert skipped and max(skipped) == 0  # the bundled clips all decode
    first = sum(losses[s] for s in steps[:3]) / 3
    last = sum(losses[s] for s in steps[-3:]) / 3
    print(f"{arch}: train/loss {first:.3f} -> {last:.3f} over {len(steps)} steps")
    assert last <= 0.7 * first, (first, last)
