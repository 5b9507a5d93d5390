"""Checksums of a checkpoint's files: computed while each file is written, recorded per rank, checked on read.

DCP has no checksum of its own, so bytes overwritten inside a shard load silently (a model of NaNs). Every
file a save writes goes through a :class:`HashingStream` (DCP's shards and ``.metadata`` through
:class:`ChecksumFileSystemWriter`, ``meta.pt`` and the rank files through :func:`save_hashed`), which hashes
the bytes on their way to the file, in blocks of :data:`BLOCK` bytes: nothing is read back. Each rank then writes
its own record, ``checksums_<rank>.json`` (:func:`write_manifest`), naming the files it wrote with their size and
block digests; rank 0's also holds ``.metadata`` and ``meta.pt``. No rank reads another rank's files for it.

On load every rank checks what it reads before it is used: ``meta.pt``, its state file and DCP's ``.metadata`` whole
(:meth:`Manifests.check`), and of the shard files only the blocks that hold the items of its read plan, hashed
from the same bytes DCP deserializes (:class:`~kempnerforge.checkpoint.verified_read.VerifiedFile`, one read per
byte). A file's record is found in the writer's record only (the rank is in the file's name:
``__<rank>_<i>.distcp``, ``rank_<rank>.pt``; rank 0 for the rest), so a rank reads two or three small JSON files,
whatever the world size.

Algorithm: xxHash's XXH3-64 (the ``xxhash`` package; several GB/s per core, so hashing is a small part of a
save's time: ``benchmarks/ckpt_checksum.py``, ``benchmarks/checkpoint_io.py``); ``zlib.crc32`` from the standard
library where ``xxhash`` is not installed. The record names the algorithm, so either kind reads back wherever its
algorithm is available. Records written before block digests (one ``digest`` per file) are checked file by file.

A checkpoint without any record (written before checksums existed) still loads; it cannot be verified, and
:func:`has_checksums` lets the caller say so once.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import re
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from kempnerforge.checkpoint.errors import CorruptCheckpointError

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; the fallback keeps a bare install working
    xxhash = None

__all__ = [
    "ALGORITHM",
    "BLOCK",
    "COMPLETE_LINE",
    "ChecksumFileSystemWriter",
    "HashingStream",
    "Manifests",
    "has_checksums",
    "manifest_file",
    "save_hashed",
    "write_manifest",
]

#: The algorithm new records use: ``xxh3_64`` when ``xxhash`` is installed, else ``crc32`` (zlib).
ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"

_CHUNK = 8 << 20  # bytes hashed per read when a file is checked

#: Bytes per checksummed block of a file (the last block may be shorter). A reader verifies the blocks its reads
#: touch: at most one block beyond an item at either end, shared with the neighbouring item.
BLOCK = 1 << 20


class _Crc32:
    """``zlib.crc32`` behind the ``update`` / ``hexdigest`` interface of ``xxhash``'s hashers."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algorithm: str = ALGORITHM) -> Any:
    """A fresh hasher for ``algorithm`` (``xxh3_64`` or ``crc32``).

    Raises:
        ValueError: an unknown algorithm, or ``xxh3_64`` without the ``xxhash`` package.
    """
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    raise ValueError(f"checksum algorithm {algorithm!r} is not available here (install xxhash for xxh3_64)")


class BlockHasher:
    """Digests of a byte stream in consecutive blocks of ``block`` bytes (the last one may be shorter).

    Args:
        algorithm: as :func:`new_hasher`.
        block: bytes per block.
    """

    def __init__(self, algorithm: str = ALGORITHM, block: int = BLOCK) -> None:
        self.algorithm, self.block = algorithm, block
        self.digests: list[str] = []
        self._hasher = new_hasher(algorithm)
        self._fill = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block - self._fill)
            self._hasher.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == self.block:
                self.digests.append(self._hasher.hexdigest())
                self._hasher, self._fill = new_hasher(self.algorithm), 0

    def finish(self) -> list[str]:
        """The block digests (the partial last block's included); call once, after the last update."""
        if self._fill:
            self.digests.append(self._hasher.hexdigest())
            self._fill = 0
        return self.digests


