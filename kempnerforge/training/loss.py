"""Cross-entropy normalized by the number of target tokens in the global batch.

Averaging per-rank means and then averaging across ranks weights each rank equally, which is wrong
when ranks hold different numbers of target tokens (padding, ignore_index). Here the sum of token
losses is divided by the global token count, as in torchtitan and Megatron-LM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from kempnerforge.parallel.grad_clip import scale_grads_
from kempnerforge.training.cross_entropy import IGNORE_INDEX, softmax_cross_entropy_sum
from kempnerforge.training.logsumexp import vocab_parallel_logsumexp


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
    A plain tensor goes through :func:`~kempnerforge.training.cross_entropy.softmax_cross_entropy_sum`
    (same value and gradient as ``F.cross_entropy``; its backward makes no logits-sized zero-fill).

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
    return softmax_cross_entropy_sum(logits.flatten(0, 1), labels.flatten())


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
        logits: ``(batch, seq, vocab)`` tensor, or a vocab-sharded DTensor (tensor parallel with loss
            parallel): the log-sum-exp then reduces each rank's vocab shard and all-reduces ``batch * seq``
            floats twice (:func:`~kempnerforge.training.logsumexp.vocab_parallel_logsumexp`), never
            gathering the logits.
        labels: ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.

    Returns:
        Scalar fp32 plain tensor; multiply by the z-loss weight (PaLM: 1e-4) and add to the loss sum.
    """
    lse = vocab_parallel_logsumexp(logits)
    return (lse.square() * (labels != IGNORE_INDEX)).sum()


class StepTokenNormalizer:
    """Normalize one optimizer step by its global target-token count (dp ranks x micro-batches), so the
    gradients are those of the logged loss before any ``on_before_optimizer_step`` hook reads them.

    The exact objective of a step is ``sum of token losses / N`` where ``N`` counts the target tokens
    (``IGNORE_INDEX`` excluded) of every micro-batch on every data-parallel rank (torchtitan and
    Megatron-LM normalize the same way). Two cases, neither reads a value on the host:

    - ``accumulate_grad_batches == 1``: :meth:`add` all-reduces ``(loss sum, token count)`` over the
      data-parallel group at once (a collective on a device tensor) and returns ``dp_size / N``; the
      backward of the scaled loss gives the normalized gradients directly, with no pass over them.
    - ``accumulate_grad_batches > 1``: ``N`` is known only after the last micro-batch, so each
      micro-batch backpropagates its un-normalized sum (times ``dp_size``; Lightning divides it by
      ``accumulate``) and :meth:`finish_gradients`, run right after the last backward, all-reduces the
      step's counts and multiplies the gradients by ``accumulate / N`` (a device scalar; one pass per
      optimizer step). A shorter last window of an epoch is normalized by the tokens it really had,
      and 4 accumulated micro-batches give the gradient of one batch 4x larger (up to fp32 rounding).

    Usage per micro-batch: ``loss = objective_sum * normalizer.add(loss_sum, n_targets, ...)`` (return it
    from ``training_step``); after the step's last backward: ``normalizer.finish_gradients(params,
    group, accumulate)``; then ``mean, n = normalizer.step_loss()`` for the logs.
    """

    def __init__(self) -> None:
        self._stats: torch.Tensor | None = None  # (2,) fp64: loss sum, target count (global once reduced)
        self._reduced = False
        #: Sums the (2,) stats in place over a second level after the group's all-reduce: the replica groups of
        #: fault tolerance (``ReplicaGroups.sum_across_groups``), whose gradients are then summed, not averaged.
        self.outer_reduce: Callable[[torch.Tensor], None] | None = None

    def add(
        self,
        loss_sum: torch.Tensor,
        n_targets: torch.Tensor,
        dp_size: int,
        new_step: bool,
        accumulate: int = 1,
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor | float:
        """Record one micro-batch; return the factor its summed objective is multiplied by before backward.

        Args:
            loss_sum: this rank's summed token loss of the micro-batch (scalar; only its value is used).
            n_targets: this rank's target-token count of the micro-batch (scalar).
            dp_size: data-parallel degree; FSDP2 / DDP average gradients over it, so the factor includes
                it to make the reduced gradient a sum over ranks.
            new_step: True for the first micro-batch of an optimizer step (drops stale counts, e.g. of
                a step a callback skipped).
            accumulate: the trainer's ``accumulate_grad_batches``.
            group: data-parallel process group (None: this process alone).

        Returns:
            ``dp_size / N_global`` (fp32 scalar tensor on the loss' device) when ``accumulate == 1``,
            else ``dp_size`` (the gradients are normalized later by :meth:`finish_gradients`).
        """
        detached = loss_sum.detach()
        if isinstance(detached, DTensor):  # vocab-parallel loss: replicated over the TP mesh
            detached = detached.full_tensor()
        stats = torch.stack([detached.double(), n_targets.detach().to(detached.device).double()])
        self._stats = stats if new_step or self._stats is None else self._stats + stats
        self._reduced = False
        if accumulate != 1:
            return float(dp_size)
        self._reduce(group)
        return (dp_size / self._stats[1].clamp(min=1)).to(detached.dtype)

    def _reduce(self, group: dist.ProcessGroup | None) -> None:
        if group is not None:
            dist.all_reduce(self._stats, group=group)
        if self.outer_reduce is not None:
            self.outer_reduce(self._stats)
        self._reduced = True

    @property
    def pending(self) -> bool:
        """True between the micro-batches of an accumulated step and :meth:`finish_gradients`."""
        return self._stats is not None and not self._reduced

    @torch.no_grad()
    def finish_gradients(
        self, parameters: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, accumulate: int = 1
    ) -> None:
        """With gradient accumulation: all-reduce the step's loss sum and token count, then multiply the
        gradients by ``accumulate / N`` (``N`` clamped to >= 1; Lightning divided each micro-batch loss by
        ``accumulate``). A no-op when :meth:`add` already normalized the step (``accumulate == 1``).

        Args:
            parameters: the parameters whose ``.grad`` is rescaled (plain tensors or DTensors on any meshes).
            group: data-parallel process group (None: this process alone).
            accumulate: the trainer's ``accumulate_grad_batches``.
        """
        if not self.pending:
            return
        self._reduce(group)
        scale_grads_(parameters, accumulate / self._stats[1].clamp(min=1))

    def step_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The finished step's mean loss per target token over the global batch (fp32 scalar, nats) and
        its global target-token count (fp32 scalar); both stay on the device. Resets the step.

        Raises:
            RuntimeError: no micro-batch was recorded since the last call, or the accumulated gradients
                were not normalized yet (:meth:`finish_gradients`).
        """
        if self._stats is None:
            raise RuntimeError("StepTokenNormalizer.step_loss() called without a micro-batch recorded by add().")
        if not self._reduced:
            raise RuntimeError(
                "StepTokenNormalizer.step_loss() called before finish_gradients() of an accumulated step."
            )
        stats, self._stats = self._stats, None
        return (stats[0] / stats[1].clamp(min=1)).float(), stats[1].float()
