"""MoE auxiliary losses under pipeline parallelism: each stage puts its own into the backward.

Without pipelining the module adds the MoE layers' weighted auxiliary losses to the loss it
backpropagates (``CausalLM._add_moe_aux_loss``: ``(ce_sum + aux * n_targets) * factor``). With it, the
loss exists on the last stage only, while the routers of earlier stages live on other ranks. As in
Megatron-LM (``MoEAuxLossAutoScaler``, arXiv:2104.04473's codebase), the aux loss is attached to the
stage's output activations by an identity autograd function whose backward also seeds the aux loss with
the gradient it would get from the full objective (``n_targets`` of the micro-batch times the step's
loss scale). The stage's backward, driven by the gradient the next stage sends, then carries both terms:
the gradients equal the one-process run's on the same micro-batches.

The aux loss is per pipeline micro-batch, as with gradient accumulation over the same micro-batches:
sequence-wise and z-losses (means over sequences / tokens) do not depend on the split, the batch-wise
load-balancing loss (``aux_loss_weight``) does (its one-process equal accumulates the micro-batches).
Router statistics and DeepSeek-V3's aux-loss-free bias update (arXiv:2412.19437 sec. 2.1.2) stay per
stage: every router is on exactly one stage, and its load is summed over the step's micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch


class AuxLossToBackward(torch.autograd.Function):
    """``forward(h, aux, scale) = h``; ``backward`` passes ``h``'s gradient through and gives ``aux``
    the gradient ``scale`` (so the backward of ``h`` also runs ``scale * d aux``).

    Args (forward):
        h: the stage's output activations, any shape.
        aux: scalar fp32, the stage's summed weighted MoE auxiliary losses (differentiable).
        scale: scalar tensor, ``d objective / d aux`` (micro-batch target tokens times the loss scale).
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        ctx.aux_dtype = aux.dtype
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.aux_dtype), None


class StageAuxLosses:
    """One optimizer step's MoE bookkeeping on this rank's stages (used by the pipeline runner).

    Per step: :meth:`start` with the micro-batches' aux-loss gradients; every stage forward calls
    :meth:`after_blocks` (the stage's ``after_blocks`` hook); :meth:`finish` checks the forward count.

    Args:
        tracker: the module's :class:`~kempnerforge.training.moe_balance.MoEStepTracker` (collects the
            stages' routing statistics for the bias update and the logs).
    """

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self._scales: torch.Tensor | None = None
        self._calls: dict[int, int] = {}
        self._skip = 0
        self._new_step = False
        self._aux = torch.zeros(())

    @property
    def active(self) -> bool:
        """Between :meth:`start` and :meth:`finish`."""
        return self._scales is not None

    def start(self, scales: torch.Tensor, new_step: bool, shape_inference: bool) -> None:
        """Begin one schedule step.

        Args:
            scales: ``(microbatches,)`` fp32, ``d objective / d aux`` of each micro-batch.
            new_step: the first batch of an optimizer step (restarts the step's expert load).
            shape_inference: the schedule runs its metadata inference first (first step, or after an
                eval pass): one extra forward per stage, on placeholder data, that is not counted.
        """
        self._scales = scales
        self._calls = {}
        self._skip = 1 if shape_inference else 0
        self._new_step = new_step
        self._aux = torch.zeros((), device=scales.device)

    def after_blocks(self, stage: Any, h: torch.Tensor) -> torch.Tensor:
        """The stage hook: collect the stage's MoE statistics and attach its aux loss to ``h`` (identity
        outside a training step: validation, the estimator, the metadata inference pass)."""
        if self._scales is None or not torch.is_grad_enabled():
            return h
        key = id(stage)
        k = self._calls.get(key, 0)
        self._calls[key] = k + 1
        micro = k - self._skip
        if micro < 0:
            # The shape inference's forward (placeholder data): its routing must not be replayed by the first
            # micro-batch's activation-checkpointing recompute (the first stage never recomputes it).
            for layer in stage.moe_layers().values():
                layer.discard_saved_routing()
            return h
        aux = self.tracker.collect(stage, self._new_step)
        if aux is None:  # a stage of dense blocks only
            return h
        self._new_step = False
        self._aux = self._aux + aux.detach()
        if not aux.requires_grad:  # every aux weight is 0: balancing by the router bias only
            return h
        return AuxLossToBackward.apply(h, aux, self._scales[micro])

    def finish(self, n_stages: int) -> torch.Tensor:
        """End the step; returns this rank's summed aux losses over its stages and micro-batches (fp32).

        Raises:
            RuntimeError: a stage ran another number of forwards than the micro-batches (plus the
                inference pass): the schedule's call pattern changed and the aux gradients would be
                assigned to the wrong micro-batches.
        """
        expected = len(self._scales) + self._skip
        if len(self._calls) != n_stages or any(c != expected for c in self._calls.values()):
            raise RuntimeError(
                f"pipeline MoE aux losses: expected {expected} forwards on each of {n_stages} stages, got "
                f"{sorted(self._calls.values())}; the torch.distributed.pipelining call pattern changed."
            )
        self._scales = None
        return self._aux
