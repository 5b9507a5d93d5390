"""NaN guard: stop, skip or roll back a step whose loss (or gradients) are not finite, agreed across ranks."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from kempnerforge.checkpoint.retention import protect
from kempnerforge.resilience.auto_resume import checkpoint_dir, find_resume_checkpoint
from kempnerforge.resilience.nonfinite import NonFiniteError, nonfinite_flag, restore_in_place
from kempnerforge.resilience.signals import StepFlagSource, agree_max

log = logging.getLogger(__name__)

ACTIONS = ("raise", "skip", "rollback")


class NaNGuard(Callback):
    """Checks every optimizer step's loss (and optionally gradients) for NaN/Inf before the update.

    The optimizer's ``step`` is wrapped: Lightning runs the step's closure (forward, backward,
    ``on_before_optimizer_step``) inside it, so the wrapper sees the loss and the final gradients,
    reduces a flag across all ranks (MAX), reads it back on the host (the one host synchronization
    of a training step with NaNGuard: the host must know before it launches the update) and only then
    lets the update happen. A flagged step is never applied on any rank. Flags of other callbacks
    (:class:`~kempnerforge.resilience.signals.StepFlagSource`, e.g. :class:`~kempnerforge.callbacks.Preemption`)
    ride in the same reduction, so they cost no extra synchronization and are agreed every step.

    Actions:
        ``raise``: :class:`NonFiniteError` naming the step (``trainer.global_step``, 0-based) on every rank.
        ``skip`` (the default): no optimizer step on any rank (AdamW moments and step count untouched); counted
            in ``skipped_steps``. The LR scheduler and ``global_step`` still advance (Lightning's loop). After
            ``max_consecutive`` non-finite steps in a row the run is diverged: :class:`NonFiniteError` naming the
            step and the last checkpoint written before the streak (``kforge fit`` exits with
            :data:`~kempnerforge.exit_status.DIVERGED`, 3).
        ``rollback``: reload model, optimizer and scheduler from the newest complete checkpoint in the
            checkpoint folder and continue; the data is not rewound (the batches since that checkpoint,
            the offending one included, are not replayed). After ``max_rollbacks`` rollbacks it raises.

    On any flagged step rank 0 protects the newest complete checkpoint from retention
    (:func:`kempnerforge.checkpoint.retention.protect`): the last healthy one before the NaN is kept. While the
    newest step was flagged, ``ModelCheckpoint`` does not save (the weights may already hold what made it
    non-finite), so neither a periodic checkpoint nor auto-resume ever picks weights from inside a streak.
    ``kforge fit`` adds ``NaNGuard()`` to every run that has none (every recipe names it).

    Args:
        action: ``"raise"``, ``"skip"`` or ``"rollback"``.
        check_grads: also check every gradient (catches NaNs in accumulation micro-batches too).
        max_rollbacks: rollbacks allowed before giving up (``rollback`` only, >= 0).
        max_consecutive: non-finite steps in a row after which ``skip`` gives up (>= 1).
        dirpath: checkpoint folder (None: the ``ModelCheckpoint``'s).

    Raises:
        ValueError: an unknown action, a negative ``max_rollbacks`` or ``max_consecutive`` < 1.
    """

    def __init__(
        self,
        action: str = "skip",
        check_grads: bool = False,
        max_rollbacks: int = 3,
        dirpath: str | None = None,
        max_consecutive: int = 3,
    ) -> None:
        if action not in ACTIONS:
            raise ValueError(f"NaNGuard action={action!r} is not allowed; use one of {list(ACTIONS)}.")
        if not isinstance(max_rollbacks, int) or max_rollbacks < 0:
            raise ValueError(f"NaNGuard max_rollbacks={max_rollbacks!r} must be an integer >= 0.")
        if not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"NaNGuard max_consecutive={max_consecutive!r} must be an integer >= 1.")
        self.max_consecutive = max_consecutive
        self.streak = 0  # non-finite optimizer steps in a row, up to the newest
        self.action = action
        self.check_grads = check_grads
        self.max_rollbacks = max_rollbacks
        self.dirpath = dirpath
        self.skipped_steps: list[int] = []
        self.rollbacks = 0
        self._riders: list[StepFlagSource] = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Wrap each optimizer's ``step`` (idempotent) and find the callbacks whose flags ride along."""
        self._riders = [cb for cb in trainer.callbacks if isinstance(cb, StepFlagSource) and cb is not self]
        for optimizer in trainer.optimizers:
            if not getattr(optimizer.step, "_nan_guarded", False):
                optimizer.step = self._wrap(trainer, pl_module, optimizer.step)

    def _wrap(self, trainer: Trainer, pl_module: LightningModule, step: Any) -> Any:
        @functools.wraps(step)
        def guarded_step(closure: Any = None, **kwargs: Any) -> Any:
            loss = closure() if closure is not None else None
            params = pl_module.parameters() if self.check_grads else None
            flags = [nonfinite_flag(loss, params), *(r.local_step_flag() for r in self._riders)]
            # The step's host sync: every rank's flags in one all-reduce, read back once.
            agreed = [v > 0 for v in agree_max(flags, device=pl_module.device)]
            for rider, value in zip(self._riders, agreed[1:], strict=True):
                rider.receive_agreed_flag(value)
            if agreed[0]:
                self.streak += 1
                self._on_nonfinite(trainer)
                return loss
            self.streak = 0
            step(**kwargs)
            return loss

        guarded_step._nan_guarded = True  # type: ignore[attr-defined]
        return guarded_step

    def _on_nonfinite(self, trainer: Trainer) -> None:
        step = trainer.global_step
        folder = checkpoint_dir(trainer, self.dirpath)
        good = find_resume_checkpoint(folder)
        if good is not None and trainer.is_global_zero:
            protect(good.parent, good.name)
        if self.action == "raise":
            raise NonFiniteError(f"NaNGuard: non-finite loss or gradient at step {step} (trainer.global_step).")
        self.skipped_steps.append(step)
        if self.action == "skip" and self.streak >= self.max_consecutive:
            last = f"the last checkpoint before it is {good}" if good is not None else "no checkpoint was written"
            raise NonFiniteError(
                f"training diverged: {self.streak} non-finite steps in a row, the first at step "
                f"{step - self.streak + 1} (trainer.global_step); {last}. Lower model.optimizer.lr or check the data."
            )
        if self.action == "skip":
            log.warning("NaNGuard: non-finite loss or gradient at step %d; optimizer step skipped on all ranks.", step)
            return
        if self.rollbacks >= self.max_rollbacks:
            raise NonFiniteError(f"NaNGuard: non-finite step {step} after {self.rollbacks} rollbacks; giving up.")
        if good is None:
            raise NonFiniteError(
                f"NaNGuard: non-finite step {step} and no complete checkpoint in {folder} to roll back to."
            )
        self.rollbacks += 1
        log.warning(
            "NaNGuard: non-finite step %d; rolling back to %s (%d/%d).", step, good, self.rollbacks, self.max_rollbacks
        )
        restore_in_place(trainer, Path(good))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """While the newest optimizer step was non-finite, mark it as saved for ``ModelCheckpoint`` (which runs after
        every other callback), so no periodic checkpoint holds weights from inside a streak."""
        ckpt = trainer.checkpoint_callback
        if self.streak > 0 and isinstance(ckpt, ModelCheckpoint):
            # The same private duplicate-step guard Preemption uses (no public API skips one save in Lightning 2.6).
            ckpt._last_global_step_saved = trainer.global_step

    @override
    def state_dict(self) -> dict[str, Any]:
        """Counters that survive a resume."""
        return {"skipped_steps": list(self.skipped_steps), "rollbacks": self.rollbacks}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters."""
        self.skipped_steps = list(state_dict.get("skipped_steps", []))
        self.rollbacks = int(state_dict.get("rollbacks", 0))
