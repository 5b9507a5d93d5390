"""Output head + cross-entropy in token chunks: the full (tokens x vocab) fp32 logits never exist at once.

With a 50k vocabulary the logits of 2,048 tokens are 412 MB in fp32, and autograd keeps them (and
their gradient) alive through the backward: for small models they dominate peak memory. Here the
head matmul, log-softmax, loss and the loss's gradient are computed chunk by chunk in the forward
(the approach of Liger-Kernel's fused linear cross-entropy, Hsu et al., arXiv:2410.10989), so the
peak is one ``(chunk_size, vocab)`` fp32 block plus gradients the size of the hidden states and of
the head weight. The backward only scales those stored gradients.
"""

from __future__ import annotations

import torch

from kempnerforge.training.loss import IGNORE_INDEX


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        z_weight: float,
        need_grad: bool,
    ):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            logits = (h @ weight.t()).float()  # (chunk, vocab), the only vocab-sized block
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, 0)
            target = logits.gather(1, safe_y[:, None]).squeeze(1)
            loss += ((lse - target) * valid).sum()
            if z_weight:
                z_sum += (lse.square() * valid).sum()
            if need_grad:
                # d(CE)/d(logits) = softmax - one_hot(target); d(w * lse^2)/d(logits) = 2 w lse softmax
                probs = logits.sub_(lse[:, None]).exp_()
                if z_weight:
                    probs.mul_(1.0 + 2.0 * z_weight * lse[:, None])
                probs[torch.arange(len(y), device=y.device), safe_y] -= 1.0
                probs.mul_(valid[:, None])
                probs = probs.to(hidden.dtype)
                grad_h[start : start + chunk_size] = probs @ weight
                grad_w.addmm_(probs.t().float(), h.float())
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(z_sum)
        return loss + z_weight * z_sum, z_sum

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_z: torch.Tensor | None = None):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None


def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, z_loss_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies (plus z-loss) of ``hidden @ weight.T`` without materializing all logits.

    Args:
        hidden: ``(tokens, dim)`` or ``(batch, seq, dim)`` final hidden states (after the final norm).
        weight: ``(vocab, dim)`` output head weight (a plain tensor: not vocab-sharded).
        labels: ``(tokens,)`` or ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.
        chunk_size: tokens per chunk (> 0); peak extra memory is ``chunk_size * vocab * 4`` bytes.
        z_loss_weight: weight ``w`` of the z-loss ``w * logsumexp(logits)^2`` per target token (PaLM,
            arXiv:2204.02311 sec. 5); 0 turns it off.

    Under ``torch.no_grad`` / ``inference_mode`` (validation) only the loss is computed: no gradient
    buffers, peak extra memory one ``(chunk_size, vocab)`` fp32 block.

    Returns:
        ``(loss_sum, z_sum)``: loss_sum is the fp32 scalar ``CE sum + w * z_sum`` (nats), differentiable
        w.r.t. ``hidden`` and ``weight``, where the CE sum equals ``F.cross_entropy(hidden @ weight.T,
        labels, reduction="sum", ignore_index=-100)``; z_sum is the non-differentiable sum of
        ``logsumexp^2`` over target tokens (0 when ``w == 0``).

    Raises:
        ValueError: ``chunk_size`` < 1, or ``hidden`` and ``labels`` disagree in token count.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1.")
    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if hidden2d.shape[0] != labels1d.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree in the number of tokens."
        )
    # Decided here, not in forward (which always runs with grad disabled, and sees requires_grad=True on a
    # parameter even under no_grad / inference_mode): validation computes no gradients.
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropySum.apply(hidden2d, weight, labels1d, chunk_size, float(z_loss_weight), need_grad)
