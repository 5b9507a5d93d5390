"""Say why a checkpoint does not fit the model being resumed, in config terms rather than missing tensor keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Hyperparameter groups that decide a model's parameters (``CausalLM`` and ``VisionLanguage`` save them as dicts).
MODEL_GROUPS: tuple[str, ...] = ("config", "vlm", "encoder", "connector")
#: ``ModelConfig`` fields added after checkpoints were written without them, and the value those checkpoints had:
#: the parameter layout (``wq``/``wk``/``wv`` and ``w1``/``w3`` before the fused projections existed).
LEGACY_MODEL_FIELDS: dict[str, Any] = {"fuse_qkv": False, "fuse_w13": False}


def with_legacy_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """A saved ``ModelConfig`` dict with every :data:`LEGACY_MODEL_FIELDS` field it lacks set to its old value."""
    return {**LEGACY_MODEL_FIELDS, **config}


def _resolved_head_dim(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``head_dim`` None replaced by dim / n_heads: configs saved while the field was stored
    resolved hold the number, later ones None for the same model."""
    if config.get("head_dim") is None and config.get("dim") and config.get("n_heads"):
        return {**config, "head_dim": config["dim"] // config["n_heads"]}
    return config


def model_config_diff(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """The model settings that differ between a checkpoint's ``hyper_parameters`` and this run's.

    Args:
        saved: the checkpoint's ``hyper_parameters`` (None for a checkpoint without them).
        current: the LightningModule's ``hparams``.

    Returns:
        ``["model.vlm.arch: saved 'joint_decoder', now 'cross_attention'", ...]`` over :data:`MODEL_GROUPS`
        (a group present on one side only counts as one entry); empty when nothing differs or nothing was saved.
        A config saved before a :data:`LEGACY_MODEL_FIELDS` field existed counts as holding its old value
        (unfused projections), and a differing layout field names the flag that resumes the checkpoint.
        ``head_dim`` is compared resolved (None = dim / n_heads).
    """
    if not saved:
        return []
    out = []
    for group in MODEL_GROUPS:
        a, b = saved.get(group), current.get(group)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            a = _resolved_head_dim(with_legacy_fields(a)) if group == "config" else a
            b = _resolved_head_dim(with_legacy_fields(b)) if group == "config" else b
            out += [f"model.{group}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" + _hint(group, k, a.get(k))
                    for k in sorted({*a, *b}) if a.get(k) != b.get(k)]  # fmt: skip
        elif (a is None) != (b is None):
            out.append(f"model.{group}: {'only in the checkpoint' if b is None else 'not in the checkpoint'}")
    return out


def _hint(group: str, key: str, saved: Any) -> str:
    """For a layout-only field (the weights are the same network), the flag that resumes the checkpoint."""
    return (
        f" (set --model.{group}.{key}={saved} to resume it)" if group == "config" and key in LEGACY_MODEL_FIELDS else ""
    )


def layout_resume_flags(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """The flags that resume a checkpoint whose model differs from this run's only in :data:`LEGACY_MODEL_FIELDS`
    (the same network, its projections laid out differently: e.g. one written before ``fuse_qkv`` / ``fuse_w13``
    existed, or with them False, resumed into a run with the default fused projections).

    Args:
        saved, current: as for :func:`model_config_diff`.

    Returns:
        ``["--model.config.fuse_qkv=False", "--model.config.fuse_w13=False"]`` (the saved values); empty when
        nothing differs or when any other model setting differs too.
    """
    if not saved or any(saved.get(g) != current.get(g) for g in MODEL_GROUPS if g != "config"):
        return []
    a, b = saved.get("config"), current.get("config")
    if not isinstance(a, Mapping) or not isinstance(b, Mapping):
        return []
    a, b = with_legacy_fields(a), with_legacy_fields(b)
    differ = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
    if not differ or any(k not in LEGACY_MODEL_FIELDS for k in differ):
        return []
    return [f"--model.config.{k}={a.get(k)}" for k in differ]
