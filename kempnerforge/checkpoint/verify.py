"""Check a complete checkpoint's files before anything is restored from it, and name the file that is bad.

A ``COMPLETE`` marker says every rank finished writing; it does not say the files are still whole (a
filesystem that lost the tail of a shard, a shard deleted by hand, a truncated copy). Restoring from such a
checkpoint fails halfway, in the middle of DCP's read, with ``PytorchStreamReader failed reading zip
archive`` and no file name.

A restore checks, on every rank, the files that rank reads and nothing else, before it uses them: its state
files before DCP (:func:`verify_rank_files`: ``.metadata``, ``meta.pt`` and its own ``rank_<r>.pt`` against their
checksums, the state file a whole zip archive), then the shard files of its DCP read plan
(:class:`NamingFileSystemReader`: each one's size against the DCP metadata and its checksum, before a tensor of it
is used, and any read error names the file). With the world size it was saved at, a rank reads its own shard
file; resharded (another world size or layout), the shards holding its elements, whichever rank wrote them. The
ranks' verdicts are combined by the caller with one collective (the strategy's all-reduce of a flag), so no rank
reads O(ranks) files and none waits for another's reads.

:func:`verify_checkpoint` checks every rank's files from one process (``kforge eval`` / ``generate`` /
``convert``, which read them all, and :func:`check_checkpoint` behind ``kforge check-ckpt``), without reading a
tensor: the DCP ``.metadata`` unpickles, every shard file it names exists and holds the bytes the metadata places
in it, ``meta.pt`` loads (``weights_only``), and every rank's state file is a whole zip archive; ``.metadata`` and
``meta.pt`` are checked against their checksums first (:mod:`kempnerforge.checkpoint.checksum`).
"""

from __future__ import annotations

import dataclasses
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
from kempnerforge.checkpoint.dcp_read import read_plan
from kempnerforge.checkpoint.errors import CheckpointError, CorruptCheckpointError
from kempnerforge.checkpoint.layout import META_FILE, rank_file, read_rank
from kempnerforge.checkpoint.verified_read import VerifiedFile

__all__ = [
    "CorruptCheckpointError",
    "NamingFileSystemReader",
    "check_checkpoint",
    "describe_failure",
    "unverified_warning",
    "verify_checkpoint",
    "verify_rank_files",
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


def check_whole_zip(path: Path, file: Path) -> None:
    """``file`` (a ``torch.save`` archive of checkpoint ``path``) is a whole zip archive whose members pass their
    CRC-32 (``zipfile.testzip``).

    Raises:
        CorruptCheckpointError: it is missing, not a zip archive, or has a damaged member (names it).
    """
    if not file.is_file():
        raise _corrupt(path, file, "is missing")
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile) as err:
        raise _corrupt(path, file, f"is not a whole torch.save archive ({err})") from err
    if bad is not None:
        raise _corrupt(path, file, f"has a damaged member {bad!r}")


def verify_rank_files(path: str | Path, rank: int, manifests: Manifests | None = None) -> dict[str, Any]:
    """Check and load the files rank ``rank`` of a restore reads before DCP, and only those: ``.metadata`` and
    ``meta.pt`` against their checksums (``meta.pt`` loaded, ``weights_only``), then its state file
    ``rank_<rank>.pt`` (rank 0's when the checkpoint was written by fewer ranks: every data-parallel rank saved the
    same position) against its checksum, a whole zip archive, loaded. Reads rank 0's checksum record and its own.

    Args:
        path: a complete checkpoint directory.
        rank: this process's global rank.
        manifests: the checkpoint's checksum records, shared with the DCP read that follows so no file is hashed
            twice (None: a fresh :class:`~kempnerforge.checkpoint.checksum.Manifests`).

    Returns:
        ``meta.pt``'s contents with ``rank_state`` (the state file's) and ``world_size``.

    Raises:
        CorruptCheckpointError: names the first bad file and what is wrong with it.
    """
    path = Path(path)
    manifests = Manifests(path) if manifests is None else manifests
    manifests.check(DCP_METADATA)
    manifests.check(META_FILE)
    try:
        meta = _load(path / META_FILE)
    except Exception as err:
        raise _corrupt(path, path / META_FILE, f"cannot be loaded ({type(err).__name__}: {err})") from err
    own = rank_file(path, read_rank(rank, int(meta.get("world_size", 1))))
    manifests.check(own.name)
    check_whole_zip(path, own)
    try:
        meta["rank_state"] = _load(own)
    except Exception as err:
        raise _corrupt(path, own, f"cannot be loaded ({type(err).__name__}: {err})") from err
    return meta


