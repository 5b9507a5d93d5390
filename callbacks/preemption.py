"""Preemption: a signal sets a flag; at the next step boundary all ranks agree, save together, and exit cleanly."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from kempnerforge.exit_status import REQUEUED, STOPPED_EARLY
from kempnerforge.resilience.auto_resume import checkpoint_dir
from kempnerforge.resilience.requeue import requeue_slurm_job
from kempnerforge.resilience.signals import SignalFlag, agree_max
from kempnerforge.resilience.watchdog import Watchdog

log = logging.getLogger(__name__)


class Preemption(Callback):
    """Checkpoint-and-exit on SIGTERM / SIGUSR1 (configurable), with optional SLURM requeue.

    The handlers (installed at ``on_train_start``, replacing Lightning's, which save or broadcast
    inside the handler and can deadlock sharded saves) set a flag and then run the handlers that were
    installed before ``fit`` (a user's SIGTERM handler still runs; Lightning's own do not). At teardown
    (or after an exception) the handlers from before ``fit`` are back. At optimizer-step boundaries
    the flag is all-reduced (MAX) across ranks, so a signal that reached one rank stops all of them
    at the same step. Reading the agreed flag is a host synchronization, so it is not done every step:
    with a :class:`~kempnerforge.callbacks.NaNGuard` the flag rides on its per-step reduction (no
    extra sync, checked every step); alone, ranks agree about every ``check_every_s`` seconds: each
    agreement also takes the slowest rank's mean step time since the last one, and the next agreement
    comes ``max(1, floor(check_every_s / step_time))`` steps later, the same step on every rank. A
    signal therefore starts the save within ``check_every_s`` plus one step.
    Every rank then joins one ``trainer.save_checkpoint`` into the checkpoint
    folder (unless ``save`` is False), rank 0 runs ``scontrol requeue`` when ``requeue`` is set, prints one
    line (the step, the checkpoint, how to resume), and ``trainer.should_stop`` ends ``fit``; ``kforge fit``
    then exits with :data:`~kempnerforge.exit_status.STOPPED_EARLY` (75), or
    :data:`~kempnerforge.exit_status.REQUEUED` (76) when the requeue succeeded (:attr:`stop_status`). After a
    SIGTERM ``trainer.received_sigterm`` is True once ``fit`` returns. A
    :class:`~kempnerforge.resilience.watchdog.Watchdog` ends the process if this shutdown stalls. The next
    ``kforge fit`` with the same config resumes from this checkpoint by itself (``--ckpt_path auto``, the
    default).

    ``KempnerStrategy`` adds one of these to every run that has none (``save`` only when a checkpoint callback
    is configured), so a signal never reaches Lightning's own handlers there. Works with any Lightning
    strategy; with ``KempnerStrategy`` the save is a DCP directory and ``latest`` moves only once every rank has
    finished writing.

    Args:
        signals: signal names or numbers to catch (default SIGTERM, SIGUSR1 and SIGINT; a second SIGINT raises
            ``KeyboardInterrupt`` at once).
        requeue: on rank 0, run ``scontrol requeue $SLURM_JOB_ID`` after the save.
        dirpath: checkpoint folder (None: the ``ModelCheckpoint``'s, else ``<default_root_dir>/checkpoints``).
        watchdog_s: seconds the save + shutdown may take before the process exits hard (status 1).
        check_every_s: seconds of training between two agreements on the flag when no NaNGuard carries
            it (0: every optimizer step). Keep it plus the save well inside the scheduler's grace time
            (the sbatch templates ask SLURM for SIGTERM 120 s before the end).
        save: write a checkpoint before stopping (False: stop without one; the line says nothing was saved).

    Raises:
        ValueError: an unknown signal name, ``watchdog_s`` <= 0 or ``check_every_s`` < 0.
    """

    def __init__(
        self,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1", "SIGINT"),
        requeue: bool = False,
        dirpath: str | None = None,
        watchdog_s: float = 600.0,
        check_every_s: float = 10.0,
        save: bool = True,
    ) -> None:
        self.flag = SignalFlag(signals, chain=True)
        if not watchdog_s > 0:
            raise ValueError(f"Preemption watchdog_s={watchdog_s!r} must be > 0 seconds.")
        if not check_every_s >= 0:
            raise ValueError(f"Preemption check_every_s={check_every_s!r} must be >= 0 seconds (0: every step).")
        self.check_every_s = float(check_every_s)
        self.requeue = requeue
        self.dirpath = dirpath
        self.watchdog_s = watchdog_s
        self.save = save
        self.saved_path: Path | None = None
        self.stop_status: int | None = None  # exit_status.STOPPED_EARLY / REQUEUED once the run stopped on a signal
        self._watchdog: Watchdog | None = None
        self._seen_step = -1
        self._carried: bool | None = None  # the flag agreed by a carrier's reduction at this step
        self._next_check = 0  # global step of the next own agreement
        self._last_check = (0.0, 0)  # (monotonic time, global step) of the last own agreement

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remember the handlers from before ``fit`` (Lightning replaces them later, before ``on_train_start``):
        they are chained by the flag's handler and restored at teardown."""
        self.flag.remember()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the flag handlers (Lightning registered its own just before this hook)."""
        self._seen_step = trainer.global_step
        self._next_check = trainer.global_step + 1  # the first agreement also measures the step time
        self._last_check = (time.monotonic(), trainer.global_step)
        self._carried = None
        self.flag.install()

    def local_step_flag(self) -> bool:
        """:class:`~kempnerforge.resilience.signals.StepFlagSource`: whether this rank got a signal."""
        return self.flag.received is not None

    def receive_agreed_flag(self, value: bool) -> None:
        """:class:`~kempnerforge.resilience.signals.StepFlagSource`: the flag agreed at this optimizer step."""
        self._carried = value

    def _agree(self, trainer: Trainer, pl_module: LightningModule) -> bool | None:
        """The agreed flag at this step boundary, or None when this is not a step to agree at."""
        if self._carried is not None:
            carried, self._carried = self._carried, None
            return carried
        step = trainer.global_step
        if step < self._next_check:
            return None
        now = time.monotonic()
        step_s = (now - self._last_check[0]) / max(1, step - self._last_check[1])
        # Host sync: the agreed flag and the slowest rank's step time, read together once per interval.
        flag, slowest = agree_max([self.local_step_flag(), step_s], device=pl_module.device)
        self._last_check = (now, step)
        every = 1 if self.check_every_s == 0 else max(1, int(self.check_every_s / max(slowest, 1e-9)))
        self._next_check = step + every
        return flag > 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """At an optimizer-step boundary that agrees on the flag: if any rank was signalled, save on all
        ranks and stop."""
        if trainer.global_step == self._seen_step:
            return  # a gradient-accumulation micro-batch: saving here would lose the partial gradients
        self._seen_step = trainer.global_step
        if not self._agree(trainer, pl_module):
            return
        self._watchdog = Watchdog(self.watchdog_s)
        self._watchdog.start()
        started = time.monotonic()
        if self.save:
            path = self._checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            self.saved_path = path
            if isinstance(trainer.checkpoint_callback, ModelCheckpoint):
                # ModelCheckpoint runs after this callback: without this it saves the same step again
                # under a "-v1" name (its own duplicate-step guard, a private attribute in Lightning 2.6: no public
                # API marks a step as saved; test_preemption_save_is_not_repeated_by_model_checkpoint catches a
                # rename).
                trainer.checkpoint_callback._last_global_step_saved = trainer.global_step
        requeued = self.requeue and trainer.is_global_zero and requeue_slurm_job()
        self.stop_status = REQUEUED if requeued else STOPPED_EARLY
        if trainer.is_global_zero:
            print(self._stop_line(trainer, time.monotonic() - started, requeued), file=sys.stderr, flush=True)
        trainer.should_stop = True

    def _stop_line(self, trainer: Trainer, seconds: float, requeued: bool) -> str:
        """The one line a person reads after a signal: where it stopped, what was saved, how to go on."""
        name = signal.Signals(self.flag.received).name if self.flag.received is not None else "a signal"
        saved = (
            f"checkpoint {self.saved_path} written in {seconds:.1f} s"
            if self.saved_path is not None
            else "no checkpoint callback configured, nothing saved"
        )
        then = "SLURM requeued the job" if requeued else "run the same command again to resume"
        return f"kforge: stopped early at step {trainer.global_step} on {name}: {saved}; {then}."

    def _checkpoint_path(self, trainer: Trainer) -> Path:
        folder = checkpoint_dir(trainer, self.dirpath) or Path(trainer.default_root_dir) / "checkpoints"
        ckpt_cb = trainer.checkpoint_callback
        if isinstance(ckpt_cb, ModelCheckpoint) and self.dirpath is None:
            # Same naming as the periodic checkpoints, so retention and auto-resume order them together.
            name = Path(ckpt_cb.format_checkpoint_name({"epoch": trainer.current_epoch, "step": trainer.global_step}))
            return folder / name.name
        return folder / f"step={trainer.global_step:06d}.ckpt"

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Restore the handlers from before ``fit`` and disarm the watchdog (the shutdown finished). Runs after
        Lightning's own restore, so what stays installed is what was there before ``fit``."""
        if self.flag.received == signal.SIGTERM and self.stop_status is not None:
            # Lightning's own flag (trainer.received_sigterm), set only now: during the loop it would make Lightning
            # raise SIGTERMException (a traceback and exit 1) instead of the orderly stop above.
            trainer._signal_connector.received_sigterm = True
        self.flag.restore()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """After a failure (no ``teardown`` hook then): the handlers from before ``fit`` and no watchdog."""
        self.teardown(trainer, pl_module, "fit")