def manifest_file(path: Path, rank: int) -> Path:
    """Rank ``rank``'s checksum record inside checkpoint ``path``."""
    return path / f"checksums_{rank:05d}.json"


#: The line of a checkpoint's ``COMPLETE`` marker that says its files carry checksums.
COMPLETE_LINE = f"checksums={ALGORITHM}"


def has_checksums(path: Path) -> bool:
    """True when checkpoint ``path`` records checksums: its ``COMPLETE`` marker says so, or rank 0's record is there
    (a deleted record then reads as missing, never as a checkpoint from before checksums)."""
    if manifest_file(path, 0).is_file():
        return True
    try:
        return "checksums=" in (path / "COMPLETE").read_text()
    except (OSError, UnicodeDecodeError):
        return False


class HashingStream(io.RawIOBase):
    """A binary write stream that hashes every byte written to ``raw`` on its way through, in blocks of
    :data:`BLOCK` bytes.

    ``tell`` is this stream's own count (it equals ``raw.tell()`` for a file opened for writing). A ``seek``
    (no writer used here seeks, but ``torch.save`` may on a seekable stream) marks the digests unknown, and
    :meth:`digest` then reads the file back once.

    Args:
        raw: the open file, mode ``wb``.
        algorithm: as :func:`new_hasher`.
    """

    def __init__(self, raw: Any, algorithm: str = ALGORITHM) -> None:
        super().__init__()
        self.raw = raw
        self.algorithm = algorithm
        self._hasher = BlockHasher(algorithm)
        self._pos = 0
        self._linear = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # torch.save then writes linearly, never seeking back to patch headers

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self._hasher.update(view[:written])
        self._pos += written
        return written

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._linear = False
        self._pos = self.raw.seek(offset, whence)
        return self._pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        # The underlying file is closed by whoever opened it.
        self.flush()
        super().close()

    def digest(self, file: Path | None = None) -> list[str]:
        """The block digests of everything written (``file`` is read back only after a ``seek``)."""
        if self._linear or file is None:
            return self._hasher.finish()
        return file_blocks(file, self.algorithm)[1]


def file_digest(file: Path, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """``(size in bytes, hex digest)`` of ``file`` as one piece (records written before block digests)."""
    hasher = new_hasher(algorithm)
    size = 0
    for piece in _pieces(file):
        hasher.update(piece)
        size += len(piece)
    return size, hasher.hexdigest()


def file_blocks(file: Path, algorithm: str = ALGORITHM, block: int = BLOCK) -> tuple[int, list[str]]:
    """``(size in bytes, block digests)`` of ``file`` (blocks of ``block`` bytes, as :class:`HashingStream`)."""
    hasher = BlockHasher(algorithm, block)
    size = 0
    for piece in _pieces(file):
        hasher.update(piece)
        size += len(piece)
    return size, hasher.finish()


def _pieces(file: Path) -> Iterator[memoryview]:
    with open(file, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            yield view[:n]


class Record:
    """The files one rank wrote into a checkpoint: name -> ``{"size": bytes, "block_size": bytes, "blocks": [hex]}``
    (thread-safe: DCP's writer threads and the training thread add to it)."""

    def __init__(self) -> None:
        self.files: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, size: int, blocks: list[str]) -> None:
        with self._lock:
            self.files[name] = {"size": size, "block_size": BLOCK, "blocks": blocks}

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)


@contextmanager
def hashed(raw: Any, file: Path, record: Record) -> Iterator[HashingStream]:
    """Write to the open file ``raw`` (``file``) through a :class:`HashingStream`; its size and digest go into
    ``record`` once the block ends."""
    stream = HashingStream(raw)
    yield stream
    stream.flush()
    record.add(file.name, stream.tell(), stream.digest(file))


