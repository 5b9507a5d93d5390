"""Cross-entropy normalized by the number of target tokens in the global batch.

Averaging per-rank means and then averaging across ranks weights each rank equally, which is wrong
when ranks hold different numbers of target tokens (padding, ignore_index). Here the sum of token
losses is divided by the global token count, as in torchtitan and Megatron-LM.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

#: Label value excluded from the loss (PyTorch / Hugging Face convention).
IGNORE_INDEX = -100


def loss_parallel_context(active: bool) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``active``, else a no-op context.

    The backward of a cross-entropy computed on vocab-sharded logits must run inside this context
    too (``CausalLM.backward`` enters it); outside it DTensor would not use the vocab-parallel rules.
    """
    return loss_parallel() if active else contextlib.nullcontext()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (fp32, nats) over non-ignored ``labels``; vocab-parallel when sharded.

    With tensor parallelism and loss parallel, ``logits`` is a DTensor sharded on the vocab dim
    (``Shard(-1)``, local ``(batch, seq, vocab / tp)``): the loss is then computed on the shards
    under ``loss_parallel()`` (max / sum-exp / target-logit all-reduces of ``(batch * seq)`` floats,
    Megatron-LM arXiv:1909.08053 sec. 3) without gathering the ``(batch, seq, vocab)`` logits, and
    returned as a plain tensor equal on every TP rank (its backward needs :func:`loss_parallel_context`).

    Args:
        logits: ``(batch, seq, vocab)`` tensor or vocab-sharded DTensor, any float dtype.
        labels: ``(batch, seq)`` int64 plain tensor; ``IGNORE_INDEX`` positions are excluded.

    Returns:
        Scalar fp32 plain tensor (differentiable).
    """
    if isinstance(logits, DTensor):
        with loss_parallel():
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return loss.full_tensor()  # Replicate over TP already: no communication
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def global_token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over this rank's targets, divided by the global target count.

    Args:
        logits: ``(batch, seq, vocab)``, any float dtype (computed in fp32); may be a vocab-sharded
            DTensor (tensor parallel with loss parallel, see :func:`cross_entropy_sum`).
        labels: ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.
        group: the data-parallel process group (None: this process alone). TP ranks are not in it.

    Returns:
        ``(loss, global_mean, n_global)``: ``loss`` to backpropagate, scaled by the group size because
        FSDP2 / DDP average gradients over data-parallel ranks (so the summed gradient equals that of
        the global mean); ``global_mean`` the detached mean loss per target token over the whole
        global batch (nats); ``n_global`` the global number of target tokens.

    Raises:
        ValueError: ``logits`` and ``labels`` disagree in batch or sequence size.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree in (batch, seq).")
    loss_sum = cross_entropy_sum(logits, labels)
    stats = torch.stack([loss_sum.detach(), (labels != IGNORE_INDEX).sum().to(loss_sum.dtype)])
    world = 1
    if group is not None:
        dist.all_reduce(stats, group=group)
        world = dist.get_world_size(group)
    n_global = stats[1].clamp(min=1)
    return loss_sum * (world / n_global), stats[0] / n_global, stats[1]


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over this micro-batch's target tokens, and their count (no communication).

    Args:
        logits: ``(batch, seq, vocab)``, any float dtype (computed in fp32).
        labels: ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.

    Returns:
        ``(loss_sum, n_targets)``: fp32 scalar sum of token losses (nats, differentiable) and the
        int64 scalar number of non-ignored labels.

    Raises:
        ValueError: ``logits`` and ``labels`` disagree in batch or sequence size.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree in (batch, seq).")
    loss_sum = cross_entropy_sum(logits, labels)  # vocab-parallel for sharded logits
    return loss_sum, (labels != IGNORE_INDEX).sum()


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over target tokens of ``logsumexp(logits)^2`` (fp32, differentiable): the z-loss of PaLM
    (Chowdhery et al., arXiv:2204.02311 sec. 5), which keeps the softmax normalizer near 1.

    Args:
        logits: ``(batch, seq, vocab)`` tensor, or a vocab-sharded DTensor (tensor parallel: the
            log-sum-exp then reduces over the vocab shards through DTensor's reduction rules).
        labels: ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.

    Returns:
        Scalar fp32 plain tensor; multiply by the z-loss weight (PaLM: 1e-4) and add to the loss sum.
    """
    lse = torch.logsumexp(logits.float(), dim=-1)
    if isinstance(lse, DTensor):
        lse = lse.full_tensor()
    return (lse.square() * (labels != IGNORE_INDEX)).sum()


