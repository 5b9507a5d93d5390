"""Map-style dataset over memory-mapped token shards written by :func:`prepare_data`.

nanoGPT / Megatron-style memmap token shards: the shards are mapped with
``np.load(mmap_mode="r")`` (nothing is read until a window is indexed), and each shard is cut into
non-overlapping windows of ``seq_len + 1`` tokens with stride ``seq_len``: a window's first
``seq_len`` tokens are the inputs, its last ``seq_len`` the next-token labels. Windows never cross
a shard boundary, so each shard's last ``(num_tokens - 1) % seq_len`` tokens are unused.
"""

from __future__ import annotations

import bisect
import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from kempnerforge.data.packing import pack_sample
from kempnerforge.data.prepare import METADATA_FILE

ALLOWED_DTYPES = ("uint16", "uint32")


class TokenDataError(ValueError):
    """A token-shard folder is inconsistent with its metadata or with the model/sequence length."""


def read_metadata(data_dir: str | Path) -> dict[str, Any]:
    """Reads and checks ``data_dir/metadata.json``.

    Raises:
        FileNotFoundError: ``data_dir`` or its ``metadata.json`` is missing.
        TokenDataError: unreadable JSON, a missing key, an unsupported dtype, or no shards.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data_dir {str(root)!r} does not exist; run `kforge prepare-data` first")
    meta_path = root / METADATA_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{str(meta_path)!r} not found: data_dir is not a prepared token folder (or its preparation "
            "did not finish); run `kforge prepare-data --output_dir` on it"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise TokenDataError(f"{str(meta_path)!r} is not valid JSON: {e}") from e
    for key in ("shards", "dtype", "vocab_size"):
        if key not in meta:
            raise TokenDataError(f"{str(meta_path)!r} has no {key!r} field")
    if meta["dtype"] not in ALLOWED_DTYPES:
        raise TokenDataError(f"{str(meta_path)!r}: dtype={meta['dtype']!r} is not one of {ALLOWED_DTYPES}")
    if not meta["shards"]:
        raise TokenDataError(f"{str(meta_path)!r} lists no shards (empty 'shards')")
    return meta


def open_shard(path: Path, expected_dtype: str) -> np.ndarray:
    """Memory-maps one ``.npy`` shard and checks it is 1-D with ``expected_dtype``.

    Raises:
        FileNotFoundError: the shard file is missing.
        TokenDataError: the file is not a loadable ``.npy`` (truncated, corrupt) or has the
            wrong shape/dtype.
    """
    if not path.is_file():
        raise FileNotFoundError(f"shard {str(path)!r} is listed in {METADATA_FILE} but missing")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # numpy raises ValueError/OSError/EOFError depending on where it is cut
        raise TokenDataError(f"shard {str(path)!r} is corrupt or truncated: np.load failed ({e})") from e
    if arr.ndim != 1:
        raise TokenDataError(f"shard {str(path)!r} has shape {arr.shape}; expected 1-D token ids")
    if arr.dtype.name != expected_dtype:
        raise TokenDataError(
            f"shard {str(path)!r} has dtype {arr.dtype.name} but {METADATA_FILE} says dtype={expected_dtype!r}"
        )
    return arr


class MemmapTokenDataset(Dataset):
    """Fixed-length next-token windows over memory-mapped token shards.

    Item ``i`` is ``{"input_ids": LongTensor (seq_len,), "labels": LongTensor (seq_len,)}`` with
    ``labels[t] == input_ids[t + 1]`` inside the window (window = tokens ``[k*seq_len,
    k*seq_len + seq_len]`` of one shard). Windows are numbered shard by shard in metadata order.
    Pickles without the mapped arrays (reopened lazily), so DataLoader workers stay cheap.

    Args:
        data_dir: folder written by :func:`kempnerforge.data.prepare.prepare_data`.
        seq_len: tokens per sample (model context length), > 0.
        vocab_size: the model's vocabulary size (may be padded above the tokenizer's); None
            checks ids against the tokenizer's ``vocab_size`` from ``metadata.json``.
        check_token_ids: for shards whose ``metadata.json`` entry has no ``max_token_id`` (prepared by a
            ``kforge prepare-data`` older than that record), scan the shard's maximum id at construction
            (one pass over its data, with a warning saying so). Recorded maxima are always checked: free.
            The data modules pass True on global rank 0 only, so a cluster reads each old shard once.
        document_masking: items also carry ``doc_ids`` (batch-able (seq_len,) int64) and ignore the
            label at every EOS (:func:`kempnerforge.data.packing.pack_sample`), so the model masks
            attention per document. Needs ``eos_id`` in ``metadata.json``.

    Raises:
        ValueError: ``seq_len <= 0``.
        FileNotFoundError: missing ``data_dir``, ``metadata.json`` or a listed shard.
        TokenDataError: corrupt shard, dtype mismatch, token count mismatch, metadata
            ``vocab_size`` above the model's ``vocab_size``, a token id ``>= vocab_size``, no shard of at least
            ``seq_len + 1`` tokens (a shorter one is skipped with a warning), or ``document_masking`` without
            ``eos_id`` in the metadata.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        vocab_size: int | None = None,
        check_token_ids: bool = True,
        document_masking: bool = False,
    ) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be a positive number of tokens, got {seq_len}")
        self.data_dir, self.seq_len = Path(data_dir), int(seq_len)
        self.metadata = read_metadata(self.data_dir)
        if self.metadata.get("format") == "chat":
            raise TokenDataError(
                f"{self.data_dir} holds chat data (prepared with --format chat): train on it with "
                "data.class_path=kempnerforge.data.chat_datamodule.ChatDataModule"
            )
        self.eos_id: int | None = None
        if document_masking:
            if not isinstance(self.metadata.get("eos_id"), int):
                raise TokenDataError(
                    f"document_masking needs the EOS id that separates documents, but {self.data_dir / METADATA_FILE} "
                    "has no integer 'eos_id'; re-run `kforge prepare-data` or set document_masking=false"
                )
            self.eos_id = self.metadata["eos_id"]
        self.vocab_size = self._check_vocab(vocab_size)
        unrecorded = [e["file"] for e in self.metadata["shards"] if not isinstance(e.get("max_token_id"), int)]
        if unrecorded and check_token_ids:
            warnings.warn(
                f"{self.data_dir / METADATA_FILE} records no max_token_id for {len(unrecorded)} shard(s) (prepared "
                "by an older `kforge prepare-data`): scanning them for token ids >= vocab_size now; prepare the "
                "data again to record it and skip this scan",
                stacklevel=2,
            )
        arrays = [self._open(entry, check_token_ids) for entry in self.metadata["shards"]]
        counts = self._window_counts(arrays)
        keep = [i for i, c in enumerate(counts) if c > 0]
        self._files = [self.data_dir / self.metadata["shards"][i]["file"] for i in keep]
        self._arrays: list[np.ndarray] | None = [arrays[i] for i in keep]
        self._offsets = np.concatenate([[0], np.cumsum([counts[i] for i in keep])]).astype(np.int64).tolist()
        self._start, self._stop = 0, self._offsets[-1]

    def _check_vocab(self, vocab_size: int | None) -> int:
        data_vocab = int(self.metadata["vocab_size"])
        if vocab_size is None:
            return data_vocab
        problem = vocab_mismatch(self.metadata, vocab_size, self.data_dir)
        if problem:
            raise TokenDataError(problem)
        return int(vocab_size)

    def _open(self, entry: dict[str, Any], check_token_ids: bool) -> np.ndarray:
        path = self.data_dir / entry["file"]
        arr = open_shard(path, self.metadata["dtype"])
        if "num_tokens" in entry and len(arr) != entry["num_tokens"]:
            raise TokenDataError(
                f"shard {str(path)!r} holds {len(arr)} tokens but {METADATA_FILE} says {entry['num_tokens']}"
            )
        top = entry.get("max_token_id")
        if not isinstance(top, int):
            top = int(arr.max()) if check_token_ids and len(arr) else -1
        if top >= self.vocab_size:
            raise TokenDataError(
                f"shard {str(path)!r} holds token id {top} >= vocab_size={self.vocab_size}; "
                "the data was tokenized with a larger vocabulary than the model's"
            )
        return arr

    def _window_counts(self, arrays: list[np.ndarray]) -> list[int]:
        """Windows per shard; a shard shorter than one window is skipped with a warning (none at all is an error).

        A shard holds a range of the source (``kforge prepare-data``'s layout), so the last one, or one whose range
        held a few short documents, may hold fewer than ``seq_len + 1`` tokens: its tokens are left out like the
        tail of every shard beyond its last window.

        Raises:
            TokenDataError: no shard holds one window (names the first, or the only, shard and its count).
        """
        window = self.seq_len + 1
        short = [i for i, arr in enumerate(arrays) if len(arr) < window]
        if len(short) == len(arrays):
            name, n = self.metadata["shards"][0]["file"], len(arrays[0])
            if len(arrays) == 1:
                raise TokenDataError(
                    f"shard {name!r} of {str(self.data_dir)!r} has {n} tokens, fewer than one window of "
                    f"seq_len + 1 = {window}; lower seq_len or prepare the data with a larger shard_bytes"
                )
            raise TokenDataError(
                f"no shard of {str(self.data_dir)!r} holds one window of seq_len + 1 = {window} tokens (the first, "
                f"{name!r}, has {n}); lower seq_len or prepare the data with a larger shard_bytes"
            )
        for i in short:
            warnings.warn(
                f"shard {self.metadata['shards'][i]['file']!r} of {str(self.data_dir)!r} has {len(arrays[i])} tokens, "
                f"fewer than seq_len + 1 = {window}: skipped",
                stacklevel=3,
            )
        return [max(0, (len(a) - 1) // self.seq_len) for a in arrays]

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def num_windows(self) -> int:
        """Number of windows in this (sub)range; same as ``len(self)``."""
        return len(self)

    def windows(self, start: int, stop: int) -> MemmapTokenDataset:
        """A view of windows ``[start, stop)`` of this dataset, sharing its mapped shards (O(1)).

        Raises:
            IndexError: unless ``0 <= start < stop <= len(self)``.
        """
        if not 0 <= start < stop <= len(self):
            raise IndexError(f"windows({start}, {stop}) needs 0 <= start < stop <= {len(self)}")
        view = copy.copy(self)  # goes through __getstate__, which drops the maps: share ours
        view._arrays = self._arrays
        view._start, view._stop = self._start + start, self._start + stop
        return view

    def _shards(self) -> list[np.ndarray]:
        if self._arrays is None:  # after unpickling in a DataLoader worker
            self._arrays = [open_shard(f, self.metadata["dtype"]) for f in self._files]
        return self._arrays

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        g = self._start + index
        shard = bisect.bisect_right(self._offsets, g) - 1
        begin = (g - self._offsets[shard]) * self.seq_len
        window = torch.from_numpy(self._shards()[shard][begin : begin + self.seq_len + 1].astype(np.int64))
        # Separate storages: an in-place edit of the inputs must not change the labels.
        sample = {"input_ids": window[:-1], "labels": window[1:].clone()}
        return sample if self.eos_id is None else pack_sample(sample, self.eos_id)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = None  # a pickled memmap would copy the whole shard
        return state


def vocab_mismatch(metadata: dict[str, Any], vocab_size: int | None, data_dir: str | os.PathLike) -> str | None:
    """What is wrong when ``data_dir`` (its ``metadata``) was tokenized with more ids than the model's
    ``vocab_size`` has; None when it fits or either size is unknown."""
    data_vocab = metadata.get("vocab_size")
    if not isinstance(vocab_size, int) or not isinstance(data_vocab, int) or data_vocab <= vocab_size:
        return None
    return (
        f"{METADATA_FILE} of {str(data_dir)!r} has vocab_size={data_vocab} (tokenizer {metadata.get('tokenizer')!r}) "
        f"but the model's vocab_size={vocab_size}; the model's vocab_size must be >= {data_vocab}"
    )


def check_token_dir(path: str | os.PathLike, field: str) -> None:
    """``path`` is a folder of prepared token shards (its ``metadata.json`` parses and lists shards).

    Raises:
        PathError: missing, a file, a folder without ``metadata.json``, or a record that does not parse.
    """
    from kempnerforge.errors import PathError

    p = Path(path).expanduser()
    if not p.exists():
        raise PathError(field, f"{path} does not exist; run kforge prepare-data --output_dir {path} first")
    if not (p / "metadata.json").is_file():
        raise PathError(field, f"{path} holds no prepared token shards (metadata.json); run kforge prepare-data")
    try:
        read_metadata(p)
    except TokenDataError as err:
        raise PathError(field, f"{err}; prepare it again (kforge prepare-data --output_dir {path})") from err
