"""Checkpoint retention: keep the newest N complete checkpoints (never ``latest``, never a protected one)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
from kempnerforge.checkpoint.retention import prune_checkpoints
from kempnerforge.resilience.auto_resume import checkpoint_dir


class CheckpointRetention(Callback):
    """Deletes old checkpoints on rank 0 after each completed save, off the training thread
    (:func:`kempnerforge.checkpoint.retention.prune_checkpoints`, one listing of the folder per save).

    Only complete checkpoints are counted and deleted (DCP directories with their ``COMPLETE``
    marker, or plain ``*.ckpt`` files); the one ``latest`` names and those listed in
    ``<dirpath>/protected`` (the NaN guard's last healthy checkpoint) are always kept. Use it with
    ``ModelCheckpoint(save_top_k=-1)`` so only this callback deletes.

    With ``KempnerStrategy`` it runs as a commit hook of the strategy's
    :class:`~kempnerforge.checkpoint.dcp_io.DCPCheckpointIO`: on its checkpoint worker, right after a save
    is complete and ``latest`` names it (for async saves, once the upload finished). With any other
    strategy it prunes on a thread of its own at the first step boundary after a save (the save is
    synchronous there), and once more at the end of training.

    Args:
        keep_last: newest complete checkpoints to keep (>= 1).
        dirpath: checkpoint folder (None: the folder of the checkpoint just saved, or the ``ModelCheckpoint``'s).

    Raises:
        ValueError: ``keep_last`` < 1.
    """

    def __init__(self, keep_last: int = 3, dirpath: str | None = None) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"CheckpointRetention keep_last={keep_last!r} must be an integer >= 1.")
        self.keep_last = keep_last
        self.dirpath = dirpath
        self._io: DCPCheckpointIO | None = None
        self._saved = False
        self._worker: ThreadPoolExecutor | None = None
        self._task: Future | None = None

    def _after_commit(self, path: Path) -> None:
        prune_checkpoints(Path(self.dirpath) if self.dirpath is not None else path.parent, self.keep_last)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Register with the strategy's DCP checkpoint IO, if it has one (rank 0 only)."""
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if trainer.is_global_zero and isinstance(io, DCPCheckpointIO):
            io.add_commit_hook(self._after_commit)
            self._io = io

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Note that a save is being written (pruned at the next step boundary without a DCP IO)."""
        self._saved = True

    def _prune_in_background(self, trainer: Trainer) -> None:
        folder = checkpoint_dir(trainer, self.dirpath)
        if self._io is not None or not trainer.is_global_zero or folder is None:
            return
        if self._task is not None and not self._task.done():
            return  # the previous prune is still running; the next save triggers another
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kforge-retention")
        self._task = self._worker.submit(prune_checkpoints, folder, self.keep_last)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Without a DCP IO: prune once after each save (it finished before this hook of the next step, since
        Lightning runs ``ModelCheckpoint`` after the other callbacks); no folder listing otherwise."""
        if self._saved:
            self._saved = False
            self._prune_in_background(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Without a DCP IO: prune after the final save (with one, the IO's teardown runs the last hook)."""
        self._prune_in_background(trainer)
        if self._task is not None:
            self._task.result()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Unregister the commit hook and stop the pruning thread."""
        self._detach()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A failed run gets no ``teardown`` hook: detach here."""
        self._detach()

    def _detach(self) -> None:
        if self._io is not None:
            self._io.remove_commit_hook(self._after_commit)
            self._io = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
