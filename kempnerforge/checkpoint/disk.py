"""Disk space for checkpoints: free bytes of a folder's filesystem, the estimated size of one checkpoint, and
the error a save raises when the disk (or the user's quota) is full.

A full disk in the middle of ``torch.save`` surfaces as ``enforce fail at inline_container.cc ... unexpected
pos`` (PyTorch's zip writer drops the errno) and inside DCP as one rank's ``OSError`` wrapped in a
``CheckpointException``. :func:`space_errno` finds the ``ENOSPC`` / ``EDQUOT`` under either, so the save can
say what happened (:class:`CheckpointSpaceError`).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

#: errno values that mean "no room to write": a full filesystem, an exhausted quota.
SPACE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


class CheckpointSpaceError(OSError):
    """A checkpoint save that ran out of disk space or quota (``errno`` ENOSPC or EDQUOT); the message names the
    checkpoint, the bytes it needed and the bytes free."""


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where ``statvfs`` answers for a folder not created yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes free for this user on the filesystem that holds (or will hold) ``path``."""
    return shutil.disk_usage(existing_parent(path)).free


def format_bytes(n: int) -> str:
    """``n`` bytes, exact, with a binary-unit reading: ``1234567890 bytes (1.15 GiB)``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} bytes ({n / size:.2f} {unit})"
    return f"{n} bytes"


def space_errno(err: BaseException) -> int | None:
    """ENOSPC / EDQUOT when ``err`` (its causes, contexts, or the per-rank failures of a DCP
    ``CheckpointException``) is a write that found no room; None otherwise."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in SPACE_ERRNOS:
            return e.errno
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
        stack += [x for x in (e.__cause__, e.__context__) if x is not None]
    return None


def space_error(code: int, path: Path, needed: int) -> CheckpointSpaceError:
    """The error for a save of checkpoint ``path`` that needed about ``needed`` bytes and hit ``code`` (call it
    after the unfinished ``<path>.partial`` was removed, so the free bytes are what a retry would find)."""
    free = free_bytes(path.parent)
    return CheckpointSpaceError(
        code,
        f"{SPACE_ERRNOS[code]}: saving checkpoint {path} needs about {format_bytes(needed)} and "
        f"{existing_parent(path.parent)} has {format_bytes(free)} free (the unfinished {path.name}.partial was "
        "removed). Free space, or point the checkpoint folder (ModelCheckpoint / Preemption dirpath) at a "
        "filesystem with room.",
    )


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` (and its parents) and write and remove a small file in it.

    Raises:
        OSError: the folder cannot be created or written (read-only filesystem, permissions, a file in the way).
    """
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".kforge-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
    finally:
        probe.unlink(missing_ok=True)
