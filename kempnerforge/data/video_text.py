"""Video-caption datasets (WebVid csv, jsonl, parquet with video bytes) and the collate that pads clips.

Clips are decoded in ``__getitem__``, so in dataloader workers: only the sampled frames are
decoded (:mod:`~kempnerforge.data.video_decode`, :mod:`~kempnerforge.data.video_sampling`).
Bad media never crashes a worker and never becomes a black sample: a clip that is truncated,
undecodable or yields no frame is skipped, the item falls back to the next good clip (the same
one every time, so order and resumption stay deterministic), and the skip is counted and carried
to the batch as ``skipped_clips``.
"""

from __future__ import annotations

import copy
import csv
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kempnerforge.data.image_text import ImageTextCollator
from kempnerforge.data.video_decode import VideoDecodeError, read_frames, require_av
from kempnerforge.data.video_sampling import FrameSampling, sample_frames

#: Allowed ``format`` values of :class:`VideoTextDataset`.
VIDEO_TEXT_FORMATS: tuple[str, ...] = ("csv", "jsonl", "parquet", "hf")

#: Per format, the default (video field, text field, id field). csv is WebVid's ``results_*.csv``.
DEFAULT_FIELDS: dict[str, tuple[str, str, str]] = {
    "csv": ("contentUrl", "name", "videoid"),
    "jsonl": ("video", "caption", "videoid"),
    "parquet": ("video", "caption", "videoid"),
    "hf": ("video", "caption", "videoid"),
}


class VideoDataError(ValueError):
    """Video-caption data that cannot be used (missing field, no record)."""


class AllClipsFailedError(VideoDataError):
    """Every clip of a dataset is missing or cannot be decoded; the message names the first failures."""


@dataclass
class _Clip:
    clip_id: str
    caption: str
    path: Path | None = None  # a video file
    data: bytes | None = None  # or the encoded container itself (parquet)


