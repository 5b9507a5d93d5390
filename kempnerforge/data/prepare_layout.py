"""Which part of the source each token shard holds, decided from the input alone (``kforge prepare-data``).

The source's items (its files in sorted path order, a ``save_to_disk`` table, or the shards of a
``load_dataset`` spec) are laid end to end as one range of ``total`` bytes. Shard ``u`` of
``U = ceil(total / shard_bytes)`` holds the source between ``cut(u * shard_bytes)`` and
``cut((u + 1) * shard_bytes)``, where :meth:`Layout.cut` moves an offset forward to the next place a
document, or a piece of one that tokenizes the same on its own, starts:

- ``.txt`` (one document per file): the next line end after a non-space character within
  :data:`LINE_SEARCH_BYTES`, else the next whitespace after a non-space character (byte-level BPE
  pre-tokenization splits there whatever follows, so the pieces' ids concatenate to the file's);
- ``.jsonl`` (one document per line): the next line start;
- ``.parquet``: the next row group; a ``save_to_disk`` table: the next row (rows get equal shares of
  the table's bytes); a JSON-array ``.json`` file and a spec's shard: the item's end (read whole).

``cut`` depends on the bytes at the offset only, and never moves backwards (a later offset never cuts
earlier), so every worker and every array part computes the same boundaries for the shards it writes,
whatever the number of workers, parts or the order they finish in (the layout Megatron-LM's
``preprocess_data.py --partitions`` and datatrove's readers get by splitting files; here large files
are split too).
"""

from __future__ import annotations

import bisect
import codecs
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Item kinds: how a shard's part of the item is read (see the module docstring). ``JSON``: a ``.json`` file, read as
#: :data:`JSONL` unless it holds one JSON array (then :data:`WHOLE`), decided when it is first read.
TEXT, JSONL, JSON, PARQUET, ROWS, WHOLE = "text", "jsonl", "json", "parquet", "rows", "whole"
#: A ``.txt`` cut prefers a line end this close to the offset (bytes) over the nearest whitespace.
LINE_SEARCH_BYTES = 1 << 20
_LINE_CUT = re.compile(r"(?<=\S)(?=[^\S\n]*\n)")
_SPACE_CUT = re.compile(r"(?<=\S)(?=\s)")
_BLOCK = 1 << 20
_FIRST_BLOCK = 1 << 14  # a boundary is usually a few bytes away: read little first, then up to _BLOCK at a time


@dataclass(frozen=True)
class Item:
    """One item of the source in layout order.

    Attributes:
        kind: :data:`TEXT`, :data:`JSONL`, :data:`JSON`, :data:`PARQUET`, :data:`ROWS` (a ``save_to_disk`` table by
            rows) or :data:`WHOLE` (a spec's shard, read whole through ``datasets``).
        path: the file (the folder of a ``save_to_disk`` table, ``""`` for a spec's shard).
        start: its first byte in the layout.
        size: bytes it spans in the layout (a file's size; rows x bytes per row for a table).
        shard: a spec's shard number (``datasets.IterableDataset.shard``); 0 otherwise.
        row_bytes: bytes per row of a :data:`ROWS` table (1 otherwise).
    """

    kind: str
    path: str
    start: int
    size: int
    shard: int = 0
    row_bytes: int = 1

    @property
    def end(self) -> int:
        """One past its last byte in the layout."""
        return self.start + self.size


@dataclass(frozen=True)
class Segment:
    """The part ``[begin, end)`` (bytes from the item's start) of ``item`` that one shard holds."""

    item: Item
    begin: int
    end: int

    @property
    def ends_item(self) -> bool:
        """The segment reaches the item's end (a ``.txt`` document ends here: EOS)."""
        return self.end == self.item.size


