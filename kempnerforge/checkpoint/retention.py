"""Checkpoint retention: keep the newest N complete checkpoints, never the one ``latest`` names nor a protected one.

A protected checkpoint is listed (one name a line) in ``<dirpath>/protected``; the NaN guard adds
the last healthy checkpoint before a non-finite step there, so a rollback target is never rotated out.
Partial saves (``*.partial``) are left alone: they may be a save in progress.

:func:`prune_checkpoints` lists the folder once; :class:`~kempnerforge.callbacks.CheckpointRetention`
calls it on rank 0 after each completed save, on the checkpoint worker thread, never every step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kempnerforge.checkpoint.layout import PROTECTED_FILE, delete_checkpoint, protect, protected_names
from kempnerforge.resilience.auto_resume import complete_checkpoints, latest_target

__all__ = ["PROTECTED_FILE", "protect", "protected_names", "prune_checkpoints"]

log = logging.getLogger(__name__)


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
            delete_checkpoint(path)
            deleted.append(path)
    if deleted:
        log.info("Checkpoint retention: deleted %s", ", ".join(p.name for p in deleted))
    return deleted
