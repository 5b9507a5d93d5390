"""Per-optimizer-step learning-rate schedules: linear warmup, then a decay family.

Families (``SchedulerConfig.decay``), all from ``lr`` down to ``min_lr_ratio * lr`` at ``total_steps``:

- ``cosine``: Chinchilla / Llama recipe (Hoffmann et al., arXiv:2203.15556; Loshchilov & Hutter,
  SGDR, arXiv:1608.03983).
- ``linear``: straight line.
- ``wsd``: warmup-stable-decay (Hu et al., MiniCPM, arXiv:2404.06395; Hägele et al.,
  arXiv:2405.18392): the peak LR holds until the last ``decay_fraction`` of the post-warmup steps,
  which decay with ``decay_shape`` = ``cosine``, ``linear`` or ``sqrt`` (``1 - sqrt(p)``).
- ``rex``: REX (Chen, Wolfe & Kyrillidis, arXiv:2107.04197): ``(1 - p) / (1 - p / rex_alpha)``;
  ``rex_alpha = 2`` is the paper's profile, larger values approach linear.
- ``constant``: peak LR after warmup.
- ``none``: no schedule at all (the optimizer's LR at every step; needs ``warmup_steps = 0``).

``p`` is the decay progress in [0, 1]. Warmup is ``(step + 1) / warmup_steps``, so no step runs at
LR 0. A warmup longer than the run is clamped to the run's ``total_steps`` with a warning (as torchtitan
does), so the LR still reaches its peak, at the last step; a warmup of exactly ``total_steps`` is warned
about (it leaves nothing to decay). Resuming under a different ``total_steps`` (e.g. a changed ``trainer.max_steps``) is refused
by :class:`WarmupDecayLR` rather than silently bending the curve: keep ``max_steps`` or pin
``model.scheduler.total_steps`` to the saved value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR

from kempnerforge.errors import UserError

DECAYS = ("cosine", "linear", "wsd", "rex", "constant", "none")
WSD_SHAPES = ("cosine", "linear", "sqrt")


@dataclass
class SchedulerConfig:
    """LR schedule (``--model.scheduler.*`` on the CLI); stepped once per optimizer step."""

    warmup_steps: int = 100
    """Linear warmup length in optimizer steps (from ``lr / warmup_steps`` up to ``lr``)."""
    decay: Literal["cosine", "linear", "wsd", "rex", "constant", "none"] = "cosine"
    """Schedule family after warmup (see the module docstring)."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak LR."""
    total_steps: int | None = None
    """Steps over which to decay (None: the Trainer's ``max_steps``)."""
    decay_fraction: float = 0.2
    """WSD only: fraction of the post-warmup steps spent decaying, in (0, 1]."""
    decay_shape: Literal["cosine", "linear", "sqrt"] = "sqrt"
    """WSD only: shape of the final decay."""
    rex_alpha: float = 2.0
    """REX only: curvature ``alpha > 1`` of ``(1 - p) / (1 - p / alpha)``."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"SchedulerConfig.warmup_steps={self.warmup_steps} must be >= 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SchedulerConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        if self.decay not in DECAYS:
            raise ValueError(f"SchedulerConfig.decay={self.decay!r}; choose one of {', '.join(DECAYS)}.")
        if self.total_steps is not None and self.total_steps <= 0:
            raise ValueError(f"SchedulerConfig.total_steps={self.total_steps} must be > 0 (or None).")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"SchedulerConfig.decay_fraction={self.decay_fraction} must be in (0, 1].")
        if self.decay_shape not in WSD_SHAPES:
            raise ValueError(
                f"SchedulerConfig.decay_shape={self.decay_shape!r}; choose one of {', '.join(WSD_SHAPES)}."
            )
        if not self.rex_alpha > 1:
            raise ValueError(f"SchedulerConfig.rex_alpha={self.rex_alpha} must be > 1.")
        if self.decay == "none" and self.warmup_steps:
            raise ValueError(
                f"SchedulerConfig.decay='none' runs the optimizer's LR unchanged; warmup_steps="
                f"{self.warmup_steps} would be ignored: set it to 0 or use decay='constant'."
            )


def _shape(kind: str, p: float, rex_alpha: float) -> float:
    """Decay curve from 1 (p = 0) to 0 (p = 1)."""
    if kind == "cosine":
        return 0.5 * (1 + math.cos(math.pi * p))
    if kind == "linear":
        return 1 - p
    if kind == "sqrt":
        return 1 - math.sqrt(p)
    return (1 - p) / (1 - p / rex_alpha)  # rex


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Args:
        step: optimizer steps taken so far (the LR of step ``step`` is ``lr * lr_factor(step)``).
        cfg: the schedule.
        total_steps: steps at which the LR reaches ``min_lr_ratio * lr``; later steps stay there.

    Returns:
        A float in (0, 1] during warmup, in [min_lr_ratio, 1] after.
    """
    if cfg.decay == "none":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    kind = cfg.decay
    if cfg.decay == "wsd":
        stable = 1 - cfg.decay_fraction
        if progress <= stable:
            return 1.0
        progress, kind = (progress - stable) / cfg.decay_fraction, cfg.decay_shape
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * _shape(kind, progress, cfg.rex_alpha)


