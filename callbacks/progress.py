"""A progress bar whose metrics do not read the device every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class ProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, with the metrics after it (``train/loss``, ...) refreshed every
    ``metrics_every_n_steps`` optimizer steps instead of every batch.

    Lightning converts every ``prog_bar=True`` metric to a Python number after each training batch (its
    logger connector fills ``trainer.progress_bar_metrics``), and its bars convert them again at each
    refresh: one host read-back per metric per batch, a device synchronization every step. So
    kempnerforge logs ``train/loss`` without ``prog_bar``, and this bar shows the ``metric_names`` it
    reads from ``trainer.callback_metrics`` (device tensors, no conversion) next to the usual
    ``prog_bar`` metrics, but only every ``metrics_every_n_steps`` optimizer steps (when the logger
    reads them anyway), at the end of an epoch and after validation. The bar itself still advances
    every ``refresh_rate`` batches. ``kforge fit`` uses this bar unless the configuration names another
    progress bar or sets ``enable_progress_bar: false``.

    Args:
        refresh_rate: batches between redraws of the bar (Lightning's ``TQDMProgressBar`` argument).
        metrics_every_n_steps: optimizer steps between metric refreshes (None: the trainer's
            ``log_every_n_steps``).
        metric_names: logged metrics shown on the bar (read from ``trainer.callback_metrics``).
        leave: keep the finished bar of each epoch on screen.

    Raises:
        ValueError: ``metrics_every_n_steps`` < 1.
    """

    def __init__(
        self,
        refresh_rate: int = 1,
        metrics_every_n_steps: int | None = None,
        metric_names: Sequence[str] = ("train/loss",),
        leave: bool = False,
    ) -> None:
        if metrics_every_n_steps is not None and (
            isinstance(metrics_every_n_steps, bool)
            or not isinstance(metrics_every_n_steps, int)
            or metrics_every_n_steps < 1
        ):
            raise ValueError(
                f"ProgressBar.metrics_every_n_steps={metrics_every_n_steps!r} must be an integer >= 1 or None."
            )
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.metrics_every_n_steps = metrics_every_n_steps
        self.metric_names = tuple(metric_names)
        self._metrics_step = -1  # global step whose metrics are shown

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Advance the bar; read the metrics only at the metrics interval."""
        bar = self.train_progress_bar
        n = batch_idx + 1
        if bar is None or not self._should_update(n, bar.total):
            return
        if not bar.disable:
            bar.n = n
            bar.refresh()
        every = self.metrics_every_n_steps or max(1, trainer.log_every_n_steps)
        step = trainer.global_step
        if step != self._metrics_step and step % every == 0:
            self._metrics_step = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def get_metrics(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        """Lightning's bar metrics plus :attr:`metric_names` (one host read-back each; called at the
        metrics interval only)."""
        items = super().get_metrics(trainer, pl_module)
        for name in self.metric_names:
            value = trainer.callback_metrics.get(name)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                items[name] = float(value)
        return items
