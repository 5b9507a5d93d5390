"""FreezeSchedule: change which parameters train at given optimizer steps (a VLM's components, or any module's
parameters by name pattern)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from torch import nn
from typing_extensions import override

from kempnerforge.model.init import canonical_fqn
from kempnerforge.training.freeze import COMPONENTS, FreezeSpec, apply_freeze, ever_trainable


class FreezeSchedule(Callback):
    """From optimizer step ``steps[i]`` on, ``specs[i]`` decides what trains (before ``steps[0]``: the
    module's own choice). E.g. LLaVA's two stages: ``steps=[1000]``, ``specs=[{encoder: true}]``
    trains the connector only, then the connector and the backbone.

    Works on any LightningModule with parameters:

    - a :class:`~kempnerforge.module.VisionLanguage` (a ``freeze`` spec and a ``model`` with encoder / connector /
      backbone): specs apply to ``pl_module.model`` as its own ``freeze`` does, which also rules before ``steps[0]``;
    - any other module: specs apply to ``pl_module.named_parameters()``. ``frozen_patterns`` /
      ``trainable_patterns`` are ``fnmatch`` patterns over those names (``layer.*``); a component flag freezes a
      top-level submodule of that name if the module has one (``encoder: true``, the default, is then a no-op
      when there is none; ``connector`` / ``backbone`` without such a submodule are refused). Before ``steps[0]``
      each parameter keeps the ``requires_grad`` the module gave it. Every parameter a spec trains must be in the
      optimizer (checked at the start).

    The active spec is a function of ``trainer.global_step`` alone, applied at the start of training
    (after a checkpoint restore) and before every batch, so a resumed run has the same freeze state
    as an uninterrupted one.

    Args:
        steps: strictly increasing optimizer steps (>= 0).
        specs: one :class:`~kempnerforge.training.freeze.FreezeSpec` per step.

    Raises:
        ValueError: lengths differ, or steps are not strictly increasing non-negative integers (at
            construction); at the start of ``fit``: a module without parameters, a pattern that matches no
            parameter, a component flag for a submodule the module lacks, or a parameter a spec trains that no
            optimizer holds (each names the spec).
    """

    def __init__(self, steps: list[int], specs: list[FreezeSpec]) -> None:
        if len(steps) != len(specs):
            raise ValueError(f"FreezeSchedule: {len(steps)} steps but {len(specs)} specs; give one spec per step.")
        if any(s < 0 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"FreezeSchedule.steps={steps} must be strictly increasing integers >= 0.")
        self.steps = list(steps)
        self.specs = [s if isinstance(s, FreezeSpec) else FreezeSpec(**s) for s in specs]
        self.active = -1  # index into specs; -1: the module's own spec
        self._target: nn.Module | None = None
        self._vlm = False
        self._initial: dict[str, bool] = {}  # any module: requires_grad before the schedule took over

    def index_at(self, step: int) -> int:
        """Index of the spec active at optimizer step ``step`` (-1 before ``steps[0]``)."""
        return max((i for i, s in enumerate(self.steps) if s <= step), default=-1)

    def _resolve(self, pl_module: Any) -> None:
        """What the specs apply to, checked against every spec (refused here with the spec named)."""
        model = getattr(pl_module, "model", None)
        self._vlm = isinstance(getattr(pl_module, "freeze", None), FreezeSpec) and isinstance(model, nn.Module)
        self._target = model if self._vlm else pl_module
        params = list(self._target.named_parameters())
        if not params:
            raise ValueError(f"FreezeSchedule: {type(pl_module).__name__} has no parameters to freeze.")
        children = dict(self._target.named_children())
        for i, spec in enumerate(self.specs):
            missing = [c for c in COMPONENTS if c != "encoder" and getattr(spec, c) and c not in children]
            if missing and not self._vlm:
                raise ValueError(
                    f"FreezeSchedule.specs[{i}] freezes {missing}, but {type(pl_module).__name__} has no such "
                    f"submodule; select parameters with frozen_patterns over its named_parameters() "
                    f"(e.g. {[canonical_fqn(n) for n, _ in params[:2]]})."
                )
            try:
                ever_trainable(self._target, [spec], vlm=self._vlm)
            except ValueError as err:
                raise ValueError(f"FreezeSchedule.specs[{i}]: {err}") from err

    def _check_optimizer(self, trainer: Any) -> None:
        """Any module: a parameter that some spec trains but no optimizer holds would never be updated."""
        held = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        trained = {id(p) for p in ever_trainable(self._target, self.specs, vlm=False)}
        lost = [canonical_fqn(n) for n, p in self._target.named_parameters() if id(p) in trained - held]
        if lost:
            raise ValueError(
                f"FreezeSchedule trains {lost[:3]} at some step, but no optimizer holds them: give the optimizer "
                "every parameter (frozen ones get no gradient and are skipped)."
            )

    def _apply(self, trainer: Any, pl_module: Any) -> None:
        index = self.index_at(trainer.global_step)
        if index == self.active:
            return
        if index >= 0:
            apply_freeze(self._target, self.specs[index], vlm=self._vlm)
        elif self._vlm:
            apply_freeze(self._target, pl_module.freeze)
        else:
            for name, p in self._target.named_parameters():
                p.requires_grad_(self._initial[name])
        self.active = index

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Check the specs against the module, then apply the spec of the (possibly restored) current step."""
        self._resolve(pl_module)
        if not self._vlm:
            self._initial = self._initial or {n: p.requires_grad for n, p in self._target.named_parameters()}
            self._check_optimizer(trainer)
        self.active = None  # force: the module may have applied its own spec in configure_model
        self._apply(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Switch specs when the step reaches the next milestone."""
        self._apply(trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"active": index}`` (informational; the active spec is recomputed from the step)."""
        return {"active": self.active}
