"""A streaming, packed token stream over a Hugging Face dataset from local files.

Two ways to train on a Hugging Face dataset:

- eager: :func:`~kempnerforge.data.prepare.prepare_data` accepts the same spec, tokenizes it once into
  memmap shards and :class:`~kempnerforge.data.datamodule.TokenDataModule` reuses them on the next run;
- streaming: :class:`PackedTokenStream` reads ``datasets.load_dataset(..., streaming=True)``, tokenizes on
  the fly and packs documents (each followed by EOS) into ``seq_len + 1``-token windows, sharded across
  data-parallel ranks and dataloader workers with ``datasets.distributed.split_dataset_by_node``, and
  resumable through torchdata's ``StatefulDataLoader`` (the packing buffer is part of the state).

Only local data is accepted: a spec naming a Hub dataset is refused before anything is fetched
(:func:`~kempnerforge.data.sources.check_dataset_spec`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from kempnerforge.data.packing import pack_sample
from kempnerforge.data.prepare import load_tokenizer
from kempnerforge.data.sources import load_local_dataset


class PackedTokenStream(IterableDataset):
    """Streams a local Hugging Face dataset as packed ``seq_len + 1``-token windows, exactly resumable.

    Every document (row of ``text_field``) is tokenized without special tokens and followed by one EOS;
    documents are concatenated and cut into windows with stride ``seq_len`` (the last token of a window is
    the first of the next, as in :class:`~kempnerforge.data.memmap.MemmapTokenDataset`). Empty rows are
    skipped. Sharding: reader ``dp_rank * num_workers + worker_id`` of ``dp_size * num_workers`` gets
    ``split_dataset_by_node(dataset, rank, world_size)`` (whole files when their count divides the readers,
    else every ``world_size``-th row). Stream order, no shuffling: a shuffle buffer cannot be resumed exactly.

    With ``repeat`` the stream never ends (pass ``p + 1`` follows pass ``p``, packing continues across the
    seam), so ranks never run out at different steps; bound training by ``max_steps``. Without it, the
    stream ends after one pass, or after ``max_windows`` windows per reader when that is given.

    State (``state_dict``/``load_state_dict``, called per worker by ``StatefulDataLoader``): the pass
    number, the dataset's own ``state_dict`` at the last tokenized row, and the packing buffer (tokens read
    but not yet emitted), so a resumed stream yields exactly the windows an uninterrupted one would.

    Yields:
        ``{"input_ids", "labels"}`` int64 of shape (seq_len,), plus ``doc_ids`` (seq_len,) with labels at
        EOS ignored when ``document_masking`` (:func:`~kempnerforge.data.packing.pack_sample`).

    Raises:
        ValueError: bad ``seq_len``/``dp_rank``/``batch_rows``, a non-local spec, or (while iterating)
            a row whose ``text_field`` is missing or not a string.
    """

    def __init__(
        self,
        source: dict[str, Any],
        tokenizer: str,
        seq_len: int,
        text_field: str = "text",
        dp_rank: int = 0,
        dp_size: int = 1,
        repeat: bool = True,
        max_windows: int | None = None,
        document_masking: bool = False,
        batch_rows: int = 64,
    ) -> None:
        super().__init__()
        if seq_len <= 0 or batch_rows <= 0:
            raise ValueError(f"seq_len and batch_rows must be positive, got {seq_len} and {batch_rows}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if max_windows is not None and max_windows <= 0:
            raise ValueError(f"max_windows must be positive or None, got {max_windows}")
        self.dataset = load_local_dataset(source, streaming=True)
        tok = load_tokenizer(tokenizer)
        self.tokenizer, self.eos_id, self.vocab_size = tokenizer, tok.eos_id, tok.vocab_size
        self.seq_len, self.text_field, self.batch_rows = seq_len, text_field, batch_rows
        self.dp_rank, self.dp_size, self.repeat, self.max_windows = dp_rank, dp_size, repeat, max_windows
        self.document_masking = document_masking
        self._state: dict[str, Any] = self._initial_state()
        self._resume: dict[str, Any] | None = None
        # Reported by len(); see __len__.
        self.length: int | None = None

    def __len__(self) -> int:
        """``length`` windows, when set; ``TypeError`` (no length) otherwise.

        Why: Lightning pre-fetches one batch ahead from a loader without a length (to see the end coming),
        so the loader state in a checkpoint would be one batch ahead and a resume would skip a batch. A
        training loader reports the windows the run will take (``max_steps`` worth), which turns that off.
        """
        if self.length is None:
            raise TypeError("this stream has no length (set .length to the windows the run will take)")
        return self.length

    @staticmethod
    def _initial_state() -> dict[str, Any]:
        return {"pass": 0, "source": None, "buffer": torch.empty(0, dtype=torch.long), "windows": 0}

    def state_dict(self) -> dict[str, Any]:
        """``{"pass", "source" (the reader's datasets state or None), "buffer" (int64 tokens), "windows"}``: where
        the next window comes from (a loaded state not yet iterated from is returned as loaded)."""
        state = self._resume if self._resume is not None else self._state
        return {**state, "buffer": state["buffer"].clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets where the next ``iter()`` starts; takes effect then."""
        self._resume = {**state_dict, "buffer": torch.as_tensor(state_dict["buffer"], dtype=torch.long)}

    def _reader(self) -> Any:
        from datasets.distributed import split_dataset_by_node

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return split_dataset_by_node(
            self.dataset, rank=self.dp_rank * workers + worker, world_size=self.dp_size * workers
        )

    def _documents(self, reader: Any, encode: Any) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """Token ids of ``batch_rows`` rows at a time (EOS after each), with the reader state after them."""
        for batch in reader.iter(batch_size=self.batch_rows):
            if self.text_field not in batch:
                raise ValueError(f"text_field={self.text_field!r} is not a column; columns: {sorted(batch)}")
            texts = batch[self.text_field]
            bad = next((t for t in texts if t is not None and not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"text_field={self.text_field!r} holds {type(bad).__name__}, not str")
            ids: list[int] = []
            for doc in encode([t for t in texts if t]):
                ids += doc + [self.eos_id]
            yield ids, reader.state_dict()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        state, self._resume = self._resume or self._initial_state(), None
        self._state = state
        encode = load_tokenizer(self.tokenizer).encode_batch
        buffer, window = state["buffer"], self.seq_len + 1
        while True:
            reader = self._reader()
            reader.set_epoch(state["pass"])
            if state["source"] is not None:
                reader.load_state_dict(state["source"])
            rows = False
            for ids, source_state in self._documents(reader, encode):
                rows = True
                buffer = torch.cat([buffer, torch.tensor(ids, dtype=torch.long)])
                state = {**state, "source": source_state}
                while len(buffer) >= window:
                    if self.max_windows is not None and state["windows"] >= self.max_windows:
                        return
                    sample, buffer = buffer[:window], buffer[self.seq_len :]
                    self._state = state = {**state, "buffer": buffer, "windows": state["windows"] + 1}
                    yield self._sample(sample)
            if not self.repeat:
                return
            if not rows and state["source"] is None:
                raise ValueError(self._no_rows_message())
            state = {**state, "pass": state["pass"] + 1, "source": None}
            self._state = state

    def _no_rows_message(self) -> str:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        return (
            f"data-parallel rank {self.dp_rank} (worker {info.id if info else 0}) got no rows of the source: "
            f"it has fewer rows than dp_size * num_workers = {self.dp_size} * {workers}; lower num_workers or add data"
        )

    def _sample(self, window: torch.Tensor) -> dict[str, torch.Tensor]:
        sample = {"input_ids": window[:-1].clone(), "labels": window[1:].clone()}
        return pack_sample(sample, self.eos_id) if self.document_masking else sample