@contextmanager
def hashed_open(file: Path, record: Record) -> Iterator[HashingStream]:
    """Open ``file`` for writing through a :class:`HashingStream` (as :func:`hashed`)."""
    with open(file, "wb") as raw, hashed(raw, file, record) as stream:
        yield stream


def save_hashed(obj: Any, file: Path, record: Record) -> None:
    """``torch.save(obj)`` to ``file``, hashed while written (into ``record``)."""
    with hashed_open(file, record) as stream:
        torch.save(obj, stream)


def _entries_digest(files: dict[str, Any], algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(json.dumps(files, sort_keys=True).encode())
    return hasher.hexdigest()


def write_manifest(path: Path, rank: int, record: Record) -> None:
    """Write rank ``rank``'s record into checkpoint directory ``path`` (a temporary file, then a rename).

    The record carries a digest of its own entries, so a damaged record is told from a damaged file.
    """
    files = dict(sorted(record.files.items()))
    body = {"algorithm": ALGORITHM, "rank": rank, "files": files, "self": _entries_digest(files, ALGORITHM)}
    target = manifest_file(path, rank)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, target)


_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_FILE = re.compile(r"^rank_(\d+)\.pt$")


def writer_rank(name: str) -> int:
    """The rank that wrote the checkpoint file ``name`` (DCP shards and rank files name it; rank 0 otherwise)."""
    match = _SHARD.match(name) or _RANK_FILE.match(name)
    return int(match.group(1)) if match else 0


def block_reason(entry: dict[str, Any], index: int, digest: str, algorithm: str) -> str:
    """Why block ``index`` of a file recorded as ``entry`` is bad: its byte range and both digests."""
    lo = index * entry["block_size"]
    hi = min(lo + entry["block_size"], entry["size"])
    want = entry["blocks"][index] if index < len(entry["blocks"]) else "none"
    return f"fails its checksum in bytes [{lo}, {hi}) ({algorithm} {digest}, written as {want})"


