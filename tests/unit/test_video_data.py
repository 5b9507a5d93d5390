"""Video-caption datasets and batches: the three layouts agree, clips are padded and masked, bad media
is skipped and counted (check 4), and the datamodule refuses bad arguments naming the field."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from kempnerforge.data.image_text import ImageTextCollator
from kempnerforge.data.video_datamodule import VideoTextDataModule
from kempnerforge.data.video_sampling import FrameSampling
from kempnerforge.data.video_text import AllClipsFailedError, VideoDataError, VideoTextCollator, VideoTextDataset
from kempnerforge.model.vision import build_image_processor
from tests.vlm_tiny import GPT2, tiny_encoder

pytest.importorskip("av")

REPO = Path(__file__).resolve().parents[2]
VIDEOS = REPO / "data" / "videos"  # bundled copy of ../shared/data/videos
VIDEO_PARQUET = REPO / "data" / "hf" / "video_text" / "train.parquet"
FIRST_LAST = FrameSampling("fixed_count", num_frames=2, max_frames=4)  # cheap: 2 frames per clip


def collator(max_text_len: int = 16) -> VideoTextCollator:
    return VideoTextCollator(AutoTokenizer.from_pretrained(GPT2), build_image_processor(tiny_encoder()), max_text_len)


def test_webvid_csv_jsonl_parquet_and_hf_folder_give_the_same_clips(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    datasets.Dataset(pq.read_table(VIDEO_PARQUET)).save_to_disk(str(tmp_path / "hf"))  # no HF cache written
    sets = [
        VideoTextDataset(str(VIDEOS / "results.csv"), "csv", FIRST_LAST),
        VideoTextDataset(str(VIDEOS / "captions.jsonl"), "jsonl", FIRST_LAST),
        VideoTextDataset(str(VIDEO_PARQUET), "parquet", FIRST_LAST),
        VideoTextDataset(str(tmp_path / "hf"), "hf", FIRST_LAST),
    ]
    csv_items = [sets[0][i] for i in range(3)]
    assert [x["clip_id"] for x in csv_items] == ["1000001", "1000002", "1000003"]
    assert [x["frames"][0].size for x in csv_items] == [(1280, 720), (854, 480), (1280, 720)]
    assert [round(x["timestamps"][-1], 3) for x in csv_items] == [0.958, 1.958, 29.961]
    for other in sets[1:]:
        assert len(other) == 3
        for i, ref in enumerate(csv_items):
            item = other[i]
            assert (item["clip_id"], item["timestamps"], item["skipped"]) == (ref["clip_id"], ref["timestamps"], [])
            assert item["caption"][:20] == ref["caption"][:20]  # jsonl/parquet captions are the csv's
            for a, b in zip(item["frames"], ref["frames"], strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_collator_pads_clips_to_the_longest_and_reuses_the_text_batch():
    data = VideoTextDataset(str(VIDEOS / "captions.jsonl"), "jsonl", FIRST_LAST)
    items = [data[0], data[1]]
    items[0] = {**items[0], "frames": items[0]["frames"][:1]}  # a 1-frame clip next to a 2-frame one
    collate = collator()
    batch = collate(items)
    assert batch["pixel_values"].shape == (2, 2, 3, 32, 32) and batch["pixel_values"].dtype == torch.float32
    assert batch["frame_mask"].tolist() == [[True, False], [True, True]]
    assert (batch["pixel_values"][0, 1] == 0).all()  # the padded frame
    assert batch["skipped_clips"].ndim == 0 and batch["skipped_clips"].item() == 0
    assert batch["clip_index"].tolist() == [0, 1]
    text = ImageTextCollator.text_batch(collate, [s["caption"] for s in items])
    for key in ("input_ids", "labels", "text_mask"):
        assert torch.equal(batch[key], text[key])
    alone = collate.processor(images=items[1]["frames"], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(batch["pixel_values"][1], alone.float(), rtol=0, atol=0)


def _bad_media_listing(tmp_path: Path) -> Path:
    """good 1000001, a truncated copy of 1000003, a text file named .mp4, good 1000002, a missing file."""
    clips = tmp_path / "clips"
    clips.mkdir()
    shutil.copy(VIDEOS / "clips" / "1000001.webm", clips / "good1.webm")
    shutil.copy(VIDEOS / "clips" / "1000002.mp4", clips / "good2.mp4")
    (clips / "cut.webm").write_bytes((VIDEOS / "clips" / "1000003.webm").read_bytes()[:400_000])
    (clips / "notes.mp4").write_text("not a video\n" * 100)
    rows = [("good1", "good1.webm"), ("cut", "cut.webm"), ("notes", "notes.mp4"), ("good2", "good2.mp4")]
    rows.append(("gone", "gone.mp4"))
    listing = tmp_path / "clips.jsonl"
    listing.write_text("".join(json.dumps({"videoid": i, "video": f"clips/{p}", "caption": i}) + "\n" for i, p in rows))
    return listing


def test_bad_clips_are_skipped_counted_and_never_black(tmp_path):
    listing = _bad_media_listing(tmp_path)
    with pytest.warns(UserWarning, match="1 of 5 clip file\\(s\\).*gone.mp4"):
        data = VideoTextDataset(str(listing), "jsonl", FIRST_LAST)
    assert len(data) == 4 and data.missing == [str(tmp_path / "clips" / "gone.mp4")]
    items = [data[i] for i in range(4)]
    # Fallback is deterministic: the next good clip, with the bad ones it passed over.
    assert [(x["clip_id"], x["skipped"]) for x in items] == [
        ("good1", []),
        ("good2", ["cut", "notes"]),
        ("good2", ["notes"]),
        ("good2", []),
    ]
    assert sorted(data.failures) == [1, 2] and data.skipped == 3
    assert "truncated" in data.failures[1] and "cannot open" in data.failures[2]
    batch = collator()(items)
    assert batch["skipped_clips"].item() == 3
    assert batch["frame_mask"].all() and (batch["pixel_values"].flatten(2).abs().amax(-1) > 0).all()  # no black frame


def test_bad_clips_do_not_crash_two_workers(tmp_path):
    listing = _bad_media_listing(tmp_path)
    dm = VideoTextDataModule(
        str(listing), str(GPT2), "jsonl", max_text_len=8, micro_batch_size=2, num_workers=2,
        sampling="fixed_count", num_frames=2, max_frames=2,
    )  # fmt: skip
    dm.processor = build_image_processor(tiny_encoder())
    with pytest.warns(UserWarning, match="gone.mp4"):
        loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == 2
    seen = sorted(i for b in batches for i in b["clip_index"].tolist())
    assert set(seen) <= {0, 3}  # only good clips reach a batch
    assert sum(int(b["skipped_clips"]) for b in batches) == 3  # items 1, 2 skip 2 and 1 bad clips


def test_only_bad_clips_raise_naming_them(tmp_path):
    (tmp_path / "notes.mp4").write_text("not a video")
    (tmp_path / "cut.webm").write_bytes((VIDEOS / "clips" / "1000001.webm").read_bytes()[:40_000])
    (tmp_path / "all_bad.csv").write_text(
        "videoid,contentUrl,duration,page_dir,name\nn1,notes.mp4,PT1S,.,a\nc1,cut.webm,PT1S,.,b\n"
    )
    data = VideoTextDataset(str(tmp_path / "all_bad.csv"), "csv", FIRST_LAST)
    with pytest.raises(AllClipsFailedError, match="every one of the 2 clips failed") as err:
        data[0]
    assert "n1: cannot open the clip n1" in str(err.value) and "c1: the clip c1" in str(err.value)
    (tmp_path / "missing.jsonl").write_text('{"video": "a.mp4", "caption": "x"}\n{"video": "b.webm", "caption": "y"}\n')
    with pytest.raises(AllClipsFailedError, match="none of the 2 clip file\\(s\\).*a.mp4.*b.webm"):
        VideoTextDataset(str(tmp_path / "missing.jsonl"), "jsonl")
    (tmp_path / "nofield.jsonl").write_text('{"path": "a.mp4", "caption": "x"}\n')
    with pytest.raises(VideoDataError, match="lacks \\['video'\\]"):
        VideoTextDataset(str(tmp_path / "nofield.jsonl"), "jsonl")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"format": "mkv"}, "data.format='mkv' is not allowed; choose one of \\['csv', 'jsonl', 'parquet', 'hf'\\]"),
        ({"sampling": "random"}, "data.sampling='random' is not registered; choose one of \\['fixed_count', 'uniform'"),
        ({"fps": 0}, "data.fps=0 must be a finite number > 0"),
        ({"min_frames": 5, "max_frames": 4}, "data.min_frames=5 must be <= data.max_frames=4"),
        ({"num_frames": 9}, "data.num_frames=9 must be <= data.max_frames=8"),
        ({"max_text_len": 0}, "data.max_text_len=0 must be >= 1"),
        ({"micro_batch_size": 0}, "data.micro_batch_size=0 must be >= 1"),
        ({"val_fraction": 1.0}, "data.val_fraction=1.0 must be in \\[0, 1\\)"),
        ({"num_workers": -1}, "data.num_workers=-1 must be >= 0"),
    ],
)
def test_datamodule_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoTextDataModule(str(VIDEOS / "results.csv"), str(GPT2), **kwargs)


def test_datamodule_without_pyav_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=r"pip install 'kempnerforge\[video\]'"):
        VideoTextDataModule(str(VIDEOS / "results.csv"), str(GPT2))


def test_datamodule_exposes_lengths_and_keeps_fallbacks_inside_a_split():
    dm = VideoTextDataModule(
        str(VIDEOS / "results.csv"), str(GPT2), max_text_len=24, micro_batch_size=1, val_fraction=0.3,
        sampling="uniform", fps=2.0, max_frames=3,
    )  # fmt: skip
    assert (dm.max_frames, dm.max_text_len) == (3, 24)
    dm.processor = build_image_processor(tiny_encoder())
    dm.setup("fit")
    assert [c.clip_id for c in dm.train_dataset.clips] == ["1000001", "1000002"]
    assert [c.clip_id for c in dm.val_dataset.clips] == ["1000003"]
    batch = next(iter(dm.val_dataloader()))
    assert batch["pixel_values"].shape == (1, 3, 3, 32, 32) and batch["frame_mask"].all()


def test_wrong_columns_and_wrong_format_name_the_fields():
    with pytest.raises(VideoDataError, match=r"lacks \['url'\].*data.video_field and data.text_field"):
        VideoTextDataset(str(VIDEOS / "results.csv"), "csv", FIRST_LAST, video_field="url")
    with pytest.raises(VideoDataError, match=r"has no column 'clip'.*data.video_field"):
        VideoTextDataset(str(VIDEO_PARQUET), "parquet", FIRST_LAST, video_field="clip")
    with pytest.raises(VideoDataError, match=r"not a datasets save_to_disk folder.*use data.format='parquet'"):
        VideoTextDataset(str(VIDEO_PARQUET.parent), "hf", FIRST_LAST)
