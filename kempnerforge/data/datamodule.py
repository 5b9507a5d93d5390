"""LightningDataModule over memmap token shards, with resumable data-parallel sampling."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from typing_extensions import override

from kempnerforge.data.memmap import MemmapTokenDataset
from kempnerforge.data.prepare import METADATA_FILE, is_prepare_artifact
from kempnerforge.data.prepare import prepare_data as _prepare_shards
from kempnerforge.data.sources import source_fingerprint
from kempnerforge.data.worker_signals import ignore_stop_signals
from kempnerforge.errors import UserError


class ResumableDistributedSampler(StatefulDistributedSampler):
    """``DistributedSampler`` whose ``state_dict`` holds the epoch as well as the position, and which owns its epoch.

    Rank ``r`` of ``R`` takes indices ``perm[r::R]`` of one seeded permutation per epoch
    (``torch.utils.data.DistributedSampler``), so a step's global batch is the same set of windows
    at any data-parallel size with the same global batch size.

    The epoch is the sampler's own: an iteration after one that handed out the whole epoch is the next epoch, and
    ``set_epoch`` only moves it forward. Lightning's epoch counter is not reliable after a restore at an epoch's end: it
    creates the iterator before it calls ``set_epoch`` (a loader with workers draws indices at once), and after
    such a restart its counter lags the data by one epoch, so obeying a ``set_epoch`` that goes back replayed an
    epoch on the next resume. A state saved after an epoch's last index resumes at the start of the next epoch.

    Args (besides ``DistributedSampler``'s):
        loader_batch_size: the batch size of a loader that drops its last partial batch (training): the epoch is
            finished once every full batch is handed out, so a state saved after the last full batch resumes at
            the next epoch instead of handing out the remainder, which the loader drops. None: every index counts.
    """

    def __init__(self, *args: Any, loader_batch_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loader_batch_size = loader_batch_size

    @property
    def epoch_end(self) -> int:
        """Indices handed out when this rank's epoch is finished: ``num_samples`` less the dropped partial batch."""
        if self.loader_batch_size is None:
            return self.num_samples
        return self.num_samples - self.num_samples % self.loader_batch_size

    def __iter__(self) -> Iterator[int]:
        if self.next_yielded is None and self.yielded >= self.epoch_end:
            # The last iteration handed out the whole epoch (whether or not it was run to StopIteration) and nothing
            # moved the epoch since: this one is the next epoch.
            self.epoch, self.yielded = self.epoch + 1, 0
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        """``{"yielded": indices handed out this epoch, "epoch": int}``."""
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores epoch and position; takes effect at the next ``iter()``."""
        super().load_state_dict(state_dict)
        self.epoch = int(state_dict.get("epoch", self.epoch))
        if self.next_yielded is not None and self.next_yielded >= self.epoch_end:
            # The saved epoch was finished. Lightning (which counts the epoch finished too) calls set_epoch(epoch + 1)
            # only after a loader with workers has drawn this iteration's indices: the remainder, to be dropped.
            self.next_yielded, self.epoch = None, self.epoch + 1

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` when it is later than the sampler's own (a restored position does not carry over);
        an earlier or equal one is ignored (see the class docstring)."""
        if epoch > self.epoch:
            self.next_yielded, self.yielded = None, 0
            super().set_epoch(epoch)


class ResumableLoaders(L.LightningDataModule):
    """The train / val loaders every kempnerforge datamodule shares: :func:`resumable_loader` over this
    process's data-parallel share (:func:`dp_rank_and_size`).

    A subclass sets, in ``setup``: ``train_dataset``, ``val_dataset`` (None = no validation), and the ints
    ``micro_batch_size``, ``data_seed``, ``num_workers``; optionally ``collate`` (a ``collate_fn``, None = the
    default collation). The training loader is shuffled with ``data_seed`` and drops the last partial batch; the
    validation loader keeps order (see :func:`resumable_loader`).
    """

    collate: Any = None

    def dp_rank_and_size(self) -> tuple[int, int]:
        """``(rank, num_replicas)`` of this process on the data-parallel axis; ``(0, 1)`` alone."""
        return dp_rank_and_size(getattr(self, "trainer", None))

    def _loader(self, dataset: Any, train: bool) -> StatefulDataLoader:
        rank, dp = self.dp_rank_and_size()
        return resumable_loader(
            dataset, self.micro_batch_size, rank, dp, train, self.data_seed, self.num_workers, self.collate
        )

    @override
    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled, ``drop_last`` loader of this rank's ``micro_batch_size`` samples per step."""
        self.setup("fit")
        return self._loader(self.train_dataset, train=True)

    @override
    def val_dataloader(self) -> StatefulDataLoader | list:
        """In-order loader over the held-out samples; ``[]`` (no validation) when there are none."""
        self.setup("validate")
        return [] if self.val_dataset is None else self._loader(self.val_dataset, train=False)


class TokenDataModule(ResumableLoaders):
    """Train/val data from memmap token shards (see :class:`MemmapTokenDataset`).

    Windows ``[0, n_train)`` train and the last ``n_val = ceil(val_fraction * n)`` windows validate.
    Each data-parallel rank gets ``micro_batch_size`` windows per step from a
    :class:`ResumableDistributedSampler` (shuffled, seeded, ``drop_last``), so one global batch is
    ``micro_batch_size * dp`` windows of ``seq_len`` tokens. The rank and size come from the
    trainer's ``strategy.distributed_sampler_kwargs`` (the strategy gives the data-parallel
    sub-mesh there: tensor/context-parallel peers get identical batches). Loaders are
    ``StatefulDataLoader``s, so checkpoints carry the position inside an epoch.

    Args:
        data_dir: folder with ``metadata.json`` and ``shard_*.npy`` (``kforge prepare-data``).
        seq_len: tokens per sample (the model's context length for training).
        micro_batch_size: samples per step on each data-parallel rank.
        val_fraction: share of windows held out for validation, in [0, 1); 0 disables
            validation. At least one window goes to each split when > 0.
        num_workers: DataLoader worker processes per rank (0 loads in the main process).
        data_seed: seed of the per-epoch shuffling (epoch ``e`` uses ``data_seed + e``); separate from
            the model's ``init_seed`` and Lightning's ``seed_everything``, so the data order can be varied
            with the same initialization and vice versa.
        vocab_size: the model's vocabulary size; token ids and the tokenizer's ``vocab_size`` are
            checked against it. None checks against the tokenizer's own ``vocab_size``.
        source: text to tokenize into ``data_dir`` (any source :func:`prepare_data` accepts: a local
            file or folder, or a ``datasets.load_dataset`` spec dict such as
            ``{"path": "parquet", "data_files": "corpus/*.parquet"}``); needs ``tokenizer``. Tokenized once:
            later runs reuse the shards while source files (size, mtime), tokenizer and ``text_field`` are
            unchanged, and re-tokenize (with a warning) when any of them changed.
        tokenizer: local tokenizer directory used with ``source``.
        text_field: column holding the text for json/parquet/save_to_disk sources.
        document_masking: pack documents with per-document causal attention: batches carry
            ``doc_ids`` (micro_batch_size, seq_len) and the label at every EOS is ignored
            (:mod:`kempnerforge.data.packing`). False trains on the plain window (attention crosses
            document boundaries) with the fast causal kernel.

    Raises:
        ValueError: a bad argument (at construction) or data that cannot fill one global batch
            (in :meth:`setup`, before the model is built).
        FileNotFoundError / TokenDataError: from :class:`MemmapTokenDataset`, in :meth:`setup`.
    """

    def __init__(
        self,
        data_dir: str,
        seq_len: int = 256,
        micro_batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        data_seed: int = 0,
        vocab_size: int | None = None,
        source: str | dict[str, Any] | None = None,
        tokenizer: str | None = None,
        text_field: str = "text",
        document_masking: bool = False,
    ) -> None:
        super().__init__()
        _check_positive(seq_len=seq_len, micro_batch_size=micro_batch_size)
        if not 0.0 <= val_fraction < 1.0:
            raise UserError("data.val_fraction", f"val_fraction must be in [0, 1), got {val_fraction}")
        if num_workers < 0:
            raise UserError("data.num_workers", f"num_workers must be >= 0, got {num_workers}")
        if vocab_size is not None:
            _check_positive(vocab_size=vocab_size)
        if (source is None) != (tokenizer is None):
            raise UserError(
                "data.tokenizer" if tokenizer is None else "data.source",
                "source and tokenizer go together: give both (to prepare data_dir) or neither",
            )
        self.save_hyperparameters()
        self.data_dir, self.seq_len, self.micro_batch_size = data_dir, seq_len, micro_batch_size
        self.val_fraction, self.num_workers, self.data_seed, self.vocab_size = (
            val_fraction,
            num_workers,
            data_seed,
            vocab_size,
        )
        self.source, self.tokenizer, self.text_field = source, tokenizer, text_field
        self.document_masking = document_masking
        # Tokenize once on global rank 0 (clusters share data_dir); other ranks wait at the barrier.
        self.prepare_data_per_node = False
        self.train_dataset: MemmapTokenDataset | None = None
        self.val_dataset: MemmapTokenDataset | None = None

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one micro-batch on one rank: ``micro_batch_size * seq_len``."""
        return self.micro_batch_size * self.seq_len

    @override
    def prepare_data(self) -> None:
        """Tokenizes ``source`` into ``data_dir`` unless a preparation of the same inputs is there (rank 0 only).

        The shards are reused when ``metadata.json`` records the same fingerprint (source files, tokenizer,
        ``text_field``: :func:`~kempnerforge.data.sources.source_fingerprint`); a changed input is
        re-tokenized with a warning, never silently reused. Leftover shards of an interrupted or outdated
        preparation are replaced; any other file in ``data_dir`` makes :func:`prepare_data` refuse rather
        than mix data.
        """
        root = Path(self.data_dir)
        if self.source is None:
            return
        fingerprint = source_fingerprint(self.source, self.tokenizer, self.text_field)
        if (root / METADATA_FILE).is_file():
            try:
                saved = json.loads((root / METADATA_FILE).read_text()).get("fingerprint")
            except (json.JSONDecodeError, AttributeError):
                saved = None  # unreadable metadata: treat as outdated, prepare again
            if saved == fingerprint:
                return
            rank_zero_warn(
                f"data_dir {self.data_dir!r} was prepared from other inputs (source, tokenizer or text_field "
                "changed since): tokenizing again"
            )
        leftovers_only = root.is_dir() and all(is_prepare_artifact(p.name) for p in root.iterdir())
        _prepare_shards(
            self.source, self.tokenizer, self.data_dir, text_field=self.text_field, overwrite=leftovers_only
        )

    @override
    def setup(self, stage: str | None = None) -> None:
        """Opens the shards and splits train/val windows; idempotent.

        Raises:
            ValueError: fewer windows than one global batch for training, or than 2 in all.
        """
        if self.train_dataset is not None:
            return
        data = MemmapTokenDataset(
            self.data_dir,
            self.seq_len,
            vocab_size=self.vocab_size,
            check_token_ids=scans_token_ids(getattr(self, "trainer", None)),
            document_masking=self.document_masking,
        )
        n = len(data)
        n_val = math.ceil(n * self.val_fraction)
        if n - n_val < 1:
            raise ValueError(
                f"{self.data_dir!r} has {n} windows of seq_len + 1 = {self.seq_len + 1} tokens: too few for "
                f"val_fraction={self.val_fraction} (one window each for train and validation); lower seq_len"
            )
        _, dp = self.dp_rank_and_size()
        needed = self.micro_batch_size * dp
        if n - n_val < needed:
            raise ValueError(
                f"train split of {self.data_dir!r} has {n - n_val} windows (seq_len={self.seq_len}), fewer than one "
                f"global batch of micro_batch_size * dp = {self.micro_batch_size} * {dp} = {needed}; lower "
                "seq_len, micro_batch_size or val_fraction, or add data"
            )
        self.train_dataset = data.windows(0, n - n_val)
        self.val_dataset = data.windows(n - n_val, n) if n_val else None


def resumable_loader(
    dataset: Any,
    micro_batch_size: int,
    rank: int,
    dp: int,
    train: bool,
    data_seed: int,
    num_workers: int,
    collate_fn: Any = None,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over a :class:`ResumableDistributedSampler` (this dp rank's share).

    Training shuffles with ``data_seed`` and drops the last partial batch in the sampler and the
    loader, so every rank runs the same number of steps; validation keeps order and pads instead (a
    few samples counted twice), so no held-out sample is skipped.
    """
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=dp, rank=rank, shuffle=train, seed=data_seed, drop_last=train,
        loader_batch_size=micro_batch_size if train else None,
    )  # fmt: skip
    return StatefulDataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=train,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signals,  # a group signal must not kill the workers first
    )


def scans_token_ids(trainer: Any) -> bool:
    """Whether this process scans shards without a recorded ``max_token_id`` (global rank 0 only: the ranks
    read the same files, and one failing rank ends the job)."""
    return bool(getattr(trainer, "is_global_zero", True))


def dp_rank_and_size(trainer: Any) -> tuple[int, int]:
    """``(rank, num_replicas)`` on the data-parallel axis from ``trainer.strategy.distributed_sampler_kwargs``.

    ``(0, 1)`` without a trainer or with one replica. The strategy reports the data-parallel sub-mesh
    there, so tensor/context-parallel peers share a rank and see identical batches.
    """
    strategy = getattr(trainer, "strategy", None)
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) if strategy is not None else None
    if not kwargs or kwargs.get("num_replicas", 1) <= 1:
        return 0, 1
    return int(kwargs["rank"]), int(kwargs["num_replicas"])


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"data.{name}", f"{name} must be a positive integer, got {value!r}")
