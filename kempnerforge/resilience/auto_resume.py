"""Auto-resume: find the newest complete checkpoint in a checkpoint folder (None: start fresh).

A candidate is complete when it is a DCP checkpoint directory holding the ``COMPLETE`` marker
(:mod:`kempnerforge.checkpoint.dcp_io`) or, for plain Lightning checkpoints, a ``*.ckpt`` file.
``<name>.partial`` directories (a save that did not finish) are never chosen.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kempnerforge.checkpoint.dcp_io import COMPLETE_FILE, LATEST_FILE, PARTIAL_SUFFIX

log = logging.getLogger(__name__)


def is_complete(path: Path) -> bool:
    """True for a DCP directory with its completion marker, or a plain ``*.ckpt`` file."""
    if path.name.endswith(PARTIAL_SUFFIX):
        return False
    if path.is_dir():
        return (path / COMPLETE_FILE).is_file()
    return path.is_file() and path.suffix == ".ckpt"


def complete_checkpoints(dirpath: Path) -> list[Path]:
    """Complete checkpoints in ``dirpath``, oldest first (by modification time, then name)."""
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.iterdir() if p.name.endswith(".ckpt") and is_complete(p)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def latest_target(dirpath: Path) -> Path | None:
    """The checkpoint the ``latest`` pointer names (None when there is no pointer)."""
    pointer = dirpath / LATEST_FILE
    if not pointer.is_file():
        return None
    return dirpath / pointer.read_text().strip()


def find_resume_checkpoint(dirpath: str | Path | None) -> Path | None:
    """The checkpoint an automatic resume should load from ``dirpath``.

    ``latest`` wins when it names a complete checkpoint; otherwise the newest complete one; None
    when there is none (a fresh start) or ``dirpath`` is None.
    """
    if dirpath is None:
        return None
    dirpath = Path(dirpath)
    target = latest_target(dirpath)
    if target is not None and is_complete(target):
        return target
    found = complete_checkpoints(dirpath)
    if target is not None:
        log.warning("Auto-resume: %s names %s, which is not complete; ignoring it.", dirpath / LATEST_FILE, target)
    return found[-1] if found else None


def checkpoint_dir(trainer: object, dirpath: str | Path | None = None) -> Path | None:
    """``dirpath`` if given, else the trainer's ``ModelCheckpoint`` folder (None when neither is known)."""
    if dirpath is not None:
        return Path(dirpath)
    ckpt_cb = getattr(trainer, "checkpoint_callback", None)
    found = getattr(ckpt_cb, "dirpath", None)
    return Path(found) if found is not None else None
