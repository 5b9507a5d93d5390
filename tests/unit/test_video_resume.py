"""Check 5: a video loader restored mid-epoch (StatefulDataLoader state_dict / load_state_dict) continues
with the same clips in the same order and the same pixels as an uninterrupted pass, with 0 and 2 workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kempnerforge.data.video_datamodule import VideoTextDataModule
from kempnerforge.model.vision import build_image_processor
from tests.vlm_tiny import GPT2, tiny_encoder

pytest.importorskip("av")

CLIPS = Path(__file__).resolve().parents[2] / "data" / "videos" / "clips"


def _datamodule(listing: Path, num_workers: int) -> VideoTextDataModule:
    dm = VideoTextDataModule(
        str(listing), str(GPT2), "jsonl", max_text_len=8, micro_batch_size=2, num_workers=num_workers,
        data_seed=3, sampling="uniform", fps=2.0, max_frames=3,
    )  # fmt: skip
    dm.processor = build_image_processor(tiny_encoder())
    return dm


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_gives_the_same_clips_and_pixels(tmp_path, num_workers):
    # 8 records over the two short clips (1 s and 2 s: different frame counts, so padding varies by batch).
    rows = [{"videoid": f"v{i}", "video": str(CLIPS / ("1000001.webm" if i % 2 else "1000002.mp4")),
             "caption": f"clip number {i}"} for i in range(8)]  # fmt: skip
    listing = tmp_path / "clips.jsonl"
    listing.write_text("".join(json.dumps(r) + "\n" for r in rows))

    reference = list(_datamodule(listing, num_workers).train_dataloader())  # 4 batches, uninterrupted
    assert len(reference) == 4

    interrupted = _datamodule(listing, num_workers).train_dataloader()
    it = iter(interrupted)
    first = next(it)
    state = interrupted.state_dict()
    del it, interrupted
    resumed = _datamodule(listing, num_workers).train_dataloader()
    resumed.load_state_dict(state)
    rest = list(resumed)

    order = [b["clip_index"].tolist() for b in reference]
    print(f"workers={num_workers}: order {order}")
    assert first["clip_index"].tolist() == order[0]
    assert [b["clip_index"].tolist() for b in rest] == order[1:]
    assert len({i for batch in order for i in batch}) == 8  # one epoch: every record once
    for got, want in zip(rest, reference[1:], strict=True):
        for key in ("pixel_values", "frame_mask", "input_ids", "labels", "text_mask"):
            assert torch.equal(got[key], want[key]), key