class VideoTextDataset(torch.utils.data.Dataset):
    """(clip, caption) pairs; items are ``{"frames", "timestamps", "caption", "clip_id", "index", "skipped"}``.

    ``frames`` are RGB PIL images at the clip's resolution, chosen by ``sampling`` and decoded alone;
    ``timestamps`` their times in seconds; ``index`` the record actually used (``!= i`` after a
    fallback); ``skipped`` the ids of the bad clips passed over to reach it.

    Formats (fields default per format, see :data:`DEFAULT_FIELDS`; the extension is the path's):

    - ``csv``: WebVid's ``results_*.csv`` (``videoid, contentUrl, duration, page_dir, name``). The clip
      is ``contentUrl`` relative to the csv's folder; when ``contentUrl`` is a URL (real WebVid) it is
      ``<page_dir>/<videoid>.mp4`` (how WebVid downloads are stored).
    - ``jsonl``: one ``{id_field, text_field, video_field: relative or absolute path}`` per line.
    - ``parquet``: a .parquet file or a folder of them; ``video_field`` holds the container bytes
      (``binary``), a ``{"bytes", "path"}`` struct (the ``datasets`` Video/Image layout) or a path
      relative to the file. Bytes are held in memory. Without ``id_field`` the row number names the clip.
    - ``hf``: a Hugging Face dataset folder (``Dataset.save_to_disk``; a ``DatasetDict``'s ``train``
      split) with the same columns as ``parquet``; paths are relative to the folder.

    Missing files are found at open time: they are left out with a warning listing them.

    Counters (per process: each dataloader worker keeps its own): ``failures`` maps the index of each
    bad clip found to its error; ``skipped`` counts skips made while serving items.

    Args:
        source: the csv / jsonl / parquet path or the ``save_to_disk`` folder.
        format: one of :data:`VIDEO_TEXT_FORMATS`.
        sampling: which frames to keep (:class:`FrameSampling`).
        video_field, text_field, id_field: record fields (None: the format's default).

    Raises:
        ValueError: ``format`` not allowed. FileNotFoundError: ``source`` does not exist.
        ImportError: PyAV not installed (the message says ``pip install 'kempnerforge[video]'``).
        VideoDataError: records without the fields, or no record. AllClipsFailedError: every clip file
            is missing (at open) or every clip fails to decode (in ``__getitem__``).
    """

    def __init__(
        self,
        source: str,
        format: str = "csv",
        sampling: FrameSampling | None = None,
        video_field: str | None = None,
        text_field: str | None = None,
        id_field: str | None = None,
    ) -> None:
        if format not in VIDEO_TEXT_FORMATS:
            raise ValueError(f"data.format={format!r} is not allowed; choose one of {list(VIDEO_TEXT_FORMATS)}.")
        root = Path(source)
        if not root.exists():
            raise FileNotFoundError(f"data.source={source!r} does not exist.")
        require_av()
        default = DEFAULT_FIELDS[format]
        fields = (video_field or default[0], text_field or default[1], id_field or default[2])
        self.sampling = sampling or FrameSampling()
        readers = {"csv": _csv_clips, "jsonl": _jsonl_clips, "parquet": _parquet_clips, "hf": _hf_clips}
        clips = readers[format](root, *fields)
        if not clips:
            raise VideoDataError(f"data.source={source!r} holds no video-caption record.")
        missing = [c for c in clips if c.path is not None and not c.path.is_file()]
        if len(missing) == len(clips):
            raise AllClipsFailedError(
                f"none of the {len(clips)} clip file(s) of {source!r} is a file (missing, or a folder): "
                f"{[str(c.path) for c in missing[:10]]}"
            )
        if missing:
            warnings.warn(
                f"{len(missing)} of {len(clips)} clip file(s) of {source!r} are missing (or not files) and are left "
                "out (not counted in data/skipped_clips): "
                f"{[str(c.path) for c in missing[:10]]}",
                stacklevel=2,
            )
        self.clips = [c for c in clips if c.path is None or c.path.is_file()]
        self.missing = [str(c.path) for c in missing]
        self.failures: dict[int, str] = {}
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.clips)

    def subset(self, start: int, stop: int) -> VideoTextDataset:
        """Records ``[start, stop)`` as a dataset of their own: fallbacks stay inside it (train never borrows val)."""
        part = copy.copy(self)
        part.clips, part.failures, part.skipped = self.clips[start:stop], {}, 0
        return part

    def __getitem__(self, index: int) -> dict[str, Any]:
        skipped = []
        for step in range(len(self.clips)):
            i = (index + step) % len(self.clips)
            clip = self.clips[i]
            if i not in self.failures:
                try:
                    frames, times = self._decode(clip)
                except VideoDecodeError as err:
                    self.failures[i] = str(err)
                    # Once per clip and process (a worker remembers its failures), so the file is named on the console.
                    warnings.warn(f"skipping unreadable clip {clip.clip_id}: {err}", stacklevel=2)
                else:
                    self.skipped += len(skipped)
                    return {
                        "frames": frames,
                        "timestamps": times,
                        "caption": clip.caption,
                        "clip_id": clip.clip_id,
                        "index": i,
                        "skipped": skipped,
                    }
            skipped.append(clip.clip_id)
        first = [f"{self.clips[i].clip_id}: {self.failures[i]}" for i in sorted(self.failures)[:5]]
        raise AllClipsFailedError(f"every one of the {len(self.clips)} clips failed to decode; first failures: {first}")

    def _decode(self, clip: _Clip) -> tuple[list, list[float]]:
        where = f"{clip.clip_id} ({clip.path})" if clip.path is not None else f"{clip.clip_id} (bytes)"
        source = clip.path if clip.path is not None else clip.data
        frames, times = read_frames(source, lambda ts: sample_frames(ts, self.sampling), where)
        if not frames:
            raise VideoDecodeError(f"the clip {where} yielded no frame.")
        return frames, times


_FIELDS_HINT = "name the clip and caption columns with data.video_field and data.text_field."


def _require(row: dict[str, Any], where: str, *fields: str) -> None:
    lacking = [f for f in fields if row.get(f) in (None, "")]
    if lacking:
        raise VideoDataError(f"{where} lacks {lacking} (has {sorted(row)}); {_FIELDS_HINT}")


def _csv_clips(path: Path, video_field: str, text_field: str, id_field: str) -> list[_Clip]:
    clips = []
    with path.open(newline="") as f:
        for line_no, row in enumerate(csv.DictReader(f), start=2):
            where = f"{path}:{line_no}"
            _require(row, where, video_field, text_field, id_field)
            rel = row[video_field]
            if "://" in rel:  # real WebVid: a URL; the download lives at <page_dir>/<videoid>.mp4
                _require(row, where, "page_dir")
                rel = f"{row['page_dir']}/{row[id_field]}.mp4"
            clips.append(_Clip(str(row[id_field]), row[text_field], path=_resolve(path, rel)))
    return clips


def _jsonl_clips(path: Path, video_field: str, text_field: str, id_field: str) -> list[_Clip]:
    clips = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row, where = json.loads(line), f"{path}:{line_no}"
        _require(row, where, video_field, text_field)
        clip_id = str(row.get(id_field, f"line {line_no}"))
        clips.append(_Clip(clip_id, str(row[text_field]), path=_resolve(path, row[video_field])))
    return clips