def verify_checkpoint(path: str | Path, warn: bool = True) -> dict[str, Any]:
    """Check the complete checkpoint ``path`` from one process without reading a tensor: ``.metadata`` and
    ``meta.pt`` against their checksums, then that every shard file exists with the bytes the metadata places in it
    and every rank's state file is a whole zip archive (the shards' own checksums are checked by the process that
    reads them, :class:`NamingFileSystemReader`; all of them by :func:`check_checkpoint`). Reads O(ranks) files:
    for a process that reads the whole checkpoint (the tools), never a training rank (:func:`verify_rank_files`).

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
        check_whole_zip(path, file)
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
    """DCP's local filesystem, whose read errors name the file they come from, and whose read streams verify what
    they hand out against the checkpoint's records (:class:`~kempnerforge.checkpoint.verified_read.VerifiedFile`;
    a file recorded before block digests is checked whole first)."""

    def __init__(self, manifests: Manifests | None = None) -> None:
        super().__init__()
        self.manifests = manifests

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[Any]:
        try:
            verified = self._verified(Path(path)) if "r" in mode else None
            if verified is not None:
                with verified as stream:
                    yield stream
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream
        except CorruptCheckpointError:
            raise
        except Exception as err:
            if "r" not in mode:
                raise
            raise CorruptCheckpointError(f"{path} cannot be read: {type(err).__name__}: {err}", Path(path)) from err

    def _verified(self, path: Path) -> VerifiedFile | None:
        manifests = self.manifests
        if manifests is None or not manifests.enabled or path.name in manifests.checked:
            return None
        entry, algorithm = manifests.entry(path.name)  # there, with the size written
        if "blocks" not in entry:
            manifests.check(path.name)
            return None
        return VerifiedFile(path, entry, algorithm, manifests.corrupt)


class NamingFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that verifies what it reads before it is used, and whose errors name the file that
    failed (:class:`CorruptCheckpointError`): ``.metadata`` against its checksum before unpickling it, and of the
    shard files of this rank's read plan (only those) the blocks that hold the plan's items, hashed from the very
    bytes DCP deserializes (one read per byte; the items read in file order, each tensor straight into its target
    where it can: :func:`~kempnerforge.checkpoint.dcp_read.read_plan`). A checkpoint without records is
    size-checked only (each file of the plan holds the bytes the metadata places in it).

    Args:
        path: the checkpoint directory.
        verify: check sizes and checksums (False: only name the failing file, as before checksums existed).
        manifests: the checkpoint's records, shared across the reads of one restore (a whole file is hashed
            once); None: this reader's own.
        whole_files: check each file of the read plan whole before reading it, bytes it does not read included
            (the tools: ``kforge eval`` refuses a checkpoint whose optimizer state is damaged, as a resume would).
    """

    def __init__(
        self, path: str | Path, verify: bool = True, manifests: Manifests | None = None, whole_files: bool = False
    ) -> None:
        super().__init__(path)
        self.verify, self.whole_files = verify, whole_files
        self.manifests = (manifests or Manifests(Path(path), context=False)) if verify else None
        self.fs = _NamingFileSystem(self.manifests)
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
        def where(item: Any) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        # In file order: each file is read front to back, and a block shared by neighbouring items is read once.
        plan = dataclasses.replace(plan, items=sorted(plan.items, key=where))
        if self.whole_files and self.manifests is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                self.manifests.check(name)
        if self.verify and (self.manifests is None or not self.manifests.enabled):
            needed: dict[str, int] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
            for name, size in sorted(needed.items()):
                self._check_size(Path(self.path) / name, size)
        read_plan(self, plan, planner)  # straight into the targets where it can (kempnerforge.checkpoint.dcp_read)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @staticmethod
    def _check_size(file: Path, size: int) -> None:
        try:
            have = file.stat().st_size
        except FileNotFoundError as err:
            raise CorruptCheckpointError(f"{file} is missing (the DCP metadata lists it)", file) from err
        if have < size:
            raise CorruptCheckpointError(
                f"{file} is truncated: {have} bytes, the DCP metadata needs at least {size}", file
            )


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
