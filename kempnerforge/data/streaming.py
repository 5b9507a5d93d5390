"""LightningDataModule that streams a local Hugging Face dataset (tokenized on the fly, packed, resumable)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from kempnerforge.data.hf_dataset import PackedTokenStream
from kempnerforge.data.prepare import load_tokenizer
from kempnerforge.data.sources import check_dataset_spec
from kempnerforge.data.worker_signals import ignore_stop_signals

# Windows the endless training stream reports as its length (about 10**12): no run reaches it.
ENDLESS_WINDOWS = 2**40


class StreamingTokenDataModule(L.LightningDataModule):
    """Train/val batches from ``datasets.load_dataset(**source, streaming=True)`` over local files.

    Nothing is written to disk: rows are tokenized in the dataloader workers and packed into
    ``seq_len + 1``-token windows by :class:`~kempnerforge.data.hf_dataset.PackedTokenStream`. Each
    data-parallel rank (from the trainer's ``strategy.distributed_sampler_kwargs``) and each of its workers
    reads its own part of the rows; batches are ``{"input_ids", "labels"}`` of shape
    (micro_batch_size, seq_len). The training stream repeats the source without end, so every rank runs
    the same number of steps: bound the run with ``trainer.max_steps`` (the epoch never ends, so set an
    integer ``trainer.val_check_interval`` for validation). Loaders are
    ``StatefulDataLoader``s and the stream's state includes its packing buffer, so a resumed run continues
    with exactly the windows an uninterrupted one would see. Rows are read in stream order (a shuffle
    buffer cannot be restored exactly): shuffle the files beforehand, or use the eager path
    (:class:`~kempnerforge.data.datamodule.TokenDataModule` with a ``source`` spec and ``data_seed``).

    Args:
        source: ``datasets.load_dataset`` keyword arguments for local data, e.g.
            ``{"path": "parquet", "data_files": "corpus/*.parquet"}`` or
            ``{"path": "text", "data_files": "a.txt", "sample_by": "paragraph"}`` (split defaults to train).
        tokenizer: local tokenizer directory (never fetched from the Hub).
        seq_len: tokens per sample.
        micro_batch_size: samples per step on each data-parallel rank.
        num_workers: dataloader worker processes per rank (0 reads in the main process).
        text_field: column holding the text.
        vocab_size: the model's vocabulary size, checked against the tokenizer's; None skips the check.
        val_source: spec of held-out data (same form as ``source``); None disables validation.
        val_batches: validation batches per rank per run of validation; the held-out stream repeats if
            shorter, so every rank runs the same number.
        document_masking: add ``doc_ids`` and ignore labels at EOS (:mod:`kempnerforge.data.packing`).

    Raises:
        ValueError: a bad argument, a non-local spec, or a tokenizer larger than ``vocab_size``
            (at construction, before any model is built).
    """

    def __init__(
        self,
        source: dict[str, Any],
        tokenizer: str,
        seq_len: int = 256,
        micro_batch_size: int = 8,
        num_workers: int = 0,
        text_field: str = "text",
        vocab_size: int | None = None,
        val_source: dict[str, Any] | None = None,
        val_batches: int = 8,
        document_masking: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("val_batches", val_batches)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        check_dataset_spec(source)
        if val_source is not None:
            check_dataset_spec(val_source)
        tok_vocab = load_tokenizer(tokenizer).vocab_size
        if vocab_size is not None and tok_vocab > vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer!r} has vocab_size={tok_vocab} > the model's vocab_size={vocab_size}"
            )
        self.save_hyperparameters()
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.micro_batch_size, self.num_workers, self.text_field = micro_batch_size, num_workers, text_field
        self.val_source, self.val_batches, self.document_masking = val_source, val_batches, document_masking

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one micro-batch on one rank: ``micro_batch_size * seq_len``."""
        return self.micro_batch_size * self.seq_len

    def dp_rank_and_size(self) -> tuple[int, int]:
        """``(rank, num_replicas)`` of this process on the data-parallel axis; ``(0, 1)`` alone."""
        from kempnerforge.data.datamodule import dp_rank_and_size

        return dp_rank_and_size(getattr(self, "trainer", None))

    def _loader(self, source: dict[str, Any], train: bool) -> StatefulDataLoader:
        rank, dp = self.dp_rank_and_size()
        workers = self.num_workers if train else 0
        stream = PackedTokenStream(
            source,
            self.tokenizer,
            self.seq_len,
            text_field=self.text_field,
            dp_rank=rank,
            dp_size=dp,
            # Held-out data: a fixed count per rank, cycling a short source, so all ranks agree.
            repeat=True,
            max_windows=None if train else self.val_batches * self.micro_batch_size,
            document_masking=self.document_masking,
        )
        if train:
            stream.length = self._train_windows()
        return StatefulDataLoader(
            stream,
            batch_size=self.micro_batch_size,
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
            worker_init_fn=ignore_stop_signals,  # a group signal must not kill the workers first
        )

    def _train_windows(self) -> int | None:
        """The length the training stream reports: :data:`ENDLESS_WINDOWS` (None without a trainer).

        A fixed, huge length (not ``max_steps`` worth) keeps Lightning's epoch open across resumes with a
        different ``max_steps``: the epoch never ends, so an epoch-end ``iter()`` never restarts the stream.
        Validation therefore needs an integer ``trainer.val_check_interval`` (every so many steps).

        Raises:
            ValueError: the trainer has no positive ``max_steps`` (an endless stream has no epochs to count).
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return None
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise ValueError(
                f"trainer.max_steps must be a positive integer with StreamingTokenDataModule (the training "
                f"stream repeats without end), got {trainer.max_steps}"
            )
        return ENDLESS_WINDOWS

    @override
    def train_dataloader(self) -> StatefulDataLoader:
        """Endless loader of packed windows: (micro_batch_size, seq_len) per key."""
        return self._loader(self.source, train=True)

    @override
    def val_dataloader(self) -> StatefulDataLoader | list:
        """``val_batches`` batches of held-out windows per rank; ``[]`` when ``val_source`` is None."""
        return [] if self.val_source is None else self._loader(self.val_source, train=False)