def _parquet_clips(root: Path, video_field: str, text_field: str, id_field: str) -> list[_Clip]:
    import pyarrow.parquet as pq

    clips = []
    for file in sorted(root.glob("*.parquet")) if root.is_dir() else [root]:
        clips += _table_clips(pq.read_table(file), file.parent, str(file), video_field, text_field, id_field)
    return clips


def _hf_clips(root: Path, video_field: str, text_field: str, id_field: str) -> list[_Clip]:
    import datasets

    try:
        data = datasets.load_from_disk(str(root))
    except FileNotFoundError as err:
        raise VideoDataError(
            f"data.source={str(root)!r} is not a datasets save_to_disk folder, which data.format='hf' reads "
            f"({err}); for .parquet files use data.format='parquet'."
        ) from err
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise VideoDataError(f"{root} is a DatasetDict without a 'train' split (splits: {list(data)}).")
        data = data["train"]
    # The Arrow table as saved (no feature decoding): bytes or paths stay as they are.
    return _table_clips(data.data.table, root, str(root), video_field, text_field, id_field)


def _table_clips(table, base: Path, where: str, video_field: str, text_field: str, id_field: str) -> list[_Clip]:
    """Rows of an Arrow table (from ``where``): ``video_field`` bytes, a ``{"bytes", "path"}`` struct or a path
    (relative to the folder ``base``); the clip is named by ``id_field`` when present, else by its row."""
    for column in (video_field, text_field):
        if column not in table.column_names:
            raise VideoDataError(f"{where} has no column {column!r} (columns: {table.column_names}); {_FIELDS_HINT}")
    videos, texts = table.column(video_field).to_pylist(), table.column(text_field).to_pylist()
    ids = table.column(id_field).to_pylist() if id_field in table.column_names else None
    clips = []
    for row, (video, text) in enumerate(zip(videos, texts, strict=True)):
        clip_id = str(ids[row]) if ids is not None else f"{Path(where).name} row {row}"
        if isinstance(video, dict):  # datasets' {"bytes", "path"} struct
            video = video.get("bytes") or video.get("path")
        if isinstance(video, bytes) and video:
            clips.append(_Clip(clip_id, str(text), data=video))
        elif isinstance(video, str) and video:
            clips.append(_Clip(clip_id, str(text), path=base / video))
        else:
            raise VideoDataError(f"{where} row {row}: column {video_field!r} holds neither video bytes nor a path.")
    return clips


def _resolve(listing: Path, rel: str) -> Path:
    """A path from a listing file, relative to that file's folder unless absolute."""
    p = Path(rel)
    return p if p.is_absolute() else listing.parent / p


class VideoTextCollator(ImageTextCollator):
    """Turn :class:`VideoTextDataset` items into a video-VLM batch, clips padded to the longest.

    The text half is :meth:`ImageTextCollator.text_batch` (same ids, labels and mask as images).
    Every frame of the batch goes through ``processor`` in one call (resized to the encoder's size).

    Returns dict: ``input_ids``, ``labels`` (batch, text) int64; ``text_mask`` (batch, text) bool;
    ``pixel_values`` (batch, F_max, 3, H, W) fp32, zero at padded frames; ``frame_mask``
    (batch, F_max) bool, True at real frames (a prefix of each row); ``real_frames`` int, their
    number (a Python int, so the model knows the layout without reading the mask back from the
    device); ``skipped_clips`` 0-dim int64,
    the bad clips skipped while building this batch; ``clip_index`` (batch,) int64, the records used.

    Args and raises: as :class:`ImageTextCollator`.
    """

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.text_batch([s["caption"] for s in samples])
        counts = [len(s["frames"]) for s in samples]
        flat = [frame for s in samples for frame in s["frames"]]
        pixels = self.processor(images=flat, return_tensors="pt")["pixel_values"].float()  # (sum F, 3, H, W)
        pixel_values = pixels.new_zeros(len(samples), max(counts), *pixels.shape[1:])
        frame_mask = torch.zeros(len(samples), max(counts), dtype=torch.bool)
        for i, clip in enumerate(pixels.split(counts)):
            pixel_values[i, : len(clip)] = clip
            frame_mask[i, : len(clip)] = True
        return {
            **batch,
            "pixel_values": pixel_values,
            "frame_mask": frame_mask,
            "real_frames": sum(counts),
            "skipped_clips": torch.tensor(sum(len(s["skipped"]) for s in samples), dtype=torch.long),
            "clip_index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
        }
