"""Device health and collective liveness every N steps; a failure stops the run with a checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from kempnerforge.metrics.health import DeviceHealth, all_reduce_with_timeout, check_device

log = logging.getLogger(__name__)


class HealthCheck(Callback):
    """Checks every rank's device (compute + memory sanity) at the start of training and every
    ``every_n_steps`` steps, then agrees on the result with one all-reduce under a timeout that
    doubles as the collective liveness probe.

    - All healthy: nothing happens (the check costs one device sync and one tiny all-reduce).
    - A device check failed on some rank (collectives still work): every rank joins one checkpoint
      save to ``dirpath/health-step=<step>.ckpt`` (``trainer.save_checkpoint``, so KempnerStrategy
      writes a sharded DCP directory), then ``trainer.should_stop`` ends the run cleanly. The failed
      ranks and reasons are in :attr:`failure` and the log.
    - The all-reduce does not finish within ``collective_timeout_s``: a rank is stalled or gone, so
      no collective save can complete; the run raises
      :class:`~kempnerforge.metrics.health.CollectiveTimeoutError` at once instead of hanging until
      the process-group timeout, and a restart resumes from the last complete checkpoint.

    Args:
        every_n_steps: check interval in optimizer steps (0: only at the start).
        check_at_start: also check before the first step.
        collective_timeout_s: seconds the liveness all-reduce may take.
        dirpath: where the stop checkpoint goes; None uses ``trainer.default_root_dir``.
        matmul_n: matmul size of the compute check.
        memory_mb: MiB written and read back by the memory check.

    Raises:
        ValueError: ``every_n_steps`` < 0, ``collective_timeout_s`` <= 0, ``matmul_n`` or ``memory_mb`` < 1.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        check_at_start: bool = True,
        collective_timeout_s: float = 60.0,
        dirpath: str | None = None,
        matmul_n: int = 256,
        memory_mb: int = 64,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"HealthCheck.every_n_steps={every_n_steps!r} must be an integer >= 0 (0: start only)")
        if not collective_timeout_s > 0:
            raise ValueError(f"HealthCheck.collective_timeout_s={collective_timeout_s!r} must be > 0 seconds")
        for name, value in (("matmul_n", matmul_n), ("memory_mb", memory_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HealthCheck.{name}={value!r} must be an integer >= 1")
        self.every_n_steps = every_n_steps
        self.check_at_start = check_at_start
        self.collective_timeout_s = collective_timeout_s
        self.dirpath = dirpath
        self.matmul_n = matmul_n
        self.memory_mb = memory_mb
        self.checks = 0
        self.failure: dict[str, Any] | None = None
        self.stop_checkpoint: Path | None = None

    def check_device(self, device: torch.device) -> DeviceHealth:
        """This rank's device check (:func:`kempnerforge.metrics.health.check_device`); override to extend."""
        return check_device(device, self.matmul_n, self.memory_mb)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Check before the first step."""
        if self.check_at_start:
            self._check(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Check every ``every_n_steps`` optimizer steps."""
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and not trainer.should_stop:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        device = trainer.strategy.root_device
        health = self.check_device(device)
        self.checks += 1
        world = trainer.world_size
        # One slot per rank: the sum tells every rank which ranks failed.
        flags = torch.zeros(world, dtype=torch.float32, device=device)
        flags[trainer.global_rank] = 0.0 if health.ok else 1.0
        if world > 1 and dist.is_available() and dist.is_initialized():
            all_reduce_with_timeout(flags, self.collective_timeout_s)
        failed = [r for r, f in enumerate(flags.tolist()) if f > 0]
        if not failed:
            return
        step = trainer.global_step
        self.failure = {"step": step, "ranks": failed, "reason": health.reason}
        log.error(
            f"HealthCheck: device check failed on ranks {failed} at step {step}: {health.reason or '(other rank)'}"
        )
        root = Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir)
        self.stop_checkpoint = root / f"health-step={step:06d}.ckpt"
        trainer.save_checkpoint(self.stop_checkpoint)
        trainer.should_stop = True
