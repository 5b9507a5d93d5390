"""LightningDataModules of media-caption pairs for VLM training, with resumable data-parallel sampling.

:class:`MediaTextDataModule` holds what images and videos share (argument checks, tokenizer,
processor, train/val split, resumable loaders); :class:`ImageTextDataModule` and
:class:`~kempnerforge.data.video_datamodule.VideoTextDataModule` add only their dataset and collate.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
from typing_extensions import override

from kempnerforge.data.datamodule import ResumableLoaders
from kempnerforge.data.image_text import ImageTextCollator, ImageTextDataset
from kempnerforge.errors import UserError


class MediaTextDataModule(ResumableLoaders, abc.ABC):
    """Base of the (media, caption) datamodules: subclasses implement :meth:`open_dataset` and :meth:`make_collate`.

    The last ``ceil(val_fraction * n)`` records validate, the rest train. Each data-parallel rank
    takes ``micro_batch_size`` records per step from a :class:`ResumableDistributedSampler`
    (shuffled, seeded, ``drop_last``) in a ``StatefulDataLoader`` (:func:`resumable_loader`), so
    checkpoints carry the position inside an epoch. The encoder's image processor comes from the
    LightningModule (``image_processor()``) in :meth:`setup` unless one is set on ``processor``.

    Args: see :class:`ImageTextDataModule`.

    Raises:
        ValueError: a bad argument (at construction); a tokenizer larger than ``vocab_size`` or fewer
            records than one global batch (in :meth:`setup`, before the model is built).
    """

    def __init__(
        self,
        source: str,
        tokenizer: str | None,
        format: str,
        max_text_len: int,
        micro_batch_size: int,
        val_fraction: float,
        num_workers: int,
        data_seed: int,
        vocab_size: int | None,
    ) -> None:
        super().__init__()
        for name, value in (("max_text_len", max_text_len), ("micro_batch_size", micro_batch_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be >= 1.")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1).")
        if num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers} must be >= 0.")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"data.vocab_size={vocab_size} must be >= 1.")
        if tokenizer is None:
            raise UserError(
                "data.tokenizer",
                "required: a local tokenizer folder (with model.init_from, that folder is the default)",
            )
        self.save_hyperparameters()
        self.source, self.format, self.tokenizer_path = source, format, tokenizer
        self.max_text_len, self.micro_batch_size, self.val_fraction = max_text_len, micro_batch_size, val_fraction
        self.num_workers, self.data_seed, self.vocab_size = num_workers, data_seed, vocab_size
        self.processor = None
        self.collate: ImageTextCollator | None = None
        self.train_dataset = self.val_dataset = None

    @abc.abstractmethod
    def open_dataset(self) -> Any:
        """The whole dataset (``len`` and ``__getitem__``), opened in :meth:`setup`."""

    @abc.abstractmethod
    def make_collate(self, tokenizer: Any) -> ImageTextCollator:
        """The batch collate for this media, built in :meth:`setup` once ``processor`` is known."""

    def split(self, data: Any, start: int, stop: int) -> Any:
        """Records ``[start, stop)`` of ``data`` as a dataset (a ``Subset``; subclasses may keep their own type)."""
        return torch.utils.data.Subset(data, range(start, stop))

    @override
    def setup(self, stage: str | None = None) -> None:
        """Open the records, build tokenizer and collate, split train/val; idempotent."""
        if self.train_dataset is not None:
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        if self.vocab_size is not None and len(tokenizer) > self.vocab_size:
            raise ValueError(
                f"tokenizer {self.tokenizer_path!r} has {len(tokenizer)} tokens, more than "
                f"model.config.vocab_size={self.vocab_size}."
            )
        if self.processor is None:
            self.processor = self.trainer.lightning_module.image_processor()
        self.collate = self.make_collate(tokenizer)
        data = self.open_dataset()
        n = len(data)
        n_val = math.ceil(n * self.val_fraction)
        _, dp = self.dp_rank_and_size()
        if n - n_val < self.micro_batch_size * dp:
            raise ValueError(
                f"{self.source!r} has {n - n_val} training records, fewer than one global batch of "
                f"micro_batch_size * dp = {self.micro_batch_size} * {dp}; lower micro_batch_size or val_fraction."
            )
        self.train_dataset = self.split(data, 0, n - n_val)
        self.val_dataset = self.split(data, n - n_val, n) if n_val else None


class ImageTextDataModule(MediaTextDataModule):
    """Train/val loaders of :class:`~kempnerforge.data.image_text.ImageTextDataset` batches
    (:class:`~kempnerforge.data.image_text.ImageTextCollator`'s); split, sampling and resume as
    :class:`MediaTextDataModule`.

    Args:
        source: the dataset path (see :class:`ImageTextDataset`).
        format: ``jsonl``, ``imagefolder`` or ``parquet``.
        tokenizer: local tokenizer folder (``AutoTokenizer.from_pretrained``; no download); under ``kforge`` its
            default is ``model.init_from``'s folder (the language model's own tokenizer).
        max_text_len: text positions per sample (bos + caption tokens; eos is the last label).
        micro_batch_size: samples per step per data-parallel rank.
        val_fraction: share of records held out, in [0, 1).
        num_workers: loader processes per rank.
        data_seed: shuffling seed (epoch ``e`` uses ``data_seed + e``), separate from the model's ``init_seed``.
        image_field, text_field: record fields (see :class:`ImageTextDataset`).
        vocab_size: the model's vocabulary (linked from ``model.config.vocab_size``); the tokenizer
            must fit in it.

    Raises:
        ValueError: a bad argument (at construction); a tokenizer larger than ``vocab_size`` or fewer
            records than one global batch (in :meth:`setup`, before the model is built).
    """

    def __init__(
        self,
        source: str,
        tokenizer: str | None = None,
        format: str = "jsonl",
        max_text_len: int = 64,
        micro_batch_size: int = 4,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        data_seed: int = 0,
        image_field: str = "image",
        text_field: str = "caption",
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(
            source, tokenizer, format, max_text_len, micro_batch_size, val_fraction, num_workers, data_seed, vocab_size
        )
        self.image_field, self.text_field = image_field, text_field

    def open_dataset(self) -> ImageTextDataset:
        """All image-caption records of ``source``."""
        return ImageTextDataset(self.source, self.format, self.image_field, self.text_field)

    def make_collate(self, tokenizer: Any) -> ImageTextCollator:
        """Text ids + the processor's ``pixel_values`` (batch, 3, H, W)."""
        return ImageTextCollator(tokenizer, self.processor, self.max_text_len)
