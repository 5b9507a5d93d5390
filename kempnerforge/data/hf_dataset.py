"""Hugging Face datasets from local files: a checked ``load_dataset`` spec and a streaming, packed token stream.

Two ways to train on a Hugging Face dataset:

- eager: :func:`~kempnerforge.data.prepare.prepare_data` accepts the same spec, tokenizes it once into
  memmap shards and :class:`~kempnerforge.data.datamodule.TokenDataModule` reuses them on the next run;
- streaming: :class:`PackedTokenStream` reads ``datasets.load_dataset(..., streaming=True)``, tokenizes on
  the fly and packs documents (each followed by EOS) into ``seq_len + 1``-token windows, sharded across
  data-parallel ranks and dataloader workers with ``datasets.distributed.split_dataset_by_node``, and
  resumable through torchdata's ``StatefulDataLoader`` (the packing buffer is part of the state).

Only local data is accepted: a spec naming a Hub dataset is refused before anything is fetched.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from kempnerforge.data.packing import pack_sample
from kempnerforge.data.prepare import load_tokenizer

# Packaged builders of `datasets` that read local files only.
LOCAL_BUILDERS = ("text", "json", "parquet", "csv", "arrow")
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens")


def _local_paths(value: Any, field: str) -> list[Path]:
    """Expands a ``data_files`` / ``data_dir`` value (str, list or split dict) into existing local paths.

    Raises:
        ValueError: a pattern matching no local file (a remote URL matches nothing).
    """
    if isinstance(value, dict):
        return [p for v in value.values() for p in _local_paths(v, field)]
    patterns = [value] if isinstance(value, str) else list(value)
    found: list[Path] = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"source.{field} must hold path strings, got {pattern!r}")
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ValueError(f"source.{field}: {pattern!r} matches no local file (only local data is read)")
        found += [Path(m).resolve() for m in matches]
    return found


def check_dataset_spec(spec: dict[str, Any]) -> list[Path]:
    """Checks a ``datasets.load_dataset`` spec names local data only; returns the local paths it reads.

    ``spec`` holds ``load_dataset`` keyword arguments: ``path`` (one of :data:`LOCAL_BUILDERS` or a local
    dataset folder), ``data_files`` and/or ``data_dir``, optional ``split`` (default ``"train"``) and any other
    builder option (e.g. ``sample_by`` for ``text``). ``streaming`` is set by the caller.

    Raises:
        ValueError: ``spec`` is not a dict, has no ``path``, sets ``streaming``, names a Hub dataset, or a
            pattern matches no local file.
    """
    if not isinstance(spec, dict) or "path" not in spec:
        raise ValueError(f"source spec must be a dict of datasets.load_dataset arguments with a 'path', got {spec!r}")
    if "streaming" in spec:
        raise ValueError("source.streaming is set by the data module (streaming or eager), not in the spec")
    path = spec["path"]
    if path not in LOCAL_BUILDERS and not Path(str(path)).expanduser().is_dir():
        raise ValueError(
            f"source.path={path!r} is neither a local builder {LOCAL_BUILDERS} nor a local folder; "
            "Hub datasets are not fetched"
        )
    paths = [] if path in LOCAL_BUILDERS else [Path(path).expanduser().resolve()]
    for field in ("data_files", "data_dir"):
        if spec.get(field) is not None:
            paths += _local_paths(spec[field], field)
    if not paths:
        raise ValueError(f"source.path={path!r} needs data_files or data_dir naming local files")
    return paths


def load_local_dataset(spec: dict[str, Any], streaming: bool = True) -> Any:
    """``datasets.load_dataset(**spec, streaming=streaming)`` after :func:`check_dataset_spec`.

    Returns:
        A ``datasets.IterableDataset`` (streaming) or ``datasets.Dataset`` for ``spec["split"]``
        (default ``"train"``).

    Raises:
        ValueError: see :func:`check_dataset_spec`.
    """
    import datasets

    check_dataset_spec(spec)
    return datasets.load_dataset(**{"split": "train", **spec}, streaming=streaming)


def _file_stamps(paths: list[Path]) -> list[list[Any]]:
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()})
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def tokenizer_fingerprint(tokenizer: str) -> str:
    """SHA-256 over the tokenizer's own files (``tokenizer*``, ``vocab*``, ``merges*``, ...), not model weights."""
    path = Path(tokenizer).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        if f.name.startswith(_TOKENIZER_FILE_PREFIXES) or f.suffix == ".model" or f == path:
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def source_fingerprint(source: str | dict[str, Any], tokenizer: str, text_field: str) -> str:
    """Hex digest identifying a preparation: the source (spec, file paths, sizes, mtimes), tokenizer and field.

    Like ``make`` and the ``datasets`` cache, a source file is taken as changed when its size or modification
    time changes (hashing a large corpus on every start would cost as much as tokenizing it).
    """
    if isinstance(source, dict):
        described: Any = {"spec": source, "files": _file_stamps(check_dataset_spec(source))}
    else:
        described = {"path": str(Path(source).expanduser().resolve()), "files": _file_stamps([Path(source)])}
    blob = json.dumps([described, tokenizer_fingerprint(tokenizer), text_field], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


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
        """``{"pass", "source" (the reader's datasets state or None), "buffer" (int64 tokens), "windows"}``."""
        return {**self._state, "buffer": self._state["buffer"].clone()}

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
