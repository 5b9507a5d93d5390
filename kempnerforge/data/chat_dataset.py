"""Rows of chat conversations for fine-tuning: packed (several per row, attention kept per conversation) or padded.

Reads what :func:`~kempnerforge.data.chat_prepare.prepare_chat_data` wrote (memory-mapped; only the small
per-shard offset arrays are read whole). A conversation of ``n`` tokens fills ``n`` positions: inputs are its
tokens, ``labels[t] = ids[t + 1]`` where token ``t + 1`` is an assistant target and ``-100`` elsewhere, so the
last position (whose next token would belong to another conversation) is never trained on.

- packed: conversations are bin-packed whole into rows of ``seq_len`` (largest first, each row then filled with
  the largest conversations that still fit: best-fit decreasing, as TRL's ``bfd`` packing and OLMo-core's
  packed SFT), with ``doc_ids`` so no token attends to another conversation
  (:func:`~kempnerforge.model.attention.document_attention_mask`); the row's unused tail is padding with a
  document id of its own and label ``-100``.
- padded: one conversation per row, right-padded with ``pad_id`` (causal attention never reaches the padding
  from a real token; labels there are ``-100``).

Over-long conversations (more than ``seq_len`` tokens) are truncated to their first ``seq_len`` tokens
(``overlong="truncate"``: later turns are cut; a conversation left with no target token is dropped) or
dropped whole (``overlong="drop"``). Both counts are reported in :attr:`ChatDataset.stats`.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from kempnerforge.data.memmap import TokenDataError, open_shard, read_metadata
from kempnerforge.training.loss import IGNORE_INDEX

OVERLONG = ("truncate", "drop")


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of item indices with summed lengths <= ``capacity``: largest item first, then the largest items that fit.

    Deterministic (ties in file order). Costs ``O(n log d)`` for ``n`` items of ``d`` distinct lengths.

    Args:
        lengths: (n,) int item sizes, each in ``[1, capacity]``.
        capacity: bin size (tokens per row).

    Raises:
        ValueError: an item outside ``[1, capacity]``.
    """
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"items must be 1..{capacity} long, got {lengths.min()}..{lengths.max()}")
    if not len(lengths):
        return []
    order = np.argsort(lengths, kind="stable")
    distinct, starts = np.unique(lengths[order], return_index=True)
    ends = [*starts[1:].tolist(), len(order)]
    # One stack per distinct length, popped from the end: file order within a length. Python ints: the loop
    # below runs once per item, and numpy scalars would make it several times slower.
    stacks = {d: order[s:e][::-1].tolist() for d, s, e in zip(distinct.tolist(), starts.tolist(), ends, strict=True)}
    avail = distinct.tolist()
    sizes = lengths.tolist()
    bins: list[list[int]] = []
    while avail:
        length = avail[-1]
        stack = stacks[length]
        row, room = [stack.pop()], capacity - length
        if not stack:
            avail.pop()
        while avail and (k := bisect.bisect_right(avail, room) - 1) >= 0:
            stack = stacks[avail[k]]
            item = stack.pop()
            if not stack:
                del avail[k]
            row.append(item)
            room -= sizes[item]
        bins.append(row)
    return bins


