"""Image-caption datasets (local jsonl, imagefolder, parquet) and the collate that builds VLM batches.

Nothing is downloaded. Missing image files are found when the dataset is opened (before any model
exists) and reported together; an image that cannot be decoded raises :class:`ImageDataError`
naming the file or row when it is loaded.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from kempnerforge.training.loss import IGNORE_INDEX

#: Allowed ``format`` values of :class:`ImageTextDataset`.
IMAGE_TEXT_FORMATS: tuple[str, ...] = ("jsonl", "imagefolder", "parquet")


class ImageDataError(ValueError):
    """Image-caption data that cannot be used (missing or undecodable image, missing field)."""


@dataclass
class _Record:
    caption: str
    path: Path | None = None  # an image file
    data: bytes | None = None  # or the encoded image itself (parquet)
    where: str = ""  # for error messages


class ImageTextDataset(torch.utils.data.Dataset):
    """(image, caption) pairs. Items are ``{"image": PIL.Image (RGB), "caption": str}``.

    Formats:

    - ``jsonl``: ``source`` is a .jsonl file of ``{image_field: path, text_field: caption}``; relative
      paths are relative to the file's folder (e.g. ``shared/data/images/captions.jsonl`` with
      ``image_field="image", text_field="caption"``).
    - ``imagefolder``: ``source`` is a folder with ``metadata.jsonl`` of ``{"file_name", text_field}``
      (the Hugging Face imagefolder layout; ``text_field`` usually ``"text"``).
    - ``parquet``: ``source`` is a .parquet file or a folder of them, with an ``image_field`` column of
      ``{"bytes", "path"}`` structs (the ``datasets`` Image feature) and a ``text_field`` column. The
      encoded images are held in memory.

    Grayscale and palette images are converted to RGB.

    Raises:
        ValueError: ``format`` not in :data:`IMAGE_TEXT_FORMATS`.
        FileNotFoundError: ``source`` (or imagefolder's metadata.jsonl) does not exist.
        ImageDataError: records without the fields, image files that do not exist (all listed), or no
            record at all; at load time, an image that cannot be decoded.
    """

    def __init__(self, source: str, format: str = "jsonl", image_field: str = "image", text_field: str = "caption"):
        if format not in IMAGE_TEXT_FORMATS:
            raise ValueError(f"data.format={format!r} is not allowed; choose one of {list(IMAGE_TEXT_FORMATS)}.")
        root = Path(source)
        if not root.exists():
            raise FileNotFoundError(f"data.source={source!r} does not exist.")
        if format == "parquet":
            self.records = _parquet_records(root, image_field, text_field)
        else:
            if format == "imagefolder":
                root, image_field = root / "metadata.jsonl", "file_name"
                if not root.is_file():
                    raise FileNotFoundError(f"imagefolder {source!r} has no metadata.jsonl.")
            self.records = _jsonl_records(root, image_field, text_field)
        if not self.records:
            raise ImageDataError(f"data.source={source!r} holds no image-caption record.")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        try:
            image = Image.open(record.path if record.path is not None else io.BytesIO(record.data))
            image = image.convert("RGB")  # also forces the decode here
        except (UnidentifiedImageError, OSError) as err:
            raise ImageDataError(f"cannot decode the image of {record.where}: {err}") from err
        return {"image": image, "caption": record.caption}


def _jsonl_records(path: Path, image_field: str, text_field: str) -> list[_Record]:
    records, missing = [], []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        where = f"{path}:{line_no}"
        if image_field not in row or text_field not in row:
            raise ImageDataError(f"{where} lacks {image_field!r} or {text_field!r} (has {sorted(row)}).")
        image = Path(row[image_field])
        image = image if image.is_absolute() else path.parent / image
        if not image.is_file():
            missing.append(str(image))
        records.append(_Record(caption=str(row[text_field]), path=image, where=f"{where} ({image})"))
    if missing:
        raise ImageDataError(f"{len(missing)} image file(s) listed in {path} do not exist: {missing[:10]}")
    return records


def _parquet_records(root: Path, image_field: str, text_field: str) -> list[_Record]:
    import pyarrow.parquet as pq

    files = sorted(root.glob("*.parquet")) if root.is_dir() else [root]
    records = []
    for file in files:
        table = pq.read_table(file)
        for name in (image_field, text_field):
            if name not in table.column_names:
                raise ImageDataError(f"{file} has no column {name!r} (columns: {table.column_names}).")
        images, texts = table.column(image_field).to_pylist(), table.column(text_field).to_pylist()
        for row, (image, text) in enumerate(zip(images, texts, strict=True)):
            data = image.get("bytes") if isinstance(image, dict) else image
            if not data:
                raise ImageDataError(f"{file} row {row}: column {image_field!r} holds no image bytes.")
            records.append(_Record(caption=str(text), data=data, where=f"{file} row {row}"))
    return records


class ImageTextCollator:
    """Turn ``[{"image", "caption"}, ...]`` into a VLM batch.

    Text: ``[bos] + tokens(caption)[:max_text_len - 1] + [eos]``; ``input_ids`` are all but the last
    of those ids and ``labels`` all but the first (the next token at every position), so the
    labels never equal the current token by construction and the caption's first token is predicted
    from the image. Right-padded to the longest sample of the batch with ``pad_id``; padding has
    label -100 and ``text_mask`` False.

    Returns dict: ``input_ids``, ``labels`` (batch, text) int64; ``text_mask`` (batch, text) bool;
    ``pixel_values`` (batch, 3, H, W) fp32 from ``processor``.

    Args:
        tokenizer: a ``transformers`` tokenizer (``encode`` without special tokens is used).
        processor: the image processor matching the encoder.
        max_text_len: text positions per sample, >= 2 (includes bos; eos is the last label).
        bos_id, eos_id, pad_id: token ids (None: the tokenizer's bos / eos; pad defaults to eos).

    Raises:
        ValueError: ``max_text_len`` < 2, or the tokenizer has no bos/eos and none is given.
    """

    def __init__(self, tokenizer, processor, max_text_len: int, bos_id=None, eos_id=None, pad_id=None) -> None:
        if max_text_len < 2:
            raise ValueError(f"data.max_text_len={max_text_len} must be >= 2 (bos and one caption token).")
        self.tokenizer, self.processor, self.max_text_len = tokenizer, processor, max_text_len
        self.eos_id = eos_id if eos_id is not None else tokenizer.eos_token_id
        self.bos_id = bos_id if bos_id is not None else (tokenizer.bos_token_id or self.eos_id)
        self.pad_id = pad_id if pad_id is not None else self.eos_id
        if self.eos_id is None or self.bos_id is None:
            raise ValueError("the tokenizer has no eos/bos token; pass eos_id and bos_id.")

    def token_ids(self, caption: str) -> list[int]:
        """``[bos] + caption tokens (truncated) + [eos]``: max_text_len + 1 ids at most."""
        ids = self.tokenizer.encode(caption, add_special_tokens=False)[: self.max_text_len - 1]
        return [self.bos_id, *ids, self.eos_id]

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.text_batch([s["caption"] for s in samples])
        pixels = self.processor(images=[s["image"] for s in samples], return_tensors="pt")["pixel_values"]
        return {**batch, "pixel_values": pixels.float()}

    def text_batch(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """The text half of a batch: ``input_ids``, ``labels`` (batch, text) int64, ``text_mask`` (batch, text) bool."""
        seqs = [self.token_ids(c) for c in captions]
        width = max(len(s) for s in seqs) - 1
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        text_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, ids in enumerate(seqs):
            n = len(ids) - 1
            input_ids[i, :n] = torch.tensor(ids[:-1])
            labels[i, :n] = torch.tensor(ids[1:])
            text_mask[i, :n] = True
        return {"input_ids": input_ids, "labels": labels, "text_mask": text_mask}
