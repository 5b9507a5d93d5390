"""Checkpoint retention: keep the newest N complete checkpoints (never ``latest``, never a protected one)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from kempnerforge.checkpoint.retention import prune_checkpoints
from kempnerforge.resilience.auto_resume import checkpoint_dir


class CheckpointRetention(Callback):
    """Deletes old checkpoints after saves (rank 0), through :func:`kempnerforge.checkpoint.retention.prune_checkpoints`.

    Only complete checkpoints are counted and deleted (DCP directories with their ``COMPLETE``
    marker, or plain ``*.ckpt`` files); the one ``latest`` names and those listed in
    ``<dirpath>/protected`` (the NaN guard's last healthy checkpoint) are always kept. Use it with
    ``ModelCheckpoint(save_top_k=-1)`` so only this callback deletes.

    Args:
        keep_last: newest complete checkpoints to keep (>= 1).
        dirpath: checkpoint folder (None: the ``ModelCheckpoint``'s).

    Raises:
        ValueError: ``keep_last`` < 1.
    """

    def __init__(self, keep_last: int = 3, dirpath: str | None = None) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"CheckpointRetention keep_last={keep_last!r} must be an integer >= 1.")
        self.keep_last = keep_last
        self.dirpath = dirpath

    def _prune(self, trainer: Trainer) -> None:
        folder = checkpoint_dir(trainer, self.dirpath)
        if trainer.is_global_zero and folder is not None:
            prune_checkpoints(folder, self.keep_last)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Prune once per step (a directory listing; the step's save, if any, finished before this hook on
        the next step, since Lightning runs ``ModelCheckpoint`` after the other callbacks)."""
        self._prune(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Prune after the final save."""
        self._prune(trainer)
