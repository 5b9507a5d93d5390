"""Cross-entropy on full logits whose backward writes ``softmax - one_hot`` into the buffer the forward kept.

``F.cross_entropy`` is ``log_softmax`` + ``nll_loss``: its forward writes a logits-sized log-softmax
(kept for the backward), and its backward zero-fills a logits-sized gradient, scatters ``-1`` into it
(``nll_loss_backward``) and writes a third logits-sized block (``log_softmax_backward``). Here the
forward keeps ``exp(logits - row_max)`` (the one logits-sized block it writes) and the backward turns
it in place into ``(softmax - one_hot) * grad`` and returns it: one logits-sized allocation per step
instead of three, and no zero-fill. The same algebra as Liger-Kernel's cross-entropy (Hsu et al.,
arXiv:2410.10989), without its Triton kernels.
"""

from __future__ import annotations

import torch

#: Label value excluded from the loss (PyTorch / Hugging Face convention); re-exported by ``training.loss``.
IGNORE_INDEX = -100


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor):
        with torch.autocast(logits.device.type, enabled=False):  # fp32 math whatever autocast is on
            return _CrossEntropySum._forward(ctx, logits, labels)

    @staticmethod
    def _forward(ctx, logits: torch.Tensor, labels: torch.Tensor):
        valid = labels != IGNORE_INDEX
        safe_y = torch.where(valid, labels, 0)
        target = logits.gather(1, safe_y[:, None]).squeeze(1).float()
        row_max = logits.amax(dim=1).float()
        exp = (logits - row_max[:, None]).exp_()  # fp32 by type promotion: the one logits-sized block
        sum_exp = exp.sum(dim=1)
        okf = valid.to(torch.float32)
        loss = ((row_max + sum_exp.log() - target) * okf).sum()
        ctx.save_for_backward(exp, sum_exp, safe_y, okf)
        ctx.in_dtype = logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.used:
            raise RuntimeError(
                "cross_entropy_sum: backward ran twice through the same graph (retain_graph); its saved "
                "softmax is overwritten by the gradient, so recompute the loss instead."
            )
        ctx.used = True
        exp, sum_exp, safe_y, okf = ctx.saved_tensors
        coef = okf * grad_out.float()
        grad = exp.mul_((coef / sum_exp)[:, None]).scatter_add_(1, safe_y[:, None], -coef[:, None])
        return grad.to(ctx.in_dtype), None


def softmax_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over non-ignored ``labels`` (fp32, nats), equal to
    ``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")`` in value and gradient.

    Args:
        logits: ``(tokens, vocab)`` plain tensor, any float dtype (the math is fp32; the gradient is
            returned in ``logits.dtype``).
        labels: ``(tokens,)`` int64; ``IGNORE_INDEX`` (-100) positions are excluded.

    Returns:
        Scalar fp32 tensor, differentiable w.r.t. ``logits``; one backward only (the saved softmax
        becomes the gradient in place). Without gradients (validation) nothing is saved.

    Raises:
        ValueError: ``logits`` not 2-D or its row count differs from ``labels``'.
        RuntimeError: a second backward through the same graph.
    """
    if logits.dim() != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} must be (tokens, vocab) for labels {tuple(labels.shape)}.")
    return _CrossEntropySum.apply(logits, labels)
