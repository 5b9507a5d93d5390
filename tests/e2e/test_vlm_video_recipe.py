"""Check 1 (video): `kforge fit --config configs/vlm_video.yaml` on the 3 bundled clips (decoded by PyAV in
loader workers, 2-4 frames each, padded and masked): the training loss falls by at least 30% for every
arch with only `--model.init_args.vlm.arch` changed. Few steps (10 of the recipe's 20) to stay fast."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kempnerforge.model.vlm import ARCHS
from tests.e2e.inprocess import run_kforge

pytestmark = pytest.mark.slow
pytest.importorskip("av")

REPO = Path(__file__).resolve().parents[2]
STEPS = 10


def _fit(tmp_path: Path, *overrides: str, subprocess_run: bool = False) -> tuple[dict[int, float], dict[int, float]]:
    """Run the recipe with ``overrides``: as a ``kforge`` subprocess (``subprocess_run``), else through the same
    ``kempnerforge.cli.main`` in this process (no ~13 s of imports per run); ``({step: train/loss},
    {step: data/skipped_clips})``."""
    args = [
        "fit", "--config", str(REPO / "configs" / "vlm_video.yaml"),
        *overrides, "--trainer.enable_progress_bar=false",
        "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", "--trainer.logger.init_args.name=vlm",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
    ]  # fmt: skip
    run_kforge(*args, subprocess_run=subprocess_run)
    losses, skipped = {}, {}
    for path in (tmp_path / "runs" / "vlm").rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/loss"):
                    losses[int(row["step"])] = float(row["train/loss"])
                if row.get("data/skipped_clips"):
                    skipped[int(row["step"])] = float(row["data/skipped_clips"])
    return losses, skipped


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_vlm_video_recipe_loss_falls_30_percent(arch, tmp_path):
    # The recipe's own arch runs as a real `kforge` process; the others through the same CLI in-process.
    losses, skipped = _fit(
        tmp_path,
        f"--model.init_args.vlm.arch={arch}",
        f"--trainer.max_steps={STEPS}",
        "--trainer.log_every_n_steps=1",
        subprocess_run=arch == "joint_decoder",
    )
    steps = sorted(losses)
    assert steps == list(range(STEPS)), steps
    assert skipped and max(skipped.values()) == 0  # the bundled clips all decode
    first = sum(losses[s] for s in steps[:3]) / 3
    last = sum(losses[s] for s in steps[-3:]) / 3
    print(f"{arch}: train/loss {first:.3f} -> {last:.3f} over {len(steps)} steps")
    assert last <= 0.7 * first, (first, last)


def test_a_bad_clip_is_skipped_and_logged_not_fatal(tmp_path):
    """Check 4 through the CLI: a text file named .mp4 in the csv is skipped in the loader workers, the run
    goes on, and the cumulative count is logged as data/skipped_clips at the log interval."""
    clips = REPO / "data" / "videos" / "clips"
    (tmp_path / "x.mp4").write_text("not a video\n")
    listing = tmp_path / "results.csv"
    listing.write_text(
        "videoid,contentUrl,duration,page_dir,name\n"
        f"1,{clips / '1000001.webm'},PT1S,clips,a rabbit skips\n2,x.mp4,PT1S,.,broken\n"
        f"3,{clips / '1000002.mp4'},PT2S,clips,a traveller in the snow\n"
    )
    _, skipped = _fit(
        tmp_path, f"--data.init_args.source={listing}", "--trainer.max_steps=4", "--trainer.log_every_n_steps=2"
    )
    # All 3 records form each 1-step epoch; record 2 falls back to record 3 once per step.
    assert skipped == {1: 2.0, 3: 4.0}, skipped
