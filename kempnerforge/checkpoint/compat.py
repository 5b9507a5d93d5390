"""Say why a checkpoint does not fit the model being resumed, in config terms rather than missing tensor keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Hyperparameter groups that decide a model's parameters (``CausalLM`` and ``VisionLanguage`` save them as dicts).
MODEL_GROUPS: tuple[str, ...] = ("config", "vlm", "encoder", "connector")


def model_config_diff(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """The model settings that differ between a checkpoint's ``hyper_parameters`` and this run's.

    Args:
        saved: the checkpoint's ``hyper_parameters`` (None for a checkpoint without them).
        current: the LightningModule's ``hparams``.

    Returns:
        ``["model.vlm.arch: saved 'joint_decoder', now 'cross_attention'", ...]`` over :data:`MODEL_GROUPS`
        (a group present on one side only counts as one entry); empty when nothing differs or nothing was saved.
    """
    if not saved:
        return []
    out = []
    for group in MODEL_GROUPS:
        a, b = saved.get(group), current.get(group)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += [f"model.{group}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted({*a, *b})
                    if a.get(k) != b.get(k)]  # fmt: skip
        elif (a is None) != (b is None):
            out.append(f"model.{group}: {'only in the checkpoint' if b is None else 'not in the checkpoint'}")
    return out
