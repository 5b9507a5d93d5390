"""Checkpoint retention: keep the newest N complete checkpoints, never the one ``latest`` names nor a protected one.

A protected checkpoint is listed (one name a line) in ``<dirpath>/protected``; the NaN guard adds
the last healthy checkpoint before a non-finite step there, so a rollback target is never rotated out.
Partial saves (``*.partial``) are left alone: they may be a save in progress.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from kempnerforge.resilience.auto_resume import complete_checkpoints, latest_target

log = logging.getLogger(__name__)

PROTECTED_FILE = "protected"


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


def prune_checkpoints(dirpath: str | Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last``, except ``latest`` and protected ones.

    Args:
        dirpath: checkpoint folder.
        keep_last: number of newest complete checkpoints to keep (>= 1).

    Returns:
        The deleted paths.

    Raises:
        ValueError: ``keep_last`` < 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be >= 1.")
    dirpath = Path(dirpath)
    found = complete_checkpoints(dirpath)
    keep = {p.name for p in found[-keep_last:]} | protected_names(dirpath)
    target = latest_target(dirpath)
    if target is not None:
        keep.add(target.name)
    deleted = []
    for path in found:
        if path.name not in keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            deleted.append(path)
    if deleted:
        log.info("Checkpoint retention: deleted %s", ", ".join(p.name for p in deleted))
    return deleted
