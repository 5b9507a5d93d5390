"""Finiteness checks of a step's loss and gradients, and in-place rollback to a checkpoint."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient was found (the message names the step)."""


def nonfinite_flag(loss: torch.Tensor | None, params: Iterable[torch.nn.Parameter] | None = None) -> torch.Tensor:
    """A 0-d bool tensor on the loss' device: True when the loss or any local gradient shard is not finite.

    Stays on the device (no host sync); the caller reduces it across ranks. DTensor gradients are
    checked on their local shard (the all-reduce of the flag makes the check global).
    """
    device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")
    flag = torch.zeros((), dtype=torch.bool, device=device)
    if isinstance(loss, torch.Tensor):
        flag = flag | ~torch.isfinite(loss.detach()).all()
    for p in params or ():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            flag = flag | ~torch.isfinite(g).all().to(device)
    return flag


def restore_in_place(trainer: object, path: Path) -> None:
    """Reload model, optimizer and LR-scheduler state from checkpoint ``path`` into the running trainer.

    Uses the strategy's own loader: for ``KempnerStrategy`` it restores the DCP shards in place and
    returns metadata; other strategies return the full dict, loaded here. Loop counters (global step)
    and the data position are not rewound.
    """
    strategy = trainer.strategy  # type: ignore[attr-defined]
    ckpt = strategy.load_checkpoint(path)
    if "state_dict" in ckpt:
        strategy.load_model_state_dict(ckpt)
    if "optimizer_states" in ckpt:
        strategy.load_optimizer_state_dict(ckpt)
    for config, state in zip(trainer.lr_scheduler_configs, ckpt.get("lr_schedulers", []), strict=False):  # type: ignore[attr-defined]
        config.scheduler.load_state_dict(state)
