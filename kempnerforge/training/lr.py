"""Per-step learning-rate schedule: linear warmup, then cosine (or linear / constant) decay.

Follows the Chinchilla / Llama recipe (warmup then cosine to ``min_lr_ratio * lr``;
Hoffmann et al., arXiv:2203.15556; Loshchilov & Hutter, SGDR, arXiv:1608.03983).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR


@dataclass
class SchedulerConfig:
    """LR schedule (``--model.scheduler.*`` on the CLI); stepped once per optimizer step."""

    warmup_steps: int = 100
    """Linear warmup length in optimizer steps (from ``lr / warmup_steps`` up to ``lr``)."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warmup."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak LR."""
    total_steps: int | None = None
    """Steps over which to decay (None: the Trainer's ``max_steps``)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"SchedulerConfig.warmup_steps={self.warmup_steps} must be >= 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SchedulerConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        if self.decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"SchedulerConfig.decay={self.decay!r}; choose 'cosine', 'linear' or 'constant'.")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ValueError(f"SchedulerConfig.total_steps={self.total_steps} must be > 0 (or None).")


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): warmup, then decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int) -> LambdaLR:
    """``LambdaLR`` applying :func:`lr_factor`; raises ValueError if ``total_steps`` < 1."""
    if total_steps < 1:
        raise ValueError(
            f"The LR schedule needs a positive number of steps; got {total_steps}. "
            "Set trainer.max_steps or model.scheduler.total_steps."
        )
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
