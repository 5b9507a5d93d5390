"""LightningDataModule of image-caption pairs for VLM training, with resumable data-parallel sampling."""

from __future__ import annotations

import math

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from kempnerforge.data.datamodule import TokenDataModule, resumable_loader
from kempnerforge.data.image_text import ImageTextCollator, ImageTextDataset


class ImageTextDataModule(L.LightningDataModule):
    """Train/val loaders of :class:`~kempnerforge.data.image_text.ImageTextDataset` batches.

    The last ``ceil(val_fraction * n)`` records validate, the rest train. Each data-parallel rank
    takes ``micro_batch_size`` records per step from a :class:`ResumableDistributedSampler`
    (shuffled, seeded, ``drop_last``), so checkpoints carry the position inside an epoch. Images are
    processed by the encoder's image processor, taken from the LightningModule
    (``image_processor()``) in :meth:`setup` unless one is given.

    Args:
        source: the dataset path (see :class:`ImageTextDataset`).
        format: ``jsonl``, ``imagefolder`` or ``parquet``.
        tokenizer: local tokenizer folder (``AutoTokenizer.from_pretrained``; no download).
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
        tokenizer: str,
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
        super().__init__()
        for name, value in (("max_text_len", max_text_len), ("micro_batch_size", micro_batch_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be >= 1.")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1).")
        self.save_hyperparameters()
        self.source, self.format, self.tokenizer_path = source, format, tokenizer
        self.max_text_len, self.micro_batch_size, self.val_fraction = max_text_len, micro_batch_size, val_fraction
        self.num_workers, self.data_seed, self.vocab_size = num_workers, data_seed, vocab_size
        self.image_field, self.text_field = image_field, text_field
        self.processor = None
        self.collate: ImageTextCollator | None = None
        self.train_dataset = self.val_dataset = None

    dp_rank_and_size = TokenDataModule.dp_rank_and_size

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
        self.collate = ImageTextCollator(tokenizer, self.processor, self.max_text_len)
        data = ImageTextDataset(self.source, self.format, self.image_field, self.text_field)
        n = len(data)
        n_val = math.ceil(n * self.val_fraction)
        _, dp = self.dp_rank_and_size()
        if n - n_val < self.micro_batch_size * dp:
            raise ValueError(
                f"{self.source!r} has {n - n_val} training records, fewer than one global batch of "
                f"micro_batch_size * dp = {self.micro_batch_size} * {dp}; lower micro_batch_size or val_fraction."
            )
        self.train_dataset = torch.utils.data.Subset(data, range(n - n_val))
        self.val_dataset = torch.utils.data.Subset(data, range(n - n_val, n)) if n_val else None

    def _loader(self, dataset, train: bool) -> StatefulDataLoader:
        rank, dp = self.dp_rank_and_size()
        return resumable_loader(
            dataset, self.micro_batch_size, rank, dp, train, self.data_seed, self.num_workers, self.collate
        )

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled ``drop_last`` loader of VLM batches (see :class:`ImageTextCollator`)."""
        self.setup("fit")
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> StatefulDataLoader | list:
        """In-order loader over the held-out records; ``[]`` when ``val_fraction`` is 0."""
        self.setup("validate")
        return [] if self.val_dataset is None else self._loader(self.val_dataset, train=False)
