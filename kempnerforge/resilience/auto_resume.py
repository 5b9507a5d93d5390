"""Auto-resume: find the newest complete checkpoint in a checkpoint folder (None: start fresh).

A candidate is complete when it is a DCP checkpoint directory holding the ``COMPLETE`` marker
(:mod:`kempnerforge.checkpoint.dcp_io`) or, for plain Lightning checkpoints, a ``*.ckpt`` file.
``<name>.partial`` directories (a save that did not finish) are never chosen.

``kforge fit --ckpt_path auto`` hands Lightning an :class:`AutoResume`: global rank 0 alone looks at
the folder, once the process group exists, and every rank loads what it chose (ranks on a shared
filesystem can see different directory listings for a while; each rank choosing for itself could
resume some ranks and start others fresh).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kempnerforge.checkpoint.layout import is_complete, latest_name

__all__ = ["AutoResume", "checkpoint_dir", "complete_checkpoints", "find_resume_checkpoint", "is_complete"]

log = logging.getLogger(__name__)

#: ``--ckpt_path`` value that resumes from the newest complete checkpoint, if any.
AUTO = "auto"


def complete_checkpoints(dirpath: Path) -> list[Path]:
    """Complete checkpoints in ``dirpath``, oldest first (by modification time, then name)."""
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.iterdir() if p.name.endswith(".ckpt") and is_complete(p)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def latest_target(dirpath: Path) -> Path | None:
    """The checkpoint the ``latest`` pointer names (None when there is no pointer)."""
    name = latest_name(dirpath)
    return dirpath / name if name is not None else None


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
        log.warning("Auto-resume: %s names %s, which is not complete; ignoring it.", dirpath / "latest", target)
    return found[-1] if found else None


class AutoResume(str):
    """The ``ckpt_path`` of ``--ckpt_path auto``: resume from the newest complete checkpoint in ``folder``.

    A ``str`` whose value is ``"auto"``, so ``Trainer.fit`` passes it unchanged to the strategy's
    ``load_checkpoint``; ``KempnerStrategy`` asks :meth:`choose` on global rank 0 only and broadcasts
    the answer (None: every rank starts fresh).

    Args:
        folder: the checkpoint folder (None: nothing to resume).
    """

    folder: Path | None

    def __new__(cls, folder: str | Path | None) -> AutoResume:
        self = super().__new__(cls, AUTO)
        self.folder = Path(folder) if folder is not None else None
        self._choice: tuple[Path | None] | None = None
        return self

    def choose(self) -> Path | None:
        """:func:`find_resume_checkpoint` of ``folder``, looked up once (the same answer on every later call)."""
        if self._choice is None:
            self._choice = (find_resume_checkpoint(self.folder),)
        return self._choice[0]


def checkpoint_dir(trainer: object, dirpath: str | Path | None = None) -> Path | None:
    """``dirpath`` if given, else the trainer's ``ModelCheckpoint`` folder (None when neither is known)."""
    if dirpath is not None:
        return Path(dirpath)
    ckpt_cb = getattr(trainer, "checkpoint_callback", None)
    found = getattr(ckpt_cb, "dirpath", None)
    return Path(found) if found is not None else None
