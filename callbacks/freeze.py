"""FreezeSchedule: change which VLM parameters train at given optimizer steps."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from kempnerforge.training.freeze import FreezeSpec, apply_freeze


class FreezeSchedule(Callback):
    """From optimizer step ``steps[i]`` on, ``specs[i]`` decides what trains (before ``steps[0]``: the
    module's own ``freeze`` spec). E.g. LLaVA's two stages: ``steps=[1000]``, ``specs=[{encoder: true}]``
    trains the connector only, then the connector and the backbone.

    The active spec is a function of ``trainer.global_step`` alone, applied at the start of training
    (after a checkpoint restore) and before every batch, so a resumed run has the same freeze state
    as an uninterrupted one. The module's optimizer holds every parameter trainable under any spec
    (see :mod:`kempnerforge.training.freeze`).

    Args:
        steps: strictly increasing optimizer steps (>= 0).
        specs: one :class:`~kempnerforge.training.freeze.FreezeSpec` per step.

    Raises:
        ValueError: lengths differ, or steps are not strictly increasing non-negative integers.
    """

    def __init__(self, steps: list[int], specs: list[FreezeSpec]) -> None:
        if len(steps) != len(specs):
            raise ValueError(f"FreezeSchedule: {len(steps)} steps but {len(specs)} specs; give one spec per step.")
        if any(s < 0 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"FreezeSchedule.steps={steps} must be strictly increasing integers >= 0.")
        self.steps = list(steps)
        self.specs = [s if isinstance(s, FreezeSpec) else FreezeSpec(**s) for s in specs]
        self.active = -1  # index into specs; -1: the module's own spec

    def index_at(self, step: int) -> int:
        """Index of the spec active at optimizer step ``step`` (-1 before ``steps[0]``)."""
        return max((i for i, s in enumerate(self.steps) if s <= step), default=-1)

    def _apply(self, trainer: Any, pl_module: Any) -> None:
        index = self.index_at(trainer.global_step)
        if index == self.active:
            return
        spec = pl_module.freeze if index < 0 else self.specs[index]
        apply_freeze(pl_module.model, spec)
        self.active = index

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Apply the spec of the (possibly restored) current step."""
        self.active = None  # force: the module may have applied its own spec in configure_model
        self._apply(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Switch specs when the step reaches the next milestone."""
        self._apply(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        """``{"active": index}`` (informational; the active spec is recomputed from the step)."""
        return {"active": self.active}
