"""The checkpoint folder's names and the file operations every writer and reader of it shares.

::

    <dirpath>/
      step=00000100.ckpt/          a complete checkpoint (holds COMPLETE)
      step=00000200.ckpt.partial/  a save in progress (renamed when every rank has finished)
      latest                       text: the name of the newest complete checkpoint
      protected                    names that nothing deletes, one a line (the NaN guard's rollback target)

Plain functions with no process-group calls: they run on rank 0, on the training thread or on the
checkpoint worker thread (:mod:`kempnerforge.checkpoint.dcp_io`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from kempnerforge.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

META_FILE = "meta.pt"
LATEST_FILE = "latest"
PARTIAL_SUFFIX = ".partial"
COMPLETE_FILE = "COMPLETE"
PROTECTED_FILE = "protected"


def rank_file(path: Path, rank: int) -> Path:
    """Path of rank ``rank``'s per-rank state file inside checkpoint ``path``."""
    return path / f"rank_{rank:05d}.pt"


def read_rank(rank: int, saved_world: int) -> int:
    """The rank whose state file rank ``rank`` restores: its own, or rank 0's when the checkpoint was written by fewer
    ranks (every data-parallel rank saved the same dataloader position; ``merge_rank_state`` remaps it)."""
    return rank if rank < saved_world else 0


def partial_path(path: Path) -> Path:
    """Where the save of checkpoint ``path`` is written until it is complete."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


def is_complete(path: Path) -> bool:
    """True for a DCP directory with its completion marker, or a plain Lightning ``*.ckpt`` file."""
    if path.name.endswith(PARTIAL_SUFFIX):
        return False
    if path.is_dir():
        return (path / COMPLETE_FILE).is_file()
    return path.is_file() and path.suffix == ".ckpt"


def latest_name(dirpath: Path) -> str | None:
    """The checkpoint name ``<dirpath>/latest`` holds (None when there is no pointer).

    Raises:
        CheckpointError: the pointer is not one line of text naming a directory of ``dirpath`` (binary garbage,
            an empty file, a path): the caller falls back to the newest complete checkpoint or says so.
    """
    pointer = dirpath / LATEST_FILE
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer} is damaged: {type(err).__name__}: {err}") from err
    if not name or "/" in name or "\n" in name or not name.isprintable() or name in (".", ".."):
        raise CheckpointError(f"{pointer} is damaged: it holds {name[:40]!r}, not a checkpoint name")
    return name


def write_latest(path: Path) -> None:
    """Point ``<path.parent>/latest`` at checkpoint ``path`` atomically (write a temporary file, rename it)."""
    pointer = path.parent / LATEST_FILE
    tmp = pointer.with_name(LATEST_FILE + ".tmp")
    tmp.write_text(path.name + "\n")
    os.replace(tmp, pointer)


def protected_names(dirpath: Path) -> set[str]:
    """Names listed in ``<dirpath>/protected`` (empty when there is no such file)."""
    path = dirpath / PROTECTED_FILE
    return {line.strip() for line in path.read_text().splitlines() if line.strip()} if path.is_file() else set()


def protect(dirpath: str | Path, name: str) -> None:
    """Add checkpoint ``name`` to ``<dirpath>/protected`` (idempotent; call from one rank)."""
    dirpath = Path(dirpath)
    names = protected_names(dirpath)
    if name not in names:
        dirpath.mkdir(parents=True, exist_ok=True)
        (dirpath / PROTECTED_FILE).write_text("".join(f"{n}\n" for n in sorted(names | {name})))


def kept_reason(path: Path) -> str | None:
    """Why checkpoint ``path`` must not be deleted: ``latest`` names it or it is protected (None: it may go)."""
    try:
        latest = latest_name(path.parent)
    except CheckpointError:  # a damaged pointer protects nothing (the next save rewrites it)
        latest = None
    if latest == path.name:
        return f"{path.parent / LATEST_FILE} names it"
    if path.name in protected_names(path.parent):
        return f"it is listed in {path.parent / PROTECTED_FILE}"
    return None


def delete_checkpoint(path: Path) -> None:
    """Delete one checkpoint; its ``COMPLETE`` marker goes first, so a crash halfway through never leaves a
    directory that looks complete (auto-resume and retention then skip what is left)."""
    if path.is_dir():
        (path / COMPLETE_FILE).unlink(missing_ok=True)
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
