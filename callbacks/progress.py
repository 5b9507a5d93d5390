"""Training progress for a terminal (a bar over optimizer steps) or a batch job's log (one plain line per
logging interval), with metrics that do not read the device every step."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from kempnerforge.metrics.display import eta_seconds, format_duration, format_metrics, progress_line

#: Metrics shown by default, in this order (those a run logs; the others are skipped).
DEFAULT_METRICS = (
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_s",
    "train/mfu",
    "train/mfu_fp8",
    "memory/peak_gb",
)
STYLES = ("auto", "bar", "lines")


def read_scalars(metrics: Mapping[str, Any], names: Sequence[str]) -> dict[str, float]:
    """The one-element tensors (and numbers) of ``metrics`` named in ``names``, as Python floats, with one
    host read-back per device: the tensors of one device are stacked and read by a single ``tolist``
    (host tensors cost nothing), instead of one synchronizing ``float()`` each."""
    found: dict[str, float] = {}
    groups: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name in names:
        value = metrics.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            groups.setdefault(value.device, []).append((name, value))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[name] = float(value)
    for device, items in groups.items():
        dtype = torch.float64 if device.type == "cpu" else torch.float32  # MPS has no float64
        stacked = torch.stack([t.detach().reshape(()).to(dtype) for _, t in items])
        found.update(zip((n for n, _ in items), stacked.tolist(), strict=True))
    return {n: found[n] for n in names if n in found}


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


class ProgressBar(TQDMProgressBar):
    """Training progress on global rank 0, in one of two renderings of the same metrics:

    - ``bar`` (a terminal): a TQDM bar over optimizer steps, ``step 37/100``, with short metric names
      (``loss``, ``lr``, ``grad_norm``, ``tokens/s``, ``MFU``, ``peak_mem``, ``val_loss``);
    - ``lines`` (stdout is a file: a SLURM ``.out``, ``nohup``, CI): no bar, one plain line per logging
      interval, ``step 5/100 | loss 10.6021 | lr 1.50e-03 | grad_norm 1.23 | tokens/s 1,234 | MFU 20.5% |
      peak_mem 2.91GiB | elapsed 0:00:05 | ETA 0:01:35``, a line after each validation and one at the end.

    ``auto`` picks ``bar`` when stdout is a terminal, else ``lines``. Metric names, units and formats:
    :mod:`kempnerforge.metrics.display`; ETA extrapolates the mean step time since this run started.

    Host synchronizations: Lightning converts every ``prog_bar=True`` metric to a Python number after each
    batch (a device read-back per metric), so kempnerforge logs its device metrics (``train/loss``,
    ``train/grad_norm``) without ``prog_bar``; this callback reads ``metric_names`` from
    ``trainer.callback_metrics`` only every ``metrics_every_n_steps`` optimizer steps (when the logger reads
    them anyway), at the end of an epoch and after validation, all device values of one read in a single
    read-back (:func:`read_scalars`). Host tensors (``train/lr``, tokens/s, MFU, memory) cost nothing.
    Both renderings read at the same steps. ``kforge fit`` uses this callback unless the configuration
    names another progress bar or sets ``enable_progress_bar: false``.

    Args:
        refresh_rate: batches between redraws of the bar (Lightning's ``TQDMProgressBar`` argument).
        metrics_every_n_steps: optimizer steps between metric reads (and lines) (None: the trainer's
            ``log_every_n_steps``).
        metric_names: logged metrics to show, in order (read from ``trainer.callback_metrics``; the bar
            also shows any other ``prog_bar=True`` metric).
        style: ``auto``, ``bar`` or ``lines`` (see above).

    Raises:
        ValueError: ``metrics_every_n_steps`` < 1, or ``style`` not one of ``auto``, ``bar``, ``lines``.
    """

    #: The training bar: ``step 37/100  37%|███▋      | [00:41<01:10, 1.12s/step, loss=...]``.
    STEP_BAR_FORMAT = (
        "{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    )

    def __init__(
        self,
        refresh_rate: int = 1,
        metrics_every_n_steps: int | None = None,
        metric_names: Sequence[str] = DEFAULT_METRICS,
        style: Literal["auto", "bar", "lines"] = "auto",
    ) -> None:
        if metrics_every_n_steps is not None and (
            isinstance(metrics_every_n_steps, bool)
            or not isinstance(metrics_every_n_steps, int)
            or metrics_every_n_steps < 1
        ):
            raise ValueError(
                f"ProgressBar.metrics_every_n_steps={metrics_every_n_steps!r} must be an integer >= 1 or None."
            )
        if style not in STYLES:
            raise ValueError(f"ProgressBar.style={style!r} must be one of {list(STYLES)}.")
        super().__init__(refresh_rate=refresh_rate)
        self.metrics_every_n_steps = metrics_every_n_steps
        self.metric_names = tuple(metric_names)
        self.style = style
        self.lines = style == "lines" or (style == "auto" and not _stdout_is_terminal())
        self._metrics_step = -1  # global step whose metrics were read last
        self._start_step = 0
        self._start_time = time.monotonic()
        self._total: int | None = None

    @property
    @override
    def is_enabled(self) -> bool:
        """Whether TQDM bars are drawn (never in the ``lines`` rendering)."""
        return super().is_enabled and not self.lines

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the bar (or the clock of the lines) at this run's first optimizer step."""
        super().on_train_start(trainer, pl_module)
        self._start_step, self._start_time = trainer.global_step, time.monotonic()
        self._total, self._metrics_step = total_steps(trainer), -1
        bar = self.train_progress_bar
        bar.reset(total=self._total)
        bar.initial = bar.n = self._start_step
        bar.set_description_str("step")
        if self.lines and trainer.is_global_zero:
            every = self.metrics_every_n_steps or max(1, trainer.log_every_n_steps)
            total = "?" if self._total is None else self._total
            self._print(f"training: steps {self._start_step}->{total}, one line every {every} steps")

    @override
    def init_train_tqdm(self) -> Tqdm:
        """Lightning's training bar, counting optimizer steps (``unit="step"``, :attr:`STEP_BAR_FORMAT`)."""
        bar = super().init_train_tqdm()
        bar.unit, bar.bar_format = "step", self.STEP_BAR_FORMAT
        return bar

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        """Nothing: the bar counts optimizer steps over all epochs (Lightning's restarts every epoch)."""

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Advance the bar; read the metrics (and print a line) only at the metrics interval."""
        bar = self.train_progress_bar
        step = trainer.global_step
        if self._should_update(batch_idx + 1, None) or step == self._total:
            bar.n = step
            bar.refresh()
        every = self.metrics_every_n_steps or max(1, trainer.log_every_n_steps)
        if step != self._metrics_step and step % every == 0:
            self._show(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Show the metrics of the epoch's last step (unless its interval just did)."""
        if trainer.global_step != self._metrics_step:
            self._show(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the validation bar; in ``lines``, print the validation metrics of this fit."""
        if not self.lines:
            super().on_validation_end(trainer, pl_module)
            return
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()
        if trainer.state.fn == "fit" and not trainer.sanity_checking and trainer.is_global_zero:
            names = [n for n in trainer.callback_metrics if n.startswith("val/")]
            values = format_metrics(read_scalars(trainer.callback_metrics, names))
            if values:
                self._print(progress_line(trainer.global_step, self._total, values))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the bar; in ``lines``, a last line with the run's wall time."""
        super().on_train_end(trainer, pl_module)
        if self.lines and trainer.is_global_zero:
            elapsed = format_duration(time.monotonic() - self._start_time)
            self._print(progress_line(trainer.global_step, self._total, {}, {"done in": elapsed}))

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict]:
        """Console name -> formatted value: :attr:`metric_names` (one read-back per device, :func:`read_scalars`),
        then Lightning's other ``prog_bar`` metrics (numbers already; ``v_num`` dropped). Called at the
        metrics interval, epoch ends and after validation only."""
        pbar = dict(super().get_metrics(trainer, pl_module))
        pbar.pop("v_num", None)
        values = read_scalars(trainer.callback_metrics, self.metric_names)
        values.update((k, v) for k, v in pbar.items() if k not in values and isinstance(v, int | float))
        return format_metrics(values, self.metric_names)

    def _show(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._metrics_step = trainer.global_step
        if not trainer.is_global_zero:
            return
        metrics = self.get_metrics(trainer, pl_module)
        if not self.lines:
            self.train_progress_bar.set_postfix(metrics)
            return
        metrics = {k: v for k, v in metrics.items() if not k.startswith("val")}  # validation has its own line
        elapsed = time.monotonic() - self._start_time
        times = {"elapsed": format_duration(elapsed)}
        eta = eta_seconds(trainer.global_step, self._start_step, self._total, elapsed)
        if eta is not None:
            times["ETA"] = format_duration(eta)
        self._print(progress_line(trainer.global_step, self._total, metrics, times))

    @staticmethod
    def _print(line: str) -> None:
        # flush: a redirected stdout is block-buffered, and a job's log should be current when it is killed.
        print(line, file=sys.stdout, flush=True)


def total_steps(trainer: Trainer) -> int | None:
    """The fit's total optimizer steps: ``max_steps``, or what the epochs and data length give
    (``trainer.estimated_stepping_batches``); None when unbounded or unknown."""
    total = trainer.estimated_stepping_batches  # inf for a data set without a length and no max_steps
    return int(total) if isinstance(total, int | float) and math.isfinite(total) else None
