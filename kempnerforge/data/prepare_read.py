"""The documents one token shard holds, read from its segments of the source (``kforge prepare-data``).

:class:`ShardPieces` yields ``(text, ends_document)`` pairs: a ``.txt`` file is one document read in pieces of about
``chunk_chars`` characters cut where its tokenization does not change (EOS only at the file's end, which may lie in
a later shard); every other kind gives one document per row (``text_field``). A row without the field counts as
missing (reported, not dropped silently); a non-string value is an error naming the field.
"""

from __future__ import annotations

import codecs
import functools
import json
import logging
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kempnerforge.data.prepare_layout import (
    JSON,
    JSONL,
    PARQUET,
    ROWS,
    TEXT,
    WHOLE,
    Item,
    Segment,
    json_kind,
    load_disk_table,
    load_spec_dataset,
    row_group_starts,
)

# A cut just before a whitespace run that follows a non-space character leaves byte-level BPE
# pre-tokenization (GPT-2 / Llama-3 regexes) unchanged: the run's split depends only on what follows
# it, and the token before it ends at the whitespace either way. Prefer paragraph breaks.
_CUT_PATTERNS = (re.compile(r"\S(?=\n[ \t]*\n)"), re.compile(r"\S(?=\n)"), re.compile(r"\S(?=\s)"))


def cut_point(buf: str) -> int | None:
    """Index at which ``buf`` can be split without changing its tokenization (the last paragraph break, else line
    end, else whitespace after a non-space character), or None."""
    for pattern in _CUT_PATTERNS:
        last = deque(pattern.finditer(buf), maxlen=1)  # keeps only the last match
        if last:
            return last[0].end()
    return None


