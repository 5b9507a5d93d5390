"""Tokenize chat jsonl into token shards with a target mask (``kforge prepare-data --format chat``).

Offline, once, on one process: at cluster scale no rank renders templates; training only maps arrays.
Each shard holds whole conversations back to back (none straddles two shards) as three ``.npy`` files:

- ``shard_NNNNN.npy``: token ids (uint16 when the vocabulary fits, else uint32);
- ``mask_NNNNN.npy``: uint8, 1 where the token is a training target (written by the assistant:
  :func:`~kempnerforge.data.chat_template.tokenize_conversations`);
- ``offsets_NNNNN.npy``: int64 ``(num_conversations + 1,)``, conversation ``c`` is ``[offsets[c], offsets[c + 1])``.

``metadata.json`` (written last) has ``"format": "chat"``; :class:`~kempnerforge.data.chat_dataset.ChatDataset`
reads it and packs or pads conversations into rows for a given ``seq_len``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from kempnerforge.data.chat_template import (
    ChatDataError,
    ChatTokenizer,
    check_messages,
    load_chat_tokenizer,
    tokenize_conversations,
)
from kempnerforge.data.shard_files import METADATA_FILE, atomic_write, prepare_output_dir
from kempnerforge.data.sources import source_fingerprint

CHAT_FORMAT = "chat"
_SUFFIXES = (".jsonl", ".json")


def chat_source_files(source: str) -> list[Path]:
    """The ``.jsonl`` files of ``source``: the file itself, or a folder's (recursive, sorted by path).

    Raises:
        ChatDataError: ``field="source"``: missing path, a file that is not jsonl, a folder without any.
    """
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise ChatDataError("source", f"{source} does not exist (a local .jsonl file or a folder of them)")
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            raise ChatDataError("source", f"{source} is not a .jsonl file (one JSON record with messages per line)")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES and not p.name.startswith("."))
    if not files:
        raise ChatDataError("source", f"{source} holds no .jsonl files")
    return files


def iter_conversations(source: str, messages_field: str = "messages") -> Iterator[tuple[list[dict], str]]:
    """Yields ``(messages, "file line N")`` for every non-blank line of the source's jsonl files, checked.

    Raises:
        ChatDataError: ``field="source"``: a line that is not JSON or not an object, one without the
            ``messages_field`` list, an unknown role or a non-string content (:func:`check_messages`).
    """
    for path in chat_source_files(source):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {n}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ChatDataError("source", f"{where} is not JSON ({e})") from e
                if not isinstance(record, dict) or messages_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ChatDataError("source", f"{where} has no {messages_field!r} field (has {keys})")
                check_messages(record[messages_field], where)
                yield record[messages_field], where


def check_chat_source(source: str, tokenizer: str, messages_field: str = "messages") -> int:
    """Every record of ``source`` is a valid conversation, and the first renders correctly with the template.

    One JSON pass over the source (no tokenizing of the rest): what ``kforge fit`` runs on global rank 0
    before any process group exists when the data still has to be prepared.

    Returns:
        The number of conversations.

    Raises:
        ChatDataError: as :func:`iter_conversations`, :func:`load_chat_tokenizer` and
            :func:`tokenize_conversations` do.
    """
    tok = load_chat_tokenizer(tokenizer)
    count = 0
    for messages, where in iter_conversations(source, messages_field):
        if count == 0:
            tokenize_conversations(tok, [messages], [where])
        count += 1
    if count == 0:
        raise ChatDataError("source", f"{source} holds no conversations (only blank lines)")
    return count


class _ChatShardWriter:
    """Buffers whole conversations and writes a shard (tokens, mask, offsets) once ``shard_size`` is reached."""

    def __init__(self, out: Path, shard_size: int, dtype: np.dtype) -> None:
        self.out, self.shard_size, self.dtype = out, shard_size, dtype
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.fill = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: list[int], mask: list[bool]) -> None:
        if self.fill and self.fill + len(ids) > self.shard_size:
            self.flush()
        self.ids.append(np.asarray(ids, dtype=self.dtype))
        self.masks.append(np.asarray(mask, dtype=np.uint8))
        self.fill += len(ids)

    def flush(self) -> None:
        if not self.ids:
            return
        k = len(self.shards)
        tokens, mask = np.concatenate(self.ids), np.concatenate(self.masks)
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.ids])]).astype(np.int64)
        names = {"file": f"shard_{k:05d}.npy", "mask_file": f"mask_{k:05d}.npy", "offsets_file": f"offsets_{k:05d}.npy"}
        for key, data in (("file", tokens), ("mask_file", mask), ("offsets_file", offsets)):
            atomic_write(self.out / names[key], lambda f, d=data: np.save(f, d))
        self.shards.append(
            {
                **names,
                "num_tokens": int(len(tokens)),
                "num_conversations": len(self.ids),
                "num_target_tokens": int(mask.sum()),
                "max_token_id": int(tokens.max()),
            }
        )
        self.ids, self.masks, self.fill = [], [], 0


def prepare_chat_data(
    source: str,
    tokenizer: str,
    output_dir: str,
    messages_field: str = "messages",
    shard_size: int = 2**27,
    batch_size: int = 256,
    overwrite: bool = False,
    progress: bool = True,
    num_proc: int = 1,
) -> dict[str, Any]:
    """Renders chat jsonl with the tokenizer's template into token + target-mask shards and ``metadata.json``.

    Args:
        source: a ``.jsonl`` file, one ``{"messages": [{"role", "content"}, ...]}`` record per line (other
            keys are ignored; roles :data:`~kempnerforge.data.chat_template.ROLES`), or a folder of them.
        tokenizer: local tokenizer or model folder with a chat template (``tokenizer.json``,
            ``tokenizer_config.json`` with ``eos_token``, ``chat_template.jinja`` or a ``chat_template`` entry).
        output_dir: folder for the shards; created if missing.
        messages_field: the key holding each record's messages.
        shard_size: tokens per shard, about (a shard holds whole conversations; one longer than
            ``shard_size`` gets a shard of its own).
        batch_size: conversations tokenized per batch.
        overwrite: replace a previous preparation in ``output_dir``.
        progress: show a progress bar.
        num_proc: worker processes rendering and tokenizing batches (template rendering is pure Python: about
            2,000 short conversations/s per process); the output is the same for any value.

    Returns:
        The metadata: ``format="chat"``, ``tokenizer``, ``chat_template_file``, ``vocab_size``, ``dtype``,
        ``eos_id``, ``pad_id``, ``shards`` (``file``, ``mask_file``, ``offsets_file``, ``num_tokens``,
        ``num_conversations``, ``num_target_tokens``, ``max_token_id``), ``num_tokens``, ``num_conversations``,
        ``num_target_tokens``, ``source``, ``messages_field``, ``fingerprint``.

    Raises:
        ChatDataError: bad source records or tokenizer (see :func:`iter_conversations`,
            :func:`~kempnerforge.data.chat_template.tokenize_conversations`), nothing written.
        FileExistsError: ``output_dir`` is not empty and ``overwrite`` is False.
        ValueError: ``num_proc``, ``batch_size`` or ``shard_size`` below 1.
    """
    for name, value in (("num_proc", num_proc), ("batch_size", batch_size), ("shard_size", shard_size)):
        if value < 1:
            raise ChatDataError(name, f"{name} must be a positive integer, got {value}")
    tok = load_chat_tokenizer(tokenizer)
    fingerprint = chat_fingerprint(source, tokenizer, messages_field)
    conversations = iter_conversations(source, messages_field)
    first = next(conversations, None)  # a bad first record fails before output_dir is touched
    if first is None:
        raise ChatDataError("source", f"{source} holds no conversations (only blank lines)")
    out = Path(output_dir).expanduser().resolve()
    prepare_output_dir(out, overwrite)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    writer = _ChatShardWriter(out, shard_size, dtype)
    batches = _batches(first, conversations, batch_size)
    with contextlib.ExitStack() as stack:
        if num_proc > 1:  # ordered: the shards are the same for any num_proc
            ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            pool = stack.enter_context(ctx.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)))
            encoded = pool.imap(_encode_batch, batches)
        else:
            encoded = (_encode_batch(batch, tok) for batch in batches)
        bar = stack.enter_context(tqdm(unit="conv", desc="rendering", disable=not progress))
        for pairs in encoded:
            for ids, mask in pairs:
                writer.add(ids, mask)
            bar.update(len(pairs))
    writer.flush()
    shards = writer.shards
    metadata = {
        "format": CHAT_FORMAT,
        "tokenizer": tok.path,
        "chat_template_file": tok.template_file,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "shards": shards,
        **{k: sum(s[k] for s in shards) for k in ("num_tokens", "num_conversations", "num_target_tokens")},
        "max_token_id": max(s["max_token_id"] for s in shards),
        "source": str(Path(source).expanduser().resolve()),
        "messages_field": messages_field,
        "fingerprint": fingerprint,
    }
    atomic_write(out / METADATA_FILE, lambda f: f.write(json.dumps(metadata, indent=2).encode()))
    return metadata


_WORKER_TOKENIZER: list[ChatTokenizer] = []


def _init_worker(tokenizer: str) -> None:
    _WORKER_TOKENIZER[:] = [load_chat_tokenizer(tokenizer)]


def _encode_batch(batch: list[tuple[list[dict], str]], tok: ChatTokenizer | None = None) -> list:
    tok = tok if tok is not None else _WORKER_TOKENIZER[0]
    return tokenize_conversations(tok, [m for m, _ in batch], [w for _, w in batch])


def _batches(first: Any, rest: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch = [first]
    for item in rest:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def chat_fingerprint(source: str, tokenizer: str, messages_field: str) -> str:
    """:func:`~kempnerforge.data.sources.source_fingerprint` of a chat preparation (source files, tokenizer files
    including the chat template, ``messages_field``); distinct from any text preparation of the same files."""
    return source_fingerprint(source, tokenizer, f"{CHAT_FORMAT}:{messages_field}")
