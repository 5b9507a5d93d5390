"""Device memory per step (CUDA allocator counters, or process RSS on CPU) and optional CUDA snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from kempnerforge.metrics.memory import memory_stats


class MemoryMonitor(Callback):
    """Logs ``memory/<key>_gb`` every ``every_n_steps`` steps, per rank's own device.

    CUDA: ``allocated``, ``reserved``, ``peak`` (max allocated); CPU: ``rss`` and ``peak`` (process
    peak RSS) (:func:`kempnerforge.metrics.memory.memory_stats`). Reading them does not synchronize.
    The latest values are in :attr:`last` (GiB).

    With ``snapshot_steps`` (CUDA only), allocator history is recorded from the start of training
    and a snapshot is dumped after each listed global step to ``snapshot_dir/snapshot_step{S}_rank{R}.pickle``
    (open it at https://pytorch.org/memory_viz).

    Args:
        every_n_steps: logging interval in optimizer steps; None uses ``trainer.log_every_n_steps``.
        snapshot_steps: global steps after which to dump a CUDA memory snapshot.
        snapshot_dir: where snapshots go (created).
        max_entries: allocator history entries kept for snapshots.

    Raises:
        ValueError: ``every_n_steps`` < 1, a negative snapshot step; at ``setup``, snapshot steps on a
            device other than CUDA (the allocator history exists only there).
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        snapshot_steps: list[int] | None = None,
        snapshot_dir: str = "memory_snapshots",
        max_entries: int = 100_000,
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"MemoryMonitor.every_n_steps={every_n_steps!r} must be an integer >= 1 or None")
        steps = list(snapshot_steps or [])
        if any(not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"MemoryMonitor.snapshot_steps={steps!r} must be non-negative integers")
        self.every_n_steps = every_n_steps
        self.snapshot_steps = set(steps)
        self.snapshot_dir = Path(snapshot_dir)
        self.max_entries = max_entries
        self.last: dict[str, float] = {}
        self.snapshots: list[Path] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse snapshots off CUDA before training starts."""
        if self.snapshot_steps and trainer.strategy.root_device.type != "cuda":
            raise ValueError(
                f"MemoryMonitor.snapshot_steps={sorted(self.snapshot_steps)} needs a CUDA device "
                f"(got {trainer.strategy.root_device}); leave snapshot_steps empty on CPU"
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start recording allocator history when snapshots are asked for."""
        if self.snapshot_steps:
            # torch's documented snapshot API ("Understanding CUDA Memory Usage") is underscored; no other exists.
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log memory at the interval; dump a snapshot after the listed steps."""
        step = trainer.global_step
        device = trainer.strategy.root_device
        every = self.every_n_steps or max(1, trainer.log_every_n_steps)
        if step % every == 0 or trainer.fast_dev_run:
            self.last = memory_stats(device)
            for key, value in self.last.items():
                # A host tensor: Lightning would copy a Python float to the device (a blocking copy on CUDA).
                host = torch.tensor(float(value), dtype=torch.float64)
                pl_module.log(f"memory/{key}_gb", host, on_step=True, on_epoch=False, rank_zero_only=True)
        if step in self.snapshot_steps:
            self.snapshot_dir.mkdir(parents=True, exist_ok=True)
            path = self.snapshot_dir / f"snapshot_step{step}_rank{trainer.global_rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            self.snapshots.append(path)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Stop recording allocator history."""
        if self.snapshot_steps:
            torch.cuda.memory._record_memory_history(enabled=None)
