"""Freeze specs: which parameters of a VLM train, per component and by name pattern.

A :class:`FreezeSpec` is applied by setting ``requires_grad`` on the (sharded) parameters; FSDP2 copies
the flag to its unsharded parameters at every all-gather (``FSDPParam.to_unsharded``), so a change
between steps takes effect at the next forward.
The optimizer holds every parameter that is trainable under *any* spec of the run (the initial one
and every step of a :class:`~kempnerforge.callbacks.FreezeSchedule`), each with its AdamW state
created up front (:func:`init_adamw_state`): the optimizer's state tree is then the same whatever
is frozen when a checkpoint is written or restored, so a resume never meets missing or unexpected
optimizer state. A frozen parameter has no gradient, which AdamW skips (its moments stay as they were).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from kempnerforge.model.init import canonical_fqn

#: Top-level components of :class:`~kempnerforge.model.vlm.model.VisionLanguageModel`.
COMPONENTS: tuple[str, ...] = ("encoder", "connector", "backbone")


@dataclass
class FreezeSpec:
    """What is frozen. A parameter trains unless its component is frozen or it matches ``frozen_patterns``;
    ``trainable_patterns`` then win over both (e.g. freeze the backbone but train ``backbone.layers.*.cross_*``).

    Patterns are ``fnmatch`` patterns over canonical parameter FQNs (``backbone.layers.0.attention.wq.weight``);
    per-modality weights are selected this way (e.g. MoT's ``backbone.layers.*.*image*``).
    """

    encoder: bool = True
    """Freeze the vision tower (the default: pretrained towers are usually kept fixed)."""
    connector: bool = False
    """Freeze the connector."""
    backbone: bool = False
    """Freeze the text backbone."""
    frozen_patterns: list[str] = field(default_factory=list)
    """Further parameters to freeze, by FQN pattern."""
    trainable_patterns: list[str] = field(default_factory=list)
    """Parameters to train even inside a frozen component or a frozen pattern, by FQN pattern."""

    def __post_init__(self) -> None:
        for name in ("frozen_patterns", "trainable_patterns"):
            bad = [p for p in getattr(self, name) if not isinstance(p, str) or not p]
            if bad:
                raise ValueError(f"freeze.{name} must be non-empty strings, got {bad}.")


def _component(fqn: str) -> str:
    return fqn.split(".", 1)[0]


def trainable_names(model: nn.Module, spec: FreezeSpec, vlm: bool = True) -> set[str]:
    """Canonical FQNs of the parameters of ``model`` that train under ``spec``.

    Args:
        model: a VLM (``vlm``: every parameter under one of :data:`COMPONENTS`) or any module (``vlm=False``:
            a component flag freezes a top-level submodule of that name if there is one; patterns work as always).
        spec: what is frozen.
        vlm: require the VLM layout.

    Raises:
        ValueError: a pattern matches no parameter (named; a typo would otherwise freeze nothing), or (``vlm``) a
            parameter lies outside :data:`COMPONENTS`.
    """
    names = [canonical_fqn(n) for n, _ in model.named_parameters()]
    for pattern in (*spec.frozen_patterns, *spec.trainable_patterns):
        if not any(fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"freeze pattern {pattern!r} matches no parameter (e.g. {names[:3]}).")
    out = set()
    for n in names:
        component = _component(n)
        if component not in COMPONENTS and vlm:
            raise ValueError(f"parameter {n!r} is outside the VLM components {list(COMPONENTS)}.")
        by_component = component in COMPONENTS and getattr(spec, component)
        frozen = by_component or any(fnmatchcase(n, p) for p in spec.frozen_patterns)
        if not frozen or any(fnmatchcase(n, p) for p in spec.trainable_patterns):
            out.add(n)
    return out


def apply_freeze(model: nn.Module, spec: FreezeSpec, vlm: bool = True) -> set[str]:
    """Set ``requires_grad`` of every parameter of ``model`` from ``spec``; returns the trainable FQNs.

    A frozen encoder switches to eval mode at once (see :class:`~kempnerforge.model.vision.VisionEncoder`).
    ``vlm``: as :func:`trainable_names`.
    """
    train = trainable_names(model, spec, vlm)
    for name, p in model.named_parameters():
        p.requires_grad_(canonical_fqn(name) in train)
    encoder = getattr(model, "encoder", None)
    if encoder is not None:
        encoder.train(model.training)
    return train


def ever_trainable(model: nn.Module, specs: list[FreezeSpec], vlm: bool = True) -> list[nn.Parameter]:
    """Parameters trainable under at least one of ``specs`` (what the optimizer must hold), in model order."""
    names = set().union(*(trainable_names(model, s, vlm) for s in specs))
    return [p for n, p in model.named_parameters() if canonical_fqn(n) in names]


@torch.no_grad()
def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the AdamW / Adam state of every parameter now, exactly as the first ``step`` would.

    Same tensors as ``torch.optim.AdamW._init_group`` (a zero ``step`` scalar, zero ``exp_avg`` /
    ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad), so training is unchanged; parameters that
    are frozen now still get state, which keeps the checkpointed optimizer tree independent of the
    freeze state. Parameters that already have state are left alone.

    Raises:
        TypeError: ``optimizer`` is not ``torch.optim.Adam`` / ``AdamW`` (other optimizers keep other state).
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"init_adamw_state needs torch.optim.Adam or AdamW, got {type(optimizer).__name__}.")
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group.get("capturable", False) or group.get("fused", False)
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = (
                torch.zeros((), dtype=scalar, device=p.device) if on_device else torch.tensor(0.0, dtype=scalar)
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