class ShardPieces:
    """Iterable of ``(text, ends_document)`` over ``segments`` (one shard's part of the source), in order.

    Args:
        segments: from :meth:`~kempnerforge.data.prepare_layout.Layout.segments`.
        source: the ``source`` argument (a path or a ``load_dataset`` spec), for a spec's shards and messages.
        text_field: the column holding the text (rows).
        chunk_chars: about this many characters per ``.txt`` piece.
        batch_size: rows per read from a table.

    Attributes:
        missing: rows read so far without ``text_field`` (or with a null value).

    Raises (while iterating):
        ValueError: a file that is not UTF-8, a jsonl line that is not JSON or not an object (names file and line).
        KeyError: ``text_field`` is not a column of a table (lists the columns).
        TypeError: a value of ``text_field`` that is not a string.
    """

    def __init__(
        self, segments: list[Segment], source: Any, text_field: str, chunk_chars: int, batch_size: int
    ) -> None:
        self.segments, self.source, self.text_field = segments, source, text_field
        self.chunk_chars, self.batch_size = chunk_chars, batch_size
        self.missing = 0

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        for seg in self.segments:
            kind = json_kind(seg.item.path) if seg.item.kind == JSON else seg.item.kind
            if kind == TEXT:
                yield from text_pieces(Path(seg.item.path), seg.begin, seg.end, seg.item.size, self.chunk_chars)
            else:
                yield from self._documents(self._values(seg, kind), seg.item)

    def _values(self, seg: Segment, kind: str) -> Iterator[Any]:
        if kind == JSONL:
            return jsonl_values(Path(seg.item.path), seg.begin, seg.end, self.text_field)
        if kind == PARQUET:
            return parquet_values(seg.item.path, seg.begin, seg.end, self.text_field, self.batch_size)
        if kind == ROWS:
            rows = range(seg.begin // seg.item.row_bytes, seg.end // seg.item.row_bytes)
            table = load_disk_table(seg.item.path).select(rows)
            return datasets_values(table, self.text_field, seg.item.path, self.batch_size)
        if kind == WHOLE and seg.item.path:  # a JSON-array file
            return datasets_values(_json_array(seg.item.path), self.text_field, seg.item.path, self.batch_size)
        ds = _spec_dataset(json.dumps(self.source, sort_keys=True))
        part = ds.shard(num_shards=ds.num_shards, index=seg.item.shard)
        return datasets_values(part, self.text_field, repr(self.source), self.batch_size)

    def _documents(self, values: Iterator[Any], item: Item) -> Iterator[tuple[str, bool]]:
        for text in values:
            if text is None:
                self.missing += 1
            elif not isinstance(text, str):
                where = item.path or repr(self.source)
                raise TypeError(f"text_field={self.text_field!r} of {where!r} holds {type(text).__name__}, not str")
            else:
                yield text, True


def text_pieces(path: Path, begin: int, end: int, size: int, chunk_chars: int) -> Iterator[tuple[str, bool]]:
    """Bytes ``[begin, end)`` of a UTF-8 text file as pieces cut by :func:`cut_point`; the last piece ends the
    document when ``end == size`` (an empty file is one empty document).

    Raises:
        ValueError: the file is not UTF-8 text.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, left = "", end - begin
    with open(path, "rb") as f:
        f.seek(begin)
        while left > 0:
            block = f.read(min(chunk_chars, left))
            if not block:
                break
            left -= len(block)
            try:
                buf += decoder.decode(block, final=left == 0)
            except UnicodeDecodeError as e:
                raise ValueError(f"source file {str(path)!r} is not UTF-8 text ({e})") from e
            cut = cut_point(buf) if len(buf) >= chunk_chars else None
            if cut:
                yield buf[:cut], False
                buf = buf[cut:]
    yield buf, end == size


def jsonl_values(path: Path, begin: int, end: int, text_field: str) -> Iterator[Any]:
    """``record.get(text_field)`` of every non-blank line starting in ``[begin, end)`` (``begin`` is a line start).

    Raises:
        ValueError: a line that is not JSON or not a JSON object (names the file and its 1-based line number).
    """
    with open(path, "rb") as f:
        f.seek(begin)
        pos = begin
        for line in f:
            if pos >= end:
                break
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))  # a str skips json's encoding detection
            except UnicodeDecodeError as bad:
                n = _line_number(path, start)
                raise ValueError(f"source {str(path)!r} line {n} is not UTF-8 ({bad.reason})") from bad
            except json.JSONDecodeError as bad:
                n = _line_number(path, start)
                raise ValueError(
                    f"source {str(path)!r} line {n} is not JSON ({bad.msg}); fix or remove that line"
                ) from bad
            if not isinstance(record, dict):
                n = _line_number(path, start)
                raise ValueError(f"source {str(path)!r} line {n} is not a JSON object (one record per line)")
            yield record.get(text_field)


def _line_number(path: Path, offset: int) -> int:
    """1-based number of the line starting at byte ``offset`` (read only when reporting an error)."""
    count = 1
    with open(path, "rb") as f:
        while offset > 0 and (block := f.read(min(offset, 1 << 20))):
            count += block.count(b"\n")
            offset -= len(block)
    return count


def parquet_values(path: str, begin: int, end: int, text_field: str, batch_size: int) -> Iterator[Any]:
    """``text_field`` of every row of the row groups starting in ``[begin, end)`` of a parquet file.

    Raises:
        KeyError: ``text_field`` is not a column (lists the columns).
    """
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise KeyError(f"text_field={text_field!r} is not a column of {path!r}; columns: {sorted(names)}")
    groups = [g for g, start in enumerate(row_group_starts(path)) if begin <= start < end]
    if groups:
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=groups, columns=[text_field]):
            yield from batch.column(0).to_pylist()


def datasets_values(dataset: Any, text_field: str, source: str, batch_size: int) -> Iterator[Any]:
    """``text_field`` of every row of a ``datasets`` table or stream.

    Raises:
        KeyError: ``text_field`` is not a column (lists the columns).
        ValueError: a json file that does not parse (the reader's error, in one line).
    """
    columns = dataset.column_names  # None for a stream whose schema is unknown until read
    if columns is not None:
        if text_field not in columns:
            raise KeyError(f"text_field={text_field!r} is not a column of {source!r}; columns: {sorted(columns)}")
        dataset = dataset.select_columns([text_field])
    # datasets' json reader logs a parse error itself before raising: the one line below says it instead.
    reader_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = reader_log.level
    reader_log.setLevel(logging.CRITICAL)
    try:
        for batch in dataset.iter(batch_size=batch_size):
            if text_field not in batch:
                raise KeyError(f"text_field={text_field!r} is not a column of {source!r}; columns: {sorted(batch)}")
            yield from batch[text_field]
    except Exception as err:
        if type(err).__name__ not in ("ArrowInvalid", "DatasetGenerationError", "JSONDecodeError"):
            raise
        raise ValueError(f"source {source!r} does not parse as JSON ({' '.join(str(err).split())[:200]})") from err
    finally:
        reader_log.setLevel(level)


@functools.lru_cache(maxsize=4)
def _spec_dataset(spec_json: str) -> Any:
    return load_spec_dataset(json.loads(spec_json))


def _json_array(path: str) -> Any:
    import datasets

    return datasets.load_dataset("json", data_files=[path], split="train", streaming=True)
