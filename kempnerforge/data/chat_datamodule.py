"""LightningDataModule for chat / instruction fine-tuning: loss on assistant tokens only, packed or padded rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from kempnerforge.data.chat_dataset import OVERLONG, ChatDataset, read_chat_metadata
from kempnerforge.data.chat_prepare import chat_fingerprint, check_chat_source, prepare_chat_data
from kempnerforge.data.chat_template import ChatDataError, check_chat_tokenizer_files
from kempnerforge.data.datamodule import ResumableLoaders
from kempnerforge.data.memmap import TokenDataError
from kempnerforge.data.shard_files import METADATA_FILE, is_prepare_artifact
from kempnerforge.errors import UserError


class ChatDataModule(ResumableLoaders):
    """Train/val rows of chat conversations (``kforge prepare-data --format chat``), loss on assistant tokens.

    Batches are ``{"input_ids", "labels"}`` (micro_batch_size, seq_len) int64 with ``labels = -100`` on every
    token the assistant did not write (system / user / tool turns, role headers, padding) and, packed, ``doc_ids``
    (micro_batch_size, seq_len) so attention stays inside each conversation. The module's loss sums the
    cross-entropy over the remaining labels and divides by their global count (all micro-batches and dp ranks
    of the step), so every assistant token weighs the same whatever the packing
    (:class:`~kempnerforge.training.loss.StepTokenNormalizer`). Rows are sampled as :class:`TokenDataModule`
    samples windows (:class:`~kempnerforge.data.datamodule.ResumableDistributedSampler`: shuffled, seeded,
    resumable from the checkpointed loader state).

    Args:
        data_dir: chat token folder (``metadata.json`` with ``"format": "chat"``).
        seq_len: positions per row (<= the model's ``max_seq_len``).
        micro_batch_size: rows per step on each data-parallel rank.
        packing: pack several whole conversations per row (best-fit decreasing, document-masked attention);
            False: one conversation per row, right-padded.
        overlong: conversations longer than ``seq_len``: ``truncate`` (keep the first ``seq_len`` tokens; one
            with no assistant token left is dropped) or ``drop``.
        val_fraction: share of conversations (the last ones in file order) held out for validation, in [0, 1).
        num_workers: DataLoader worker processes per rank.
        data_seed: seed of the per-epoch shuffling (epoch ``e`` uses ``data_seed + e``).
        vocab_size: the model's vocabulary size (the data's must not exceed it); linked from the model config.
        source: chat jsonl (file or folder) to prepare into ``data_dir`` on global rank 0 at the start, reused
            while source files, tokenizer files (template included) and ``messages_field`` are unchanged. For
            large data prepare offline with ``kforge prepare-data --format chat`` instead.
        tokenizer: local tokenizer or model folder with a chat template; needed with ``source``.
        messages_field: key of each record's message list.

    Raises:
        UserError: a bad argument, naming ``data.<field>``, at construction.
    """

    def __init__(
        self,
        data_dir: str,
        seq_len: int = 2048,
        micro_batch_size: int = 8,
        packing: bool = True,
        overlong: str = "truncate",
        val_fraction: float = 0.0,
        num_workers: int = 0,
        data_seed: int = 0,
        vocab_size: int | None = None,
        source: str | None = None,
        tokenizer: str | None = None,
        messages_field: str = "messages",
    ) -> None:
        super().__init__()
        # Messages name the field: under a class_path the CLI reads it from the text (jsonargparse drops the type).
        for name, value, low in (("seq_len", seq_len, 2), ("micro_batch_size", micro_batch_size, 1)):
            if not isinstance(value, int) or value < low:
                raise UserError(f"data.{name}", f"data.{name}={value!r} must be an integer >= {low}")
        if overlong not in OVERLONG:
            raise UserError("data.overlong", f"data.overlong={overlong!r} is not one of {', '.join(OVERLONG)}")
        if not 0.0 <= val_fraction < 1.0:
            raise UserError("data.val_fraction", f"data.val_fraction={val_fraction} must be in [0, 1)")
        if num_workers < 0:
            raise UserError("data.num_workers", f"data.num_workers={num_workers} must be >= 0")
        if (source is None) != (tokenizer is None):
            missing, given = ("tokenizer", "source") if tokenizer is None else ("source", "tokenizer")
            raise UserError(
                f"data.{missing}",
                f"data.{missing} is needed with data.{given}: give both (to prepare data_dir) or neither",
            )
        if tokenizer is not None:
            try:
                check_chat_tokenizer_files(tokenizer)
            except ChatDataError as err:
                raise UserError("data.tokenizer", f"data.tokenizer={err}") from err
        self.save_hyperparameters()
        self.data_dir, self.seq_len, self.micro_batch_size = data_dir, seq_len, micro_batch_size
        self.packing, self.overlong, self.val_fraction = packing, overlong, val_fraction
        self.num_workers, self.data_seed, self.vocab_size = num_workers, data_seed, vocab_size
        self.source, self.tokenizer, self.messages_field = source, tokenizer, messages_field
        self.prepare_data_per_node = False  # rank 0 prepares; clusters share data_dir
        self.train_dataset: ChatDataset | None = None
        self.val_dataset: ChatDataset | None = None

    #: The field that turns :attr:`document_masking` on, for refusals (pipeline parallelism cannot take it).
    document_masking_field = "data.packing"

    @property
    def document_masking(self) -> bool:
        """Packed rows carry ``doc_ids`` (the strategy's and the estimator's rules read this, as for text)."""
        return self.packing

    @property
    def tokens_per_batch(self) -> int:
        """Positions in one micro-batch on one rank: ``micro_batch_size * seq_len`` (padding included)."""
        return self.micro_batch_size * self.seq_len

    def _prepared(self) -> bool:
        meta = Path(self.data_dir) / METADATA_FILE
        if self.source is None or not meta.is_file():
            return False
        try:
            saved = json.loads(meta.read_text()).get("fingerprint")
        except (json.JSONDecodeError, AttributeError):
            return False
        return saved == chat_fingerprint(self.source, self.tokenizer, self.messages_field)

    def check_source(self) -> None:
        """Checks every record of ``source`` and the template on its first conversation, unless ``data_dir``
        already holds this preparation; without ``source``, that ``data_dir`` holds chat data. ``kforge`` runs it on global rank 0 before any process group exists
        (:mod:`kempnerforge.preflight`): one JSON pass, no tokenizing.

        Raises:
            UserError: ``data.source`` / ``data.tokenizer``: the first bad record (file, line, message index) or a
                template that is missing, refuses a conversation or breaks the prefix property; ``data.data_dir``:
                not a prepared chat folder.
        """
        if self.source is None:
            try:
                read_chat_metadata(Path(self.data_dir))
            except (FileNotFoundError, TokenDataError) as err:
                raise UserError("data.data_dir", str(err)) from err
            return
        if self._prepared():
            return
        with _as_data_field():
            check_chat_source(self.source, self.tokenizer, self.messages_field)

    @override
    def prepare_data(self) -> None:
        """Renders ``source`` into ``data_dir`` unless this preparation is there (global rank 0 only)."""
        if self.source is None or self._prepared():
            return
        root = Path(self.data_dir)
        if (root / METADATA_FILE).is_file():
            rank_zero_warn(f"data_dir {self.data_dir!r} was prepared from other inputs: rendering the chat data again")
        leftovers_only = root.is_dir() and all(is_prepare_artifact(p.name) for p in root.iterdir())
        with _as_data_field():
            prepare_chat_data(
                self.source,
                self.tokenizer,
                self.data_dir,
                self.messages_field,
                overwrite=leftovers_only,
                progress=False,
            )

    @override
    def setup(self, stage: str | None = None) -> None:
        """Splits conversations train/val (the last ``ceil(val_fraction * n)`` validate) and lays out rows; idempotent.

        Raises:
            ValueError: fewer training rows than one global batch (``micro_batch_size * dp``).
        """
        if self.train_dataset is not None:
            return
        n = int(read_chat_metadata(Path(self.data_dir))["num_conversations"])
        n_val = math.ceil(n * self.val_fraction)
        if n - n_val < 1:
            raise ValueError(f"{self.data_dir!r} has {n} conversations: too few for val_fraction={self.val_fraction}")

        def rows(lo: int, hi: int) -> ChatDataset:
            return ChatDataset(self.data_dir, self.seq_len, self.packing, self.overlong, self.vocab_size, (lo, hi))

        self.train_dataset = rows(0, n - n_val)
        self.val_dataset = rows(n - n_val, n) if n_val else None
        stats = self.train_dataset.stats
        rank_zero_info(
            f"chat data: {stats['conversations']} training conversations in {stats['rows']} rows of {self.seq_len} "
            f"({'packed' if self.packing else 'padded'}, {stats['fill']:.0%} of positions hold tokens); "
            f"{stats['truncated']} truncated, {stats['dropped']} dropped (overlong={self.overlong})"
        )
        _, dp = self.dp_rank_and_size()
        if len(self.train_dataset) < self.micro_batch_size * dp:
            raise ValueError(
                f"{self.data_dir!r} gives {len(self.train_dataset)} training rows of seq_len={self.seq_len}, fewer than "
                f"one global batch of micro_batch_size * dp = {self.micro_batch_size} * {dp}; lower micro_batch_size "
                "or add data"
            )


class _as_data_field:
    """Re-raises a :class:`ChatDataError` under the data module's field name (``source`` -> ``data.source``)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if isinstance(err, ChatDataError):
            raise UserError(f"data.{err.field}", str(err)) from err