@dataclass(frozen=True)
class Layout:
    """The shards of one preparation and the source ranges they hold (pure function of the input and ``shard_bytes``).

    Attributes:
        items: the source's items in order, with their layout offsets.
        shard_bytes: layout bytes per shard before the cut moves its boundaries (> 0).
    """

    items: tuple[Item, ...]
    shard_bytes: int

    @property
    def total(self) -> int:
        """Layout bytes of the whole source."""
        return self.items[-1].end if self.items else 0

    @property
    def num_shards(self) -> int:
        """``max(1, ceil(total / shard_bytes))``; a shard whose range is empty writes no file."""
        return max(1, math.ceil(self.total / self.shard_bytes))

    @functools.cached_property
    def _ends(self) -> list[int]:
        return [it.end for it in self.items]  # non-decreasing: bisect finds an offset's item in O(log items)

    def cut(self, offset: int) -> int:
        """The first boundary at or after ``offset`` (see the module docstring); ``total`` past the end."""
        if offset <= 0:
            return 0
        if offset >= self.total:
            return self.total
        item = self.items[bisect.bisect_right(self._ends, offset)]  # the first item ending after offset: it holds it
        if offset == item.start:
            return offset
        return item.start + _item_cut(item, offset - item.start)

    def bounds(self, shard: int) -> tuple[int, int]:
        """Layout range ``[begin, end)`` of ``shard`` (the last one ends at ``total``).

        Raises:
            IndexError: ``shard`` outside ``[0, num_shards)``.
        """
        if not 0 <= shard < self.num_shards:
            raise IndexError(f"shard {shard} outside [0, {self.num_shards})")
        end = self.total if shard == self.num_shards - 1 else self.cut((shard + 1) * self.shard_bytes)
        return self.cut(shard * self.shard_bytes), end

    def segments(self, shard: int) -> list[Segment]:
        """The item ranges ``shard`` holds, in order. An empty item belongs to the shard whose range holds its
        start (the last shard holds those at ``total``), so it is counted exactly once."""
        begin, end = self.bounds(shard)
        last = shard == self.num_shards - 1
        out = []
        for item in self.items[bisect.bisect_left(self._ends, begin) :]:
            if item.start > end:
                break
            if item.size == 0:
                if begin <= item.start < end or (last and item.start == end):
                    out.append(Segment(item, 0, 0))
            elif item.start < end and item.end > begin:
                out.append(Segment(item, max(begin, item.start) - item.start, min(end, item.end) - item.start))
        return out

    def describe(self) -> list[list[Any]]:
        """``[[kind, path, size, shard], ...]``: what the layout reads, for the plan record."""
        return [[it.kind, it.path, it.size, it.shard] for it in self.items]


