"""Optimizer hyperparameters changed on resume: applied over the restored state, and said so.

A checkpoint restores every param group as it was saved (its ``lr``, ``betas``, ``weight_decay``, ``eps``) and the
schedule's ``base_lrs``, so a new ``--model.optimizer.lr`` given on resume would otherwise be ignored without a word
(Lightning and torchtitan both restore the saved values; Megatron-LM has ``--override-opt_param-scheduler`` for the
same need). Here a value of ``model.optimizer`` that differs from the checkpoint's is applied over the restored
state, one line each: ``model.optimizer.lr: checkpoint 0.003, now 0.0001 (applied)``.

- ``lr`` (the schedule's peak): every group's ``lr``, ``initial_lr`` and the schedule's ``base_lrs`` are scaled by
  ``new / saved``, so the step's position on the warmup / decay curve is kept and groups that run at another lr
  (Muon's AdamW groups) keep their ratio; the next logged ``train/lr`` is the new peak times the curve.
- ``beta1`` / ``beta2``: the groups' ``betas`` (AdamW, Schedule-Free, Lion), ``momentum`` is not touched.
- ``weight_decay``: the groups that decay (a group saved with 0, norms and biases, keeps 0).
- ``eps``: the groups that have one.

The schedule's own fields are not overridable: a changed warmup, total or family is refused by
:class:`~kempnerforge.training.lr.WarmupDecayLR` (another curve). Moments (``exp_avg``, ...) are kept.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OVERRIDABLE", "apply_optimizer_overrides"]

#: ``model.optimizer`` fields a resume may change.
OVERRIDABLE = ("lr", "beta1", "beta2", "weight_decay", "eps")


def changed_fields(saved: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``field -> (saved, now)`` for each of :data:`OVERRIDABLE` whose value differs (nothing without a saved dict,
    or when the optimizer itself changed: its name decides what the state means)."""
    if not saved or saved.get("name", now.get("name")) != now.get("name"):
        return {}
    return {k: (saved[k], now[k]) for k in OVERRIDABLE if k in saved and k in now and saved[k] != now[k]}


def _set_group(group: dict[str, Any], field: str, old: float, new: float) -> None:
    if field == "lr":
        for key in ("lr", "initial_lr"):
            if key in group:
                value = group[key]
                scaled = value * (new / old)
                group[key] = value.fill_(scaled) if isinstance(value, torch.Tensor) else scaled
    elif field in ("beta1", "beta2") and "betas" in group:
        betas = list(group["betas"])
        betas[0 if field == "beta1" else 1] = new
        group["betas"] = tuple(betas)
    elif field == "weight_decay" and group.get("weight_decay"):
        group["weight_decay"] = new
    elif field == "eps" and "eps" in group:
        group["eps"] = new


def apply_optimizer_overrides(
    saved: dict[str, Any] | None,
    now: dict[str, Any],
    optimizers: list[torch.optim.Optimizer],
    scheduler_states: list[dict[str, Any]] | None,
) -> list[str]:
    """Apply this run's ``model.optimizer`` values that differ from the checkpoint's over the restored state.

    Args:
        saved: the checkpoint's ``hyper_parameters["optimizer"]`` (a dict of :class:`OptimizerConfig` fields).
        now: this run's, as a dict.
        optimizers: the restored optimizers (their param groups are changed in place).
        scheduler_states: Lightning's ``checkpoint["lr_schedulers"]``, not yet loaded into the schedulers (their
            ``base_lrs`` are scaled in place for a new ``lr``).

    Returns:
        One line per applied field, ``model.optimizer.<field>: checkpoint <saved>, now <new> (applied)``.
    """
    lines = []
    for field, (old, new) in changed_fields(saved, now).items():
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                _set_group(group, field, old, new)
        if field == "lr":
            for state in scheduler_states or []:
                if isinstance(state.get("base_lrs"), list):
                    state["base_lrs"] = [b * (new / old) for b in state["base_lrs"]]
                if isinstance(state.get("_last_lr"), list):
                    state["_last_lr"] = [b * (new / old) for b in state["_last_lr"]]
        lines.append(f"model.optimizer.{field}: checkpoint {old:g}, now {new:g} (applied)")
    return lines
