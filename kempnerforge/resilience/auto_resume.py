"""Auto-resume: find the newest complete checkpoint in a checkpoint folder (None: start fresh).

A candidate is complete when it is a DCP checkpoint directory holding the ``COMPLETE`` marker
(:mod:`kempnerforge.checkpoint.dcp_io`) or, for plain Lightning checkpoints, a ``*.ckpt`` file.
``<name>.partial`` directories (a save that did not finish) are never chosen.

``kforge fit --ckpt_path auto`` hands Lightning an :class:`AutoResume`: global rank 0 alone looks at
the folder, once the process group exists, and every rank loads what it chose (ranks on a shared
filesystem can see different directory listings for a while; each rank choosing for itself could
resume some ranks and start others fresh).

Fallback: every rank checks the files of the pick that it reads, and only those (a restore's
:func:`~kempnerforge.checkpoint.verify.verify_rank_files` and its DCP read plan's shards: missing, truncated or
overwritten files, an unreadable ``meta.pt`` or state file), and one all-reduce combines the verdicts; a pick that
is bad on some rank is rejected by all ranks together (:meth:`AutoResume.reject`), with a warning naming the file,
and the next older complete checkpoint is restored from scratch. No rank reads O(ranks) files.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.checkpoint.layout import is_complete, latest_name

__all__ = [
    "AutoResume",
    "checkpoint_dir",
    "complete_checkpoints",
    "find_resume_checkpoint",
    "is_complete",
    "resume_candidates",
]

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
    """The checkpoint the ``latest`` pointer names (None when there is no pointer, or a damaged one: warned)."""
    try:
        name = latest_name(dirpath)
    except CheckpointError as err:
        log.warning("Auto-resume: %s; taking the newest complete checkpoint instead.", err)
        return None
    return dirpath / name if name is not None else None


def resume_candidates(dirpath: str | Path | None) -> list[Path]:
    """Complete checkpoints of ``dirpath`` in the order a resume tries them: the one ``latest`` names, then the
    others newest first (empty when there is none or ``dirpath`` is None)."""
    if dirpath is None:
        return []
    dirpath = Path(dirpath)
    target = latest_target(dirpath)
    found = complete_checkpoints(dirpath)[::-1]
    if target is None:
        return found
    if not is_complete(target):
        log.warning("Auto-resume: %s names %s, which is not complete; ignoring it.", dirpath / "latest", target)
        return found
    return [target, *(p for p in found if p != target)]


def find_resume_checkpoint(
    dirpath: str | Path | None, verify: bool = False, rejected: dict[Path, str] | None = None
) -> Path | None:
    """The checkpoint an automatic resume should load from ``dirpath``.

    ``latest`` wins when it names a complete checkpoint; otherwise the newest complete one; None
    when there is none (a fresh start) or ``dirpath`` is None.

    Args:
        dirpath: the checkpoint folder.
        verify: skip checkpoint directories whose files are bad (:func:`~kempnerforge.checkpoint.verify.verify_checkpoint`,
            which reads every rank's files: for one process, e.g. a tool), with a warning naming the file; each one
            skipped is added to ``rejected``.
        rejected: checkpoints not to take (path -> why), and where ``verify`` records the ones it skips.
    """
    rejected = {} if rejected is None else rejected
    for path in resume_candidates(dirpath):
        if path in rejected:
            continue
        if verify and path.is_dir():
            from kempnerforge.checkpoint.verify import CorruptCheckpointError, verify_checkpoint

            try:
                verify_checkpoint(path)
            except CorruptCheckpointError as err:
                rejected[path] = str(err)
                log.warning("Auto-resume: %s; falling back to the previous complete checkpoint.", err)
                continue
        return path
    return None


class AutoResume(str):
    """The ``ckpt_path`` of ``--ckpt_path auto``: resume from the newest complete checkpoint in ``folder`` that loads
    (the strategy rejects one that does not, and asks again).

    A ``str`` whose value is ``"auto"``, so ``Trainer.fit`` passes it unchanged to the strategy's
    ``load_checkpoint``; ``KempnerStrategy`` asks :meth:`choose` on global rank 0 only and broadcasts
    the answer (None: every rank starts fresh), and after a failed load :meth:`reject` and :meth:`choose` again.

    Args:
        folder: the checkpoint folder (None: nothing to resume).

    Attributes:
        rejected: checkpoints skipped or failed so far (path -> why), oldest decision first.
    """

    folder: Path | None

    def __new__(cls, folder: str | Path | None) -> AutoResume:
        self = super().__new__(cls, AUTO)
        self.folder = Path(folder) if folder is not None else None
        self._choice: tuple[Path | None] | None = None
        self.rejected: dict[Path, str] = {}
        return self

    def choose(self) -> Path | None:
        """The newest complete checkpoint of ``folder`` that is not rejected (:func:`find_resume_checkpoint`),
        looked up once (the same answer on every later call until :meth:`reject`). Its files are checked by the
        ranks that read them, during the restore."""
        if self._choice is None:
            self._choice = (find_resume_checkpoint(self.folder, rejected=self.rejected),)
        return self._choice[0]

    def reject(self, path: str | Path, reason: str) -> None:
        """Never choose ``path`` again (it failed to load: ``reason``); the next :meth:`choose` looks again."""
        self.rejected[Path(path)] = reason
        self._choice = None


def checkpoint_dir(trainer: object, dirpath: str | Path | None = None) -> Path | None:
    """``dirpath`` if given, else the trainer's ``ModelCheckpoint`` folder (None when neither is known)."""
    if dirpath is not None:
        return Path(dirpath)
    ckpt_cb = getattr(trainer, "checkpoint_callback", None)
    found = getattr(ckpt_cb, "dirpath", None)
    return Path(found) if found is not None else None