class ChatDataset(Dataset):
    """Fixed-length rows of chat conversations from a ``format: chat`` token folder.

    Item ``i`` is ``{"input_ids", "labels"}`` (seq_len,) int64, plus ``doc_ids`` (seq_len,) int64 when packed
    (conversation index within the row, non-decreasing; the padding tail has its own).

    Args:
        data_dir: folder written by :func:`~kempnerforge.data.chat_prepare.prepare_chat_data`.
        seq_len: positions per row (the model's training context), > 1.
        packing: True packs conversations (needs the model's document mask: ``doc_ids``); False pads one per row.
        overlong: ``"truncate"`` or ``"drop"`` conversations longer than ``seq_len`` (module docstring).
        vocab_size: the model's vocabulary size; the data's must not exceed it. None: the tokenizer's.
        conversations: ``(start, stop)`` range of conversation numbers (in file order) to use; None: all.

    Attributes:
        stats: ``{"conversations", "truncated", "dropped", "rows", "fill"}``: conversations kept, of them
            truncated, dropped by the overlong rule, rows, and the share of row positions holding conversation tokens.

    Raises:
        FileNotFoundError / TokenDataError: a missing or inconsistent folder, one that is not chat data, a
            vocabulary larger than the model's, or no conversation left.
        ValueError: ``seq_len < 2`` or an unknown ``overlong``.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        packing: bool = True,
        overlong: str = "truncate",
        vocab_size: int | None = None,
        conversations: tuple[int, int] | None = None,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 tokens, got {seq_len}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
        self.data_dir, self.seq_len, self.packing = Path(data_dir), int(seq_len), bool(packing)
        self.metadata = meta = read_chat_metadata(self.data_dir)
        if vocab_size is not None and meta["vocab_size"] > vocab_size:
            raise TokenDataError(
                f"{self.data_dir} was tokenized with vocab_size={meta['vocab_size']} (tokenizer {meta.get('tokenizer')}) "
                f"but the model's vocab_size={vocab_size}; the model's vocab_size must be >= {meta['vocab_size']}"
            )
        self.pad_id, self.overlong = int(meta["pad_id"]), overlong
        self._arrays: list[tuple[np.ndarray, np.ndarray]] | None = None
        offsets = [_offsets(self.data_dir, s) for s in meta["shards"]]
        self._starts = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
        self._lengths = np.concatenate([np.diff(o) for o in offsets]).astype(np.int64)
        self._shard = np.concatenate([np.full(len(o) - 1, i, dtype=np.int32) for i, o in enumerate(offsets)])
        lo, hi = conversations if conversations is not None else (0, len(self._starts))
        self._plan(lo, hi)
        # Per row entry only where its tokens start, in which shard, and how many: 16 bytes per conversation.
        self._entry_start, self._entry_shard = self._starts[self._conv], self._shard[self._conv]
        self._len = self._len.astype(np.int32)
        del self._starts, self._lengths, self._shard, self._conv
        if len(self) == 0:
            raise TokenDataError(
                f"{self.data_dir}: no conversation left for seq_len={seq_len} with overlong={overlong!r} "
                f"(conversations {lo}..{hi})"
            )

    def _plan(self, lo: int, hi: int) -> None:
        """Lays out rows as CSR: row ``r`` holds ``(self._conv[k], self._len[k])`` for ``k`` in
        ``self._rows[r]:self._rows[r + 1]``, after the overlong rule; fills :attr:`stats`."""
        ids, lengths = np.arange(lo, hi), self._lengths[lo:hi]
        over = lengths > self.seq_len
        keep = ~over
        if self.overlong == "truncate" and over.any():
            keep[over] = [self._targets_within(int(c)) for c in ids[over]]
        ids, lengths = ids[keep], np.minimum(lengths[keep], self.seq_len)
        bins = pack_best_fit(lengths, self.seq_len) if self.packing else [[i] for i in range(len(ids))]
        flat = np.asarray([i for b in bins for i in b], dtype=np.int64)
        self._conv, self._len = ids[flat], lengths[flat]
        self._rows = np.concatenate([[0], np.cumsum([len(b) for b in bins], dtype=np.int64)]).astype(np.int64)
        dropped = int((~keep).sum())
        self.stats = {
            "conversations": int(len(ids)),
            "truncated": int(over.sum()) - dropped,
            "dropped": dropped,
            "rows": len(bins),
            "fill": float(lengths.sum() / max(1, len(bins) * self.seq_len)),
        }

    # -- storage -------------------------------------------------------------------------------

    def _shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._arrays is None:  # lazily, also after unpickling in a DataLoader worker
            dtype = self.metadata["dtype"]
            self._arrays = []
            for s in self.metadata["shards"]:
                tokens, mask = (
                    open_shard(self.data_dir / s["file"], dtype),
                    open_shard(self.data_dir / s["mask_file"], "uint8"),
                )
                if not len(tokens) == len(mask) == s["num_tokens"]:
                    raise TokenDataError(
                        f"{self.data_dir / s['file']} holds {len(tokens)} tokens and {s['mask_file']} {len(mask)} mask "
                        f"entries, but metadata.json says {s['num_tokens']}; prepare the data again"
                    )
                self._arrays.append((tokens, mask))
        return self._arrays

    def _conversation(self, c: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask = self._shards()[self._shard[c]]
        start = self._starts[c]
        return tokens[start : start + length], mask[start : start + length]

    def _targets_within(self, c: int) -> bool:
        return bool(self._conversation(c, self.seq_len)[1][1:].any())

    def __len__(self) -> int:
        return len(self._rows) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        doc = np.empty(self.seq_len, dtype=np.int64)
        pos = 0
        for k in range(self._rows[index], self._rows[index + 1]):
            n = int(self._len[k])
            tokens, mask = self._shards()[self._entry_shard[k]]
            start = int(self._entry_start[k])
            tokens, mask = tokens[start : start + n], mask[start : start + n]
            tokens = tokens.astype(np.int64)  # uint16 on disk: -100 must not wrap
            ids[pos : pos + n] = tokens
            labels[pos : pos + n - 1] = np.where(mask[1:] != 0, tokens[1:], IGNORE_INDEX)
            doc[pos : pos + n] = k - self._rows[index]
            pos += n
        doc[pos:] = self._rows[index + 1] - self._rows[index]
        sample = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.packing:
            sample["doc_ids"] = torch.from_numpy(doc)
        return sample

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = None  # a pickled memmap would copy the shard
        return state


def _offsets(data_dir: Path, shard: dict[str, Any]) -> np.ndarray:
    """A shard's conversation offsets, checked against its metadata entry (a truncated or mixed-up folder)."""
    path = data_dir / shard["offsets_file"]
    try:
        offsets = np.load(path, allow_pickle=False)
    except Exception as e:  # missing, truncated or not .npy
        raise TokenDataError(f"{path} cannot be read ({e}); prepare the data again") from e
    if offsets.ndim != 1 or len(offsets) != shard["num_conversations"] + 1 or offsets[-1] != shard["num_tokens"]:
        raise TokenDataError(
            f"{path} does not match metadata.json ({shard['num_conversations']} conversations, {shard['num_tokens']} "
            "tokens); prepare the data again"
        )
    return offsets


def read_chat_metadata(data_dir: Path) -> dict[str, Any]:
    """``metadata.json`` of a chat token folder (:func:`~kempnerforge.data.memmap.read_metadata`'s checks too).

    Raises:
        FileNotFoundError / TokenDataError: as ``read_metadata``; also a folder that is not ``format: chat``.
    """
    meta = read_metadata(data_dir)
    if meta.get("format") != "chat":
        raise TokenDataError(
            f"{data_dir} holds text token shards, not chat data; prepare chat jsonl with `kforge prepare-data "
            "--format chat`, or train on it with TokenDataModule"
        )
    return meta