def _item_cut(item: Item, offset: int) -> int:
    """First boundary inside ``item`` at or after ``offset`` (0 < offset < size), bytes from the item's start."""
    kind = json_kind(item.path) if item.kind == JSON else item.kind
    if kind == TEXT:
        return text_cut(Path(item.path), offset, item.size)
    if kind == JSONL:
        return line_start(Path(item.path), offset, item.size)
    if kind == PARQUET:
        starts = row_group_starts(item.path)
        i = bisect.bisect_left(starts, offset)
        return starts[i] if i < len(starts) else item.size
    if kind == ROWS:
        return min(item.size, -(-offset // item.row_bytes) * item.row_bytes)
    return item.size  # WHOLE: read in one go


@functools.lru_cache(maxsize=64)
def json_kind(path: str) -> str:
    """:data:`WHOLE` for a ``.json`` file holding one JSON array (its first non-blank byte is ``[``), else
    :data:`JSONL` (one record per line, as ``datasets``' json reader takes it)."""
    with open(path, "rb") as f:
        while block := f.read(4096):
            head = block.lstrip()
            if head:
                return WHOLE if head[:1] == b"[" else JSONL
    return JSONL


@functools.lru_cache(maxsize=64)
def row_group_starts(path: str) -> tuple[int, ...]:
    """Byte offsets of the row groups of parquet file ``path``, ascending (the first page of each)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    starts = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        cols = [group.column(c) for c in range(group.num_columns)]
        starts.append(min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in cols))
    return tuple(starts)


def line_start(path: Path, offset: int, size: int) -> int:
    """Byte offset of the first line that starts at or after ``offset`` (``size`` when none does)."""
    with open(path, "rb") as f:
        f.seek(offset - 1)  # a line starts at `offset` when the byte before it ends a line
        pos, size_read = offset - 1, _FIRST_BLOCK
        while block := f.read(size_read):
            size_read = min(_BLOCK, 2 * size_read)
            nl = block.find(b"\n")
            if nl >= 0:
                return min(size, pos + nl + 1)
            pos += len(block)
    return size


def text_cut(path: Path, offset: int, size: int) -> int:
    """First byte offset ``>= offset`` of ``path`` (UTF-8 text) where it can be cut without changing its byte-level
    BPE tokenization: a line end after a non-space character within :data:`LINE_SEARCH_BYTES`, else the first
    whitespace after a non-space character, else ``size``. Both searches are exact (never cut short by a read
    block), so a later offset never cuts earlier.

    Raises:
        ValueError: the bytes read are not UTF-8.
    """
    with open(path, "rb") as f:
        begin = max(0, offset - 4)  # the character before `offset`, for the lookbehind
        f.seek(begin)
        head = f.read(offset - begin)
        lead = next((i for i, b in enumerate(head) if b & 0xC0 != 0x80), len(head))  # skip a partial character
        decoder = codecs.getincrementaldecoder("utf-8")()
        text = _decode(decoder, head[lead:], path, final=False)
        base = begin + lead  # byte offset of text[0]
        split = len(head) - lead > len(text.encode("utf-8"))  # `offset` falls inside a character
        first = len(text) + split  # index of the first character that starts at or after `offset`
        limit = offset + LINE_SEARCH_BYTES
        want_line, eof, size_read = True, False, _FIRST_BLOCK
        while True:
            if not eof:
                block = f.read(size_read)
                eof = len(block) < size_read
                size_read = min(_BLOCK, 2 * size_read)
                text += _decode(decoder, block, path, final=eof)
            if want_line:
                m = _LINE_CUT.search(text, first)
                if m is not None:
                    at = base + len(text[: m.start()].encode("utf-8"))
                    if at < limit:
                        return min(at, size)
                    want_line = False
                else:
                    # A whitespace run at the end may still reach a newline: decide once it ends (or EOF).
                    undecided = base + len(text[: len(text.rstrip())].encode("utf-8"))
                    read_to = base + len(text.encode("utf-8"))
                    if eof or (read_to >= limit and undecided >= limit):
                        want_line = False
                    else:
                        continue
            m = _SPACE_CUT.search(text, first)
            if m is not None:
                return min(base + len(text[: m.start()].encode("utf-8")), size)
            if eof:
                return size
            # Every position before the last character is decided (no cut): keep that one for the lookbehind.
            keep = len(text) - 1 if first <= len(text) else 0
            base += len(text[:keep].encode("utf-8"))
            text, first = text[keep:], (1 if keep else first)


def _decode(decoder: codecs.IncrementalDecoder, data: bytes, path: Path, final: bool) -> str:
    try:
        return decoder.decode(data, final)
    except UnicodeDecodeError as e:
        raise ValueError(f"source file {str(path)!r} is not UTF-8 text ({e})") from e


# --------------------------------------------------------------------------------------------
# The source's items
# --------------------------------------------------------------------------------------------

_SUFFIXES = {TEXT: (".txt",), JSON: (".json", ".jsonl"), PARQUET: (".parquet",)}
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_ALLOWED = "one .txt/.json/.jsonl/.parquet file, a folder of them, or a datasets.save_to_disk folder"


def source_items(source: str | dict[str, Any]) -> tuple[Item, ...]:
    """The items of ``source`` in layout order, with their offsets (reads file sizes only, plus a ``save_to_disk``
    table's row count or a spec's shard count).

    Accepted: a ``.txt`` file (one document); a ``.json``/``.jsonl``/``.parquet`` file; a folder of one of these
    kinds (recursive, sorted by path, hidden files skipped); a ``save_to_disk`` folder; a dict of local
    ``datasets.load_dataset`` arguments (:func:`~kempnerforge.data.sources.check_dataset_spec`).

    Raises:
        FileNotFoundError: ``source`` does not exist.
        ValueError: unsupported suffix, a folder without supported files, mixed kinds, or a non-local spec.
    """
    if isinstance(source, dict):
        return _spec_items(source)
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"source: {str(source)!r} does not exist")
    if path.is_dir() and any((path / m).is_file() for m in _HF_DISK_MARKERS):
        table = load_disk_table(str(path))
        rows = len(table)
        row_bytes = max(1, table.data.nbytes // max(1, rows))
        return (Item(ROWS, str(path), 0, rows * row_bytes, row_bytes=row_bytes),)
    found = {kind: _files(path, suffixes) for kind, suffixes in _SUFFIXES.items()}
    kinds = [k for k, files in found.items() if files]
    if not kinds:
        raise ValueError(f"source {str(source)!r}: no supported files; expected {_ALLOWED}")
    if len(kinds) > 1:
        raise ValueError(f"source {str(source)!r} mixes formats {kinds}; expected {_ALLOWED}")
    items, start = [], 0
    for f in found[kinds[0]]:
        size = f.stat().st_size
        items.append(Item(JSONL if f.suffix == ".jsonl" else kinds[0], str(f), start, size))
        start += size
    return tuple(items)


def _files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix in suffixes else []
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes and not p.name.startswith("."))


def _spec_items(spec: dict[str, Any]) -> tuple[Item, ...]:
    """One :data:`WHOLE` item per shard of the spec's streaming dataset, sharing its files' bytes equally."""
    from kempnerforge.data.sources import check_dataset_spec

    paths = check_dataset_spec(spec)
    files = {f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()}
    total = sum(f.stat().st_size for f in files)
    n = load_spec_dataset(spec).num_shards
    sizes = [total // n + (i < total % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return tuple(
        Item(WHOLE, "", start, size, shard=i) for i, (start, size) in enumerate(zip(starts, sizes, strict=True))
    )


def load_spec_dataset(spec: dict[str, Any]) -> Any:
    """``datasets.load_dataset(**spec, streaming=True)`` (local data only)."""
    from kempnerforge.data.sources import load_local_dataset

    return load_local_dataset(spec, streaming=True)


def load_disk_table(path: str) -> Any:
    """The table of a ``save_to_disk`` folder: the dataset itself, the ``train`` split, or the only split.

    Raises:
        ValueError: a ``DatasetDict`` with several splits and none named ``train``.
    """
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise ValueError(f"source {path!r} holds splits {sorted(ds)}; expected one split or 'train'")
    return ds
