"""Check a complete checkpoint's files before anything is restored from it, and name the file that is bad.

A ``COMPLETE`` marker says every rank finished writing; it does not say the files are still whole (a
filesystem that lost the tail of a shard, a shard deleted by hand, a truncated copy). Restoring from such a
checkpoint fails halfway, in the middle of DCP's read, with ``PytorchStreamReader failed reading zip
archive`` and no file name. :func:`verify_checkpoint` finds those cases from sizes and headers, without
reading a tensor: the DCP ``.metadata`` unpickles, every shard file it names exists and holds the bytes the
metadata places in it, ``meta.pt`` loads (``weights_only``), and every rank's state file is a whole zip
archive. What it cannot see (bytes overwritten inside a shard) surfaces during the load, where
:class:`NamingFileSystemReader` puts the file's name on the error.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from kempnerforge.checkpoint.errors import CheckpointError, CorruptCheckpointError
from kempnerforge.checkpoint.layout import META_FILE, rank_file

__all__ = ["CorruptCheckpointError", "NamingFileSystemReader", "describe_failure", "verify_checkpoint"]

DCP_METADATA = ".metadata"


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


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file of the complete checkpoint ``path`` (see the module docstring); reads no tensor.

    Args:
        path: a checkpoint directory (holding ``COMPLETE``).

    Returns:
        Its ``meta.pt`` contents (the caller would read them next).

    Raises:
        CorruptCheckpointError: names the first bad file and what is wrong with it (missing, ``N`` bytes where the
            metadata needs ``M``, not a whole zip archive, or the unpickling error).
    """
    path = Path(path)
    for name, size in sorted(shard_sizes(path).items()):
        file = path / name
        if not file.is_file():
            raise _corrupt(path, file, "is missing (the DCP metadata lists it)")
        have = file.stat().st_size
        if have < size:
            raise _corrupt(path, file, f"is truncated: {have} bytes, the DCP metadata needs at least {size}")
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
    """``FileSystemReader`` whose errors name the shard file that failed (:class:`CorruptCheckpointError`)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.fs = _NamingFileSystem()


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
