"""LightningDataModule that streams local text data (tokenized on the fly, packed, resumable), alone or as a mixture.

``kforge fit --data.class_path kempnerforge.data.StreamingTokenDataModule --data.init_args.source corpus/
--data.init_args.tokenizer data/tokenizers/gpt2``; or ``--data.init_args.sources`` for a weighted mixture.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from kempnerforge.data.hf_dataset import PackedTokenStream
from kempnerforge.data.mixture import mixture_probabilities
from kempnerforge.data.prepare import load_tokenizer
from kempnerforge.data.sources import check_dataset_spec, path_spec
from kempnerforge.data.stream_mixture import MixedTokenStream, StreamingSource
from kempnerforge.data.worker_signals import ignore_stop_signals
from kempnerforge.errors import UserError

# Windows the endless training stream reports as its length (about 10**12): no run reaches it.
ENDLESS_WINDOWS = 2**40


class StreamingTokenDataModule(L.LightningDataModule):
    """Train/val batches streamed from local files with ``datasets.load_dataset(..., streaming=True)``.

    Nothing is written to disk: rows are tokenized in the dataloader workers and packed into
    ``seq_len + 1``-token windows by :class:`~kempnerforge.data.hf_dataset.PackedTokenStream`. Each
    data-parallel rank (from the trainer's ``strategy.distributed_sampler_kwargs``) and each of its workers
    reads its own part of the rows; batches are ``{"input_ids", "labels"}`` of shape
    (micro_batch_size, seq_len), plus ``source`` (micro_batch_size,) int64 for a mixture. The training stream
    repeats the source without end, so every rank runs the same number of steps: bound the run with
    ``trainer.max_steps`` and validate with an integer ``trainer.val_check_interval`` (both checked before any
    process starts, :meth:`check_run`). Loaders are ``StatefulDataLoader``s and the stream's state includes its
    packing buffer (and a mixture's draw counter), so a resumed run continues with exactly the windows an
    uninterrupted one would see. Rows are read in stream order (a shuffle buffer cannot be restored exactly):
    shuffle the files beforehand, or use the eager path (:class:`~kempnerforge.data.datamodule.TokenDataModule`).

    Args:
        source: a ``.jsonl``/``.json``/``.parquet``/``.txt`` file, folder or glob, a ``save_to_disk`` folder
            (:func:`~kempnerforge.data.sources.path_spec`), or ``datasets.load_dataset`` keyword arguments for local
            data, e.g. ``{"path": "parquet", "data_files": "corpus/*.parquet"}`` (split defaults to train).
        tokenizer: local tokenizer directory (never fetched from the Hub).
        seq_len: tokens per sample.
        micro_batch_size: samples per step on each data-parallel rank.
        num_workers: dataloader worker processes per rank (0 reads in the main process).
        text_field: column holding the text.
        vocab_size: the model's vocabulary size, checked against the tokenizer's; None skips the check.
        val_source: held-out data (same forms as ``source``); None disables validation.
        val_batches: validation batches per rank per run of validation; the held-out stream repeats if
            shorter, so every rank runs the same number.
        document_masking: add ``doc_ids`` and ignore labels at EOS (:mod:`kempnerforge.data.packing`).
        sources: a weighted mixture instead of ``source`` (:class:`~kempnerforge.data.stream_mixture.StreamingSource`:
            ``name``, ``source``, ``weight``), drawn window by window (:mod:`kempnerforge.data.stream_mixture`).
        temperature: a mixture's sampling temperature (> 0): probabilities ``w^(1/T)`` normalized.
        data_seed: seed of a mixture's draws.

    Raises:
        UserError: a bad argument, a non-local or missing source, or a tokenizer larger than ``vocab_size`` (at
            construction, before any model is built), naming the field (``data.seq_len``, ``data.sources[1].source``).
    """

    def __init__(
        self,
        source: str | dict[str, Any] | None = None,
        tokenizer: str = "",
        seq_len: int = 256,
        micro_batch_size: int = 8,
        num_workers: int = 0,
        text_field: str = "text",
        vocab_size: int | None = None,
        val_source: str | dict[str, Any] | None = None,
        val_batches: int = 8,
        document_masking: bool = False,
        sources: list[StreamingSource] | None = None,
        temperature: float = 1.0,
        data_seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("val_batches", val_batches)):
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"data.{name}", f"data.{name}={value!r} must be a positive integer")
        if num_workers < 0:
            raise UserError("data.num_workers", f"data.num_workers={num_workers} must be >= 0")
        if (source is None) == (not sources):
            raise UserError("data.source", "data.source (one stream) or data.sources (a mixture): give one of them")
        if not tokenizer:
            raise UserError(
                "data.tokenizer", "data.tokenizer: a local tokenizer folder is needed to tokenize the stream"
            )
        self.specs = [_spec(source, "data.source")] if source is not None else []
        for i, src in enumerate(sources or []):
            self.specs.append(_spec(src.source, f"data.sources[{i}].source"))
        if sources:
            try:
                self.probs = mixture_probabilities([s.weight for s in sources], temperature)
            except ValueError as err:
                raise UserError("data.sources", f"data.sources: {err}") from err
            if len({s.name for s in sources}) != len(sources):
                raise UserError("data.sources", f"data.sources: names must be unique, got {[s.name for s in sources]}")
        self.val_spec = _spec(val_source, "data.val_source") if val_source is not None else None
        tok_vocab = load_tokenizer(tokenizer).vocab_size
        if vocab_size is not None and tok_vocab > vocab_size:
            raise UserError(
                "data.tokenizer",
                f"data.tokenizer={tokenizer!r} has vocab_size={tok_vocab} > the model's vocab_size={vocab_size}",
            )
        # Plain dicts only, so the checkpoint's metadata loads with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["sources"])
        self.hparams["sources"] = [asdict(s) for s in sources or []]
        self.source, self.sources, self.tokenizer, self.seq_len = source, list(sources or []), tokenizer, seq_len
        self.micro_batch_size, self.num_workers, self.text_field = micro_batch_size, num_workers, text_field
        self.val_source, self.val_batches, self.document_masking = val_source, val_batches, document_masking
        self.data_seed = data_seed

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one micro-batch on one rank: ``micro_batch_size * seq_len``."""
        return self.micro_batch_size * self.seq_len

    def dp_rank_and_size(self) -> tuple[int, int]:
        """``(rank, num_replicas)`` of this process on the data-parallel axis; ``(0, 1)`` alone."""
        from kempnerforge.data.datamodule import dp_rank_and_size

        return dp_rank_and_size(getattr(self, "trainer", None))

    def check_run(self, trainer: Any, dp_size: int, global_rank: int) -> None:
        """What the run needs from this data, before any process starts (``kforge``'s preflight): a positive
        ``trainer.max_steps`` and, with ``val_source``, an integer ``trainer.val_check_interval`` (the epoch never
        ends); on global rank 0, one row of each source read: ``text_field`` is there and a string, and every one
        of the ``dp_size * num_workers`` readers gets rows.

        Raises:
            UserError: naming ``trainer.max_steps``, ``trainer.val_check_interval``, ``data.text_field`` or
                ``data.num_workers``.
        """
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise UserError(
                "trainer.max_steps",
                f"must be a positive integer with StreamingTokenDataModule (the training stream repeats without end), "
                f"got {trainer.max_steps}",
            )
        interval = getattr(trainer, "val_check_interval", None)
        if self.val_spec is not None and not isinstance(interval, int):
            raise UserError(
                "trainer.val_check_interval",
                f"must be an integer number of steps with StreamingTokenDataModule (the epoch never ends), got {interval}",
            )
        if global_rank == 0:
            readers = dp_size * max(1, self.num_workers)
            for spec, field in self._fields():
                _check_rows(spec, self.text_field, readers, field)

    def _fields(self) -> list[tuple[dict[str, Any], str]]:
        names = ["data.source"] if self.source is not None else [f"data.sources[{i}]" for i in range(len(self.sources))]
        out = list(zip(self.specs, names, strict=True))
        return out + ([(self.val_spec, "data.val_source")] if self.val_spec is not None else [])

    def _stream(self, spec: dict[str, Any], train: bool) -> PackedTokenStream:
        rank, dp = self.dp_rank_and_size()
        return PackedTokenStream(
            spec,
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

    def _loader(self, stream: Any, workers: int) -> StatefulDataLoader:
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
            UserError: the trainer has no positive ``max_steps`` (an endless stream has no epochs to count).
        """
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return None
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise UserError(
                "trainer.max_steps",
                f"must be a positive integer with StreamingTokenDataModule (the training stream repeats without "
                f"end), got {trainer.max_steps}",
            )
        return ENDLESS_WINDOWS

    @override
    def train_dataloader(self) -> StatefulDataLoader:
        """Endless loader of packed windows: (micro_batch_size, seq_len) per key."""
        if self.sources:
            stream: Any = MixedTokenStream([self._stream(s, True) for s in self.specs], self.probs, self.data_seed)
        else:
            stream = self._stream(self.specs[0], True)
        stream.length = self._train_windows()
        return self._loader(stream, self.num_workers)

    @override
    def val_dataloader(self) -> StatefulDataLoader | list:
        """``val_batches`` batches of held-out windows per rank; ``[]`` when ``val_source`` is None."""
        return [] if self.val_spec is None else self._loader(self._stream(self.val_spec, False), 0)


def _spec(source: str | dict[str, Any], field: str) -> dict[str, Any]:
    """``source`` as a checked ``load_dataset`` spec of local files.

    Raises:
        UserError: naming ``field``: a path with no supported file, a non-local or non-matching spec.
    """
    try:
        spec = path_spec(source) if isinstance(source, str) else dict(source)
        check_dataset_spec(spec)
    except ValueError as err:
        raise UserError(field, f"{field}: {err}") from err
    return spec


def _check_rows(spec: dict[str, Any], text_field: str, readers: int, field: str) -> None:
    """The first rows of ``spec`` hold ``text_field`` as a string, and ``readers`` readers each get rows (whole
    files when the stream's shards divide among them, else every ``readers``-th row: at least ``readers`` rows).

    Raises:
        UserError: naming ``data.text_field`` or ``data.num_workers``.
    """
    from kempnerforge.data.sources import load_local_dataset

    ds = load_local_dataset(spec, streaming=True)
    rows = list(ds.take(readers))
    if not rows:
        raise UserError(field, f"{spec} holds no rows")
    if text_field not in rows[0] or not isinstance(rows[0][text_field], str):
        raise UserError(
            "data.text_field",
            f"text_field={text_field!r} is not a text column of {field} (its first row has {sorted(rows[0])})",
        )
    if ds.num_shards % readers and len(rows) < readers:
        raise UserError(
            "data.num_workers",
            f"{field} has {len(rows)} rows, fewer than its {readers} readers (data-parallel ranks x num_workers); "
            "lower data.num_workers or add data",
        )
