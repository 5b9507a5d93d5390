"""The model summary at the start of a fit, without Lightning's FLOPs column (it is always 0 here)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

#: Columns of Lightning's summary left out: FLOPs are counted by running a forward on ``example_input_array``.
DROPPED_COLUMNS = ("FLOPs",)


class ModelSummary(LightningModelSummary):
    """Lightning's model summary (layers, parameter counts, size, train/eval modes) as a plain-text table,
    without the ``FLOPs`` column and ``Total FLOPs`` line.

    Lightning counts FLOPs by running a forward pass over the module's ``example_input_array`` on global
    rank 0 while summarizing; kempnerforge's modules set none, because on a sharded model (FSDP2, TP, PP)
    a forward on one rank alone waits forever for the other ranks' collectives, and a 70B model's
    forward at start-up is not free. Without one Lightning prints FLOPs 0. The training FLOPs that
    matter, per token, are the ones MFU uses (``MFUMonitor`` logs ``train/mfu`` from them:
    :meth:`kempnerforge.config.ModelConfig.flops_per_token`). Plain text (no box drawing) reads the same
    in a terminal and in a batch job's log. ``kforge fit`` uses this summary unless the configuration
    names a model summary callback or sets ``enable_model_summary: false``.

    Args:
        max_depth: nesting depth of the listed modules (0: no summary), as Lightning's.
    """

    def __init__(self, max_depth: int = 1) -> None:
        super().__init__(max_depth=max_depth)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the summary on global rank 0 through Lightning's logger, as Lightning's own summary is (``kforge``
        holds it with the distributed banner until the run's checks pass); every rank summarizes: it only counts
        parameters."""
        if not self._max_depth:
            return
        summary = self._summary(trainer, pl_module)
        if trainer.is_global_zero:
            data = [(name, column) for name, column in summary._get_summary_data() if name not in DROPPED_COLUMNS]
            text = format_summary(
                data, summary.total_parameters, summary.trainable_parameters, summary.model_size,
                summary.total_training_modes,
            )  # fmt: skip
            rank_zero_info(text)


def format_summary(
    columns: list[tuple[str, list[Any]]],
    total_params: int,
    trainable_params: int,
    size_mb: float,
    modes: dict[str, int],
) -> str:
    """A plain-text table of ``columns`` (header, cells) and the totals under it (parameters, size in MB as
    Lightning computes it, modules in train / eval mode)."""
    widths = [max(len(header), *(len(str(c)) for c in cells)) for header, cells in columns]
    rows = [[header for header, _ in columns]] + [list(r) for r in zip(*(cells for _, cells in columns), strict=True)]
    lines = [" | ".join(f"{str(c):<{w}}" for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    rule = "-" * max(len(line) for line in lines)
    totals = [
        (get_human_readable_count(trainable_params), "Trainable params"),
        (get_human_readable_count(total_params - trainable_params), "Non-trainable params"),
        (get_human_readable_count(total_params), "Total params"),
        (get_formatted_model_size(size_mb), "Total estimated model params size (MB)"),
        (str(modes["train"]), "Modules in train mode"),
        (str(modes["eval"]), "Modules in eval mode"),
    ]
    return "\n".join([lines[0], rule, *lines[1:], rule, *(f"{value:<10} {what}" for value, what in totals)])