class StepTokenNormalizer:
    """Normalize one optimizer step's gradient by its global target-token count (dp ranks x micro-batches).

    The exact objective of a step with gradient accumulation is ``sum of token losses / N`` where ``N``
    counts the target tokens (``IGNORE_INDEX`` excluded) of every micro-batch on every data-parallel
    rank. ``N`` is only known after the last micro-batch, but the gradient is linear in ``1/N``, so
    each micro-batch backpropagates its un-normalized sum and the accumulated gradients are rescaled
    once, after one all-reduce of ``(loss sum, token count)`` per step. torchtitan gets the
    same result by counting the step's tokens before the forward passes; here no batch has to be
    fetched ahead of Lightning's loop, and a shorter last window of an epoch is normalized by the
    tokens it really had. With padding, 4 accumulated micro-batches give exactly the gradient of one
    batch 4x larger (up to fp32 rounding of the sum order).

    Usage per micro-batch: ``loss = normalizer.add(loss_sum, n_targets, dp_size, new_step)`` (return it
    from ``training_step``); before the optimizer step:
    ``mean, n, scale = normalizer.finish(group, accumulate_grad_batches)``, then
    ``clip_grad_norm_(params, max_norm, grad_scale=scale)`` (which also applies ``scale`` when not clipping).
    """

    def __init__(self) -> None:
        self._stats: torch.Tensor | None = None

    def add(self, loss_sum: torch.Tensor, n_targets: torch.Tensor, dp_size: int, new_step: bool) -> torch.Tensor:
        """Record one micro-batch and return the loss to backpropagate.

        Args:
            loss_sum: this rank's summed token loss of the micro-batch (scalar, differentiable).
            n_targets: this rank's target-token count of the micro-batch (scalar).
            dp_size: data-parallel degree; FSDP2 / DDP average gradients over it, so the returned
                loss is scaled by it to make the reduced gradient a sum over ranks.
            new_step: True for the first micro-batch of an optimizer step (drops stale counts, e.g. of
                a step a callback skipped).

        Returns:
            ``loss_sum * dp_size`` (scalar); its gradient is normalized later by :meth:`finish`.
        """
        detached = loss_sum.detach()
        if isinstance(detached, DTensor):  # vocab-parallel loss: replicated over the TP mesh
            detached = detached.full_tensor()
        stats = torch.stack([detached.double(), n_targets.detach().to(detached.device).double()])
        self._stats = stats if new_step or self._stats is None else self._stats + stats
        return loss_sum * dp_size

    def finish(
        self, group: dist.ProcessGroup | None = None, accumulate_grad_batches: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """All-reduce the step's loss sum and token count; return the factor that normalizes the gradients.

        Lightning divided each micro-batch loss by ``accumulate_grad_batches``, so the gradients must be
        multiplied by ``accumulate_grad_batches / N`` (``N`` clamped to >= 1). The caller applies it,
        folded into clipping (:func:`kempnerforge.parallel.grad_clip.clip_grad_norm_`'s ``grad_scale``),
        so the gradients are touched once.

        Args:
            group: data-parallel process group (None: this process alone).
            accumulate_grad_batches: the trainer's ``accumulate_grad_batches``.

        Returns:
            ``(mean_loss, n_global, grad_scale)``: the step's mean loss per target token over the
            global batch (fp32 scalar, nats), the global target-token count (fp32 scalar) and the
            gradient factor (float).

        Raises:
            RuntimeError: no micro-batch was recorded since the last :meth:`finish`.
        """
        if self._stats is None:
            raise RuntimeError("StepTokenNormalizer.finish() called without a micro-batch recorded by add().")
        stats, self._stats = self._stats, None
        if group is not None:
            dist.all_reduce(stats, group=group)
        n_global = stats[1].clamp(min=1)
        scale = float(accumulate_grad_batches / n_global)
        return (stats[0] / n_global).float(), stats[1].float(), scale