class Manifests:
    """The checksum records of checkpoint ``path``, read on demand (only the records of files checked).

    Args:
        path: the checkpoint directory.
        context: errors start with ``checkpoint <path> is corrupt:`` (False: with the file's path alone, for a
            caller that puts the checkpoint around it, as the strategy does for DCP's read errors).
    """

    def __init__(self, path: Path, context: bool = True) -> None:
        self.path = Path(path)
        self.context = context
        self.enabled = has_checksums(self.path)
        self._records: dict[int, dict[str, Any]] = {}
        self.checked: set[str] = set()  # files verified whole by this instance (and its siblings)

    def sibling(self, context: bool) -> Manifests:
        """The same records and checked files (shared, not copied), with errors prefixed or not (``context``)."""
        other = copy.copy(self)
        other.context = context
        return other

    def record(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s record (its ``files`` and ``algorithm``).

        Raises:
            CorruptCheckpointError: the record is missing, not JSON, or its own digest does not match.
        """
        if rank not in self._records:
            file = manifest_file(self.path, rank)
            try:
                body = json.loads(file.read_text())
                ok = _entries_digest(body["files"], body["algorithm"]) == body["self"]
            except FileNotFoundError as err:
                raise self.corrupt(file, "is missing (the checkpoint records checksums)") from err
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise self.corrupt(file, f"cannot be read ({type(err).__name__}: {err})") from err
            if not ok:
                raise self.corrupt(file, "is damaged (its own checksum does not match)")
            self._records[rank] = body
        return self._records[rank]

    def corrupt(self, file: Path, reason: str) -> CorruptCheckpointError:
        """The error naming ``file`` and ``reason`` (prefixed with the checkpoint when this instance says so)."""
        prefix = f"checkpoint {self.path} is corrupt: " if self.context else ""
        return CorruptCheckpointError(f"{prefix}{file} {reason}", file)

    def check(self, name: str) -> None:
        """Check file ``name`` of the checkpoint, all of it, against its writer's record (nothing without records);
        a file that passed is not read again by this instance.

        Raises:
            CorruptCheckpointError: the file is not in its writer's record, is missing, has another size (a
                truncated or swapped file) or another checksum (overwritten bytes); names the file.
        """
        if not self.enabled or name in self.checked:
            return
        entry, algorithm = self.entry(name)
        file = self.path / name
        if "blocks" in entry:
            _, blocks = file_blocks(file, algorithm, entry["block_size"])
            for index, (got, want) in enumerate(itertools.zip_longest(blocks, entry["blocks"])):
                if got != want:
                    raise self.corrupt(file, block_reason(entry, index, got or "none", algorithm))
        else:
            size, digest = file_digest(file, algorithm)
            if digest != entry["digest"] or size != entry["size"]:
                raise self.corrupt(file, f"fails its checksum ({algorithm} {digest}, written as {entry['digest']})")
        self.checked.add(name)

    def entry(self, name: str) -> tuple[dict[str, Any], str]:
        """File ``name``'s entry in its writer's record and the record's algorithm, after checking that the file
        is there with the size that was written (checkpoints with records only).

        Raises:
            CorruptCheckpointError: the file is not in its writer's record, is missing, or has another size.
        """
        body = self.record(writer_rank(name))
        entry = body["files"].get(name)
        file = self.path / name
        if entry is None:
            raise self.corrupt(file, f"is not in {manifest_file(self.path, writer_rank(name)).name}")
        if not file.is_file():
            raise self.corrupt(file, "is missing")
        have = file.stat().st_size
        if have != entry["size"]:
            raise self.corrupt(file, f"has {have} bytes; {entry['size']} were written")
        return entry, body["algorithm"]

    def block_reason(self, entry: dict[str, Any], index: int, digest: str) -> str:
        """Why block ``index`` of a file with record ``entry`` is bad (its byte range and both digests)."""
        lo = index * entry["block_size"]
        hi = min(lo + entry["block_size"], entry["size"])
        algorithm = self._records.get(0, {}).get("algorithm", ALGORITHM)
        want = entry["blocks"][index] if index < len(entry["blocks"]) else "none"
        return f"fails its checksum in bytes [{lo}, {hi}) ({algorithm} {digest}, written as {want})"

    def check_all(self, world_size: int) -> list[CorruptCheckpointError]:
        """Check every file that the records of ranks ``0 .. world_size - 1`` name (``kforge check-ckpt``).

        Returns:
            One error per bad file or record (empty when the checkpoint is whole or has no records).
        """
        if not self.enabled:
            return []
        errors: list[CorruptCheckpointError] = []
        for rank in range(world_size):
            try:
                names = sorted(self.record(rank)["files"])
            except CorruptCheckpointError as err:
                errors.append(err)
                continue
            for name in names:
                try:
                    self.check(name)
                except CorruptCheckpointError as err:
                    errors.append(err)
        return errors


class _HashingFileSystem(FileSystem):
    """DCP's local filesystem whose write streams are hashed into ``record`` (renames follow the record)."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw, hashed(raw, Path(path), self.record) as stream:
            yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes ``.metadata.tmp`` and renames it
        self.record.rename(Path(path).name, Path(new_path).name)


#: Files each rank writes its shards into, one writer thread each (DCP's ``thread_count``): ``torch.save``'s
#: serialization and CRC-32, the hashing and the page-cache copies of one file overlap the other's (a 1.9 GB save
#: on this 2-core machine: 1.5 GB/s with one thread, 1.8-1.9 with two; ``benchmarks/checkpoint_io.py``).
WRITER_THREADS = 2


class ChecksumFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that hashes each shard file and ``.metadata`` while writing them, each rank's
    shards in :data:`WRITER_THREADS` files written by as many threads (each file fsync-ed).

    Args:
        path: the checkpoint directory being written.
        record: where the files' sizes and digests go (then :func:`write_manifest`).
        thread_count: writer threads (and files) per rank.
    """

    def __init__(self, path: str | os.PathLike, record: Record, thread_count: int = WRITER_THREADS) -> None:
        super().__init__(path, thread_count=thread_count)
        self.fs = _HashingFileSystem(record)