class WarmupDecayLR(LambdaLR):
    """``LambdaLR`` over :func:`lr_factor` whose state remembers the schedule it was built with.

    Args:
        optimizer: the optimizer whose every param group's LR is scaled.
        cfg: the schedule.
        total_steps: see :func:`lr_factor`.
        lr_scale: optional ``step -> multiplier`` applied on top (annealing phases of a data
            mixture, :meth:`kempnerforge.data.mixture.MixtureSchedule.lr_scale`); a pure function of
            the step, so a resume replays it.

    Raises:
        UserError: (a ValueError naming the first differing ``model.scheduler.*`` field) in :meth:`load_state_dict`,
            when the checkpoint's schedule (family, warmup,
            total_steps, ...) differs from this one: resuming would jump to another curve. A checkpoint with
            another number of param groups (another mesh) loads: every group follows the same curve.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: SchedulerConfig,
        total_steps: int,
        lr_scale: Callable[[int], float] | None = None,
    ) -> None:
        self.schedule = {**asdict(cfg), "total_steps": total_steps}
        scale = lr_scale or (lambda step: 1.0)
        super().__init__(optimizer, lambda step: lr_factor(step, cfg, total_steps) * scale(step))

    def state_dict(self) -> dict[str, Any]:
        """LambdaLR's state plus the schedule's settings."""
        return {**super().state_dict(), "schedule": dict(self.schedule)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; refuse a checkpoint written under another schedule."""
        saved = state_dict.get("schedule")
        if saved is not None and saved != self.schedule:
            diff = {k: (saved.get(k), v) for k, v in self.schedule.items() if saved.get(k) != v}
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            # A user error (one line under kforge): typically an auto-resume into a folder a shorter run filled.
            raise UserError(
                f"model.scheduler.{next(iter(diff))}",
                f"The checkpoint's LR schedule differs from this run's ({detail}). Resuming would jump to "
                "another curve: keep trainer.max_steps and model.scheduler.* as saved, or pin "
                "model.scheduler.total_steps to the saved total_steps, or start fresh with --ckpt_path null.",
            )
        super().load_state_dict(self._per_group(state_dict))

    def _per_group(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """LambdaLR's per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``) sized to this optimizer.

        A checkpoint written under another mesh can hold another number of param groups: the optimizers keep
        plain and DTensor parameters in separate groups (:func:`kempnerforge.training.optimizers.param_groups`),
        so e.g. tp=2 without FSDP2 has more groups than dp_shard=2. One curve scales every group and every group
        starts at the same lr, so a list of equal values maps onto any count.

        Raises:
            ValueError: the saved lists differ between groups and their count differs from this optimizer's.
        """
        state = {k: v for k, v in state_dict.items() if k != "schedule"}
        n = len(self.optimizer.param_groups)
        for key in ("base_lrs", "_last_lr", "lr_lambdas"):
            values = state.get(key)
            if not isinstance(values, list) or len(values) == n or not values:
                continue
            if any(v != values[0] for v in values):
                raise ValueError(
                    f"The checkpoint's LR scheduler has {len(values)} param groups with different {key} ({values}); "
                    f"this optimizer has {n}, so they cannot be matched."
                )
            state[key] = values[:1] * n
        return state


def clamp_warmup(cfg: SchedulerConfig, total_steps: int) -> SchedulerConfig:
    """``cfg`` with ``warmup_steps`` clamped to ``total_steps`` when it is longer (warned once, on rank 0: the LR
    would otherwise never reach its peak); ``warmup_steps == total_steps`` is kept and warned about (no decay).
    torchtitan clamps the same way (``lr_scheduler.warmup_steps`` > training steps)."""
    if cfg.decay == "none" or cfg.warmup_steps < total_steps:
        return cfg
    fix = (
        "set model.scheduler.warmup_steps below the run's steps (trainer.max_steps or model.scheduler.total_steps) "
        "to warm up and then decay"
    )
    if cfg.warmup_steps == total_steps:
        rank_zero_warn(
            f"model.scheduler.warmup_steps={cfg.warmup_steps} equals the run's {total_steps} steps: the LR reaches "
            f"its peak at the last step and never decays; {fix}."
        )
        return cfg
    rank_zero_warn(
        f"model.scheduler.warmup_steps={cfg.warmup_steps} is longer than the run's {total_steps} steps: warmup "
        f"clamped to {total_steps} steps, so the LR reaches its peak at the last step (with no decay); {fix}."
    )
    return replace(cfg, warmup_steps=total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: SchedulerConfig,
    total_steps: int,
    lr_scale: Callable[[int], float] | None = None,
) -> WarmupDecayLR:
    """:class:`WarmupDecayLR` for ``cfg`` (times ``lr_scale(step)`` when given), with a warmup longer than
    ``total_steps`` clamped to it (:func:`clamp_warmup`).

    Raises:
        ValueError: ``total_steps`` < 1.
    """
    if total_steps < 1:
        raise ValueError(
            f"The LR schedule needs a positive number of steps; got {total_steps}. "
            "Set trainer.max_steps or model.scheduler.total_steps."
        )
    return WarmupDecayLR(optimizer, clamp_warmup(cfg, total_steps), total_steps, lr_scale)
