"""Check a complete checkpoint's files before anything is restored from it, and name the file that is bad.

A ``COMPLETE`` marker says every rank finished writing; it does not say the files are still whole (a
filesystem that lost the tail of a shard, a shard deleted by hand, a truncated copy). Restoring from such a
checkpoint fails halfway, in the middle of DCP's read, with ``PytorchStreamReader failed reading zip
archive`` and no file name. :func:`verify_checkpoint` finds those cases from sizes and headers, without
reading a tensor: the DCP ``.metadata`` unpickles, every shard file it names exists and holds the bytes the
metadata places in it, ``meta.pt`` loads (``weights_only``), and every rank's state file is a whole zip
archive; ``.metadata`` and ``meta.pt`` are checked against their checksums first
(:mod:`kempnerforge.checkpoint.checksum`). Bytes overwritten inside a shard or a rank file are caught by the rank
that reads it, before DCP uses it (:class:`NamingFileSystemReader`, which also puts the file's name on any read
error), and :func:`check_checkpoint` checks every file's checksum (``kforge check-ckpt``).
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from typing_extensions import override

from kempnerforge.checkpoint.checksum import Manifests
from kempnerforge.checkpoint.errors import CheckpointError, CorruptCheckpointError
from kempnerforge.checkpoint.layout import META_FILE, rank_file

__all__ = [
    "CorruptCheckpointError",
    "NamingFileSystemReader",
    "check_checkpoint",
    "describe_failure",
    "unverified_warning",
    "verify_checkpoint",
]

DCP_METADATA = ".metadata"

log = logging.getLogger(__name__)


def _corrupt(path: Path, file: Path, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {path} is corrupt: {file} {reason}", file)


def _load(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def shard_sizes(path: Path) -> dict[str, int]:
    """Bytes each DCP storage file of checkpoint ``path`` must hold at least (from its ``.metadata``).

    Raises:
        CorruptCheckpointError: ``.metadata`` is missing or does not unpickle.
    """
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise _corrupt(path, path / DCP_METADATA, f"cannot be read ({type(err).__name__}: {err})") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def unverified_warning(path: Path) -> str:
    """The one warning for a checkpoint written before checksums were recorded."""
    return (
        f"checkpoint {path} has no checksums (written before kempnerforge recorded them): its files cannot be "
        "verified; overwritten bytes would load unnoticed"
    )


def verify_checkpoint(path: str | Path, warn: bool = True) -> dict[str, Any]:
    """Check the complete checkpoint ``path`` without reading a tensor: ``.metadata`` and ``meta.pt`` against their
    checksums, then that every shard file exists with the bytes the metadata places in it and every rank's state
    file is a whole zip archive (the shards' own checksums are checked by the rank that reads them,
    :class:`NamingFileSystemReader`; all of them by :func:`check_checkpoint`).

    Args:
        path: a checkpoint directory (holding ``COMPLETE``).
        warn: log :func:`unverified_warning` when the checkpoint records no checksums.

    Returns:
        Its ``meta.pt`` contents (the caller would read them next).

    Raises:
        CorruptCheckpointError: names the first bad file and what is wrong with it (missing, fails its checksum,
            ``N`` bytes where the metadata needs ``M``, not a whole zip archive, or the unpickling error).
    """
    path = Path(path)
    manifests = Manifests(path)
    if not manifests.enabled and warn:
        log.warning("%s.", unverified_warning(path))
    manifests.check(DCP_METADATA)
    for name, size in sorted(shard_sizes(path).items()):
        file = path / name
        if not file.is_file():
            raise _corrupt(path, file, "is missing (the DCP metadata lists it)")
        have = file.stat().st_size
        if have < size:
            raise _corrupt(path, file, f"is truncated: {have} bytes, the DCP metadata needs at least {size}")
    manifests.check(META_FILE)
    try:
        meta = _load(path / META_FILE)
    except Exception as err:
        raise _corrupt(path, path / META_FILE, f"cannot be loaded ({type(err).__name__}: {err})") from err
    for rank in range(int(meta.get("world_size", 1))):
        file = rank_file(path, rank)
        if not file.is_file():
            raise _corrupt(path, file, "is missing (the checkpoint was written by more ranks)")
        try:
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as err:
            raise _corrupt(path, file, f"is not a whole torch.save archive ({err})") from err
        if bad is not None:
            raise _corrupt(path, file, f"has a damaged member {bad!r}")
    return meta


def check_checkpoint(path: str | Path) -> tuple[list[CorruptCheckpointError], bool]:
    """Everything wrong with checkpoint ``path``, one error per bad file (``kforge check-ckpt``): reads every file
    once (every rank's records, so meant for one process, not for a training run's ranks).

    Returns:
        ``(errors, verified)``: the bad files (empty when whole), and False when the checkpoint records no
        checksums (then only its structure was checked).
    """
    path = Path(path)
    manifests = Manifests(path)
    errors: list[CorruptCheckpointError] = []
    try:
        meta = verify_checkpoint(path, warn=False)
    except CorruptCheckpointError as err:
        errors.append(err)
        meta = None
    if manifests.enabled:
        world = int(meta.get("world_size", 1)) if meta is not None else _recorded_ranks(path)
        seen = {err.file for err in errors}
        errors += [err for err in manifests.check_all(world) if err.file not in seen]
    return errors, manifests.enabled


def _recorded_ranks(path: Path) -> int:
    # meta.pt is unreadable: every record present counts.
    ranks = [int(f.stem.removeprefix("checksums_")) for f in path.glob("checksums_*.json")]
    return max(ranks, default=0) + 1


class _NamingFileSystem(FileSystem):
    """DCP's local filesystem, whose read errors name the file they come from."""

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except CorruptCheckpointError:
            raise
        except Exception as err:
            if "r" not in mode:
                raise
            raise CorruptCheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}", Path(path)) from err


class NamingFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that checks each file it reads against the checkpoint's checksum records before
    using it (``.metadata`` before unpickling it, the shard files of this rank's read plan before reading a
    tensor; :class:`~kempnerforge.checkpoint.checksum.Manifests`), and whose errors name the file that failed
    (:class:`CorruptCheckpointError`). A checkpoint without records is read unchecked.

    Args:
        path: the checkpoint directory.
        verify: check checksums (False: only name the failing file, as before checksums existed).
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        super().__init__(path)
        self.fs = _NamingFileSystem()
        self.manifests = Manifests(Path(path), context=False) if verify else None
        self._metadata_error: CorruptCheckpointError | None = None

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._metadata_error is not None:
            # DCP retries a failed global .metadata as a per-rank one; keep the first, file-naming error.
            raise self._metadata_error
        if self.manifests is not None and kwargs.get("rank") is None:
            try:
                self.manifests.check(DCP_METADATA)
            except CorruptCheckpointError as err:
                self._metadata_error = err
                raise
        return super().read_metadata(*args, **kwargs)

    @override
    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.manifests is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                self.manifests.check(name)
        return super().read_data(plan, planner)


def first_failure(err: BaseException) -> BaseException:
    """The first rank's exception inside a DCP ``CheckpointException`` (``err`` itself otherwise)."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def describe_failure(err: BaseException) -> str:
    """One line for a failed load: the file-naming error when there is one, else the exception's type and text."""
    inner = first_failure(err)
    text = " ".join(str(inner).split())
    return text if isinstance(inner, CheckpointError) else f"{type(inner).__name__}: {text}"
