"""Output head + cross-entropy in token chunks: the full (tokens x vocab) fp32 logits never exist at once.

With a 50k vocabulary the logits of 2,048 tokens are 412 MB in fp32, and autograd keeps them (and
their gradient) alive through the backward: for small models they dominate peak memory, and on CPU
every such block is fresh pages from the OS each step. Here the head matmul, log-sum-exp, loss and
the loss's gradient are computed chunk by chunk in the forward (the approach of Liger-Kernel's fused
linear cross-entropy, Hsu et al., arXiv:2410.10989, and of Apple's cut cross-entropy, Wijmans et al.,
arXiv:2411.09009). The gradient ``softmax - one_hot`` is written in place into the logits block (no logits-sized
zero-fill), and the backward only scales the stored gradients.

Extra memory of one forward, with ``s`` the inputs' bytes per element (2 for bf16, 4 for fp32) and ``c`` the chunk
(:func:`default_chunk_size`): ``c * vocab * (4 + 2 s)`` (the fp32 logits block, reused for every chunk, and two
blocks of the inputs' dtype: the head's logits before their fp32 copy, the rounded gradient), the hidden states'
gradient ``tokens * dim * s``, ``c * dim * 4`` (a chunk's hidden states in fp32, on devices without a mixed-dtype
GEMM) and ``4 * vocab * dim`` for the head's gradient, summed in fp32 in place and handed back in the weight's dtype
in the same memory (:mod:`kempnerforge.training.head_grad`). After the forward only the two gradients are held:
``(tokens + vocab) * dim * s``. Llama-3 8B's head (128,256 x 4,096, bf16): 2.1 GB while summing, 1.05 GB after
(tests/unit/test_chunked_ce.py::test_peak_memory_is_the_stated_bound checks the bound on real tensors).
"""

from __future__ import annotations

import torch

from kempnerforge.training.head_grad import HeadGradAccumulator
from kempnerforge.training.loss import IGNORE_INDEX

#: Cap on the fp32 ``(chunk, vocab)`` logits block when :func:`default_chunk_size` picks the chunk (bytes).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_size(vocab: int, tokens: int, dim: int) -> int:
    """Tokens per chunk when ``chunk_size`` is not given: ``2 * dim``, capped so the fp32 logits block stays
    within :data:`DEFAULT_CHUNK_BYTES`, and at most ``tokens`` (at least 1).

    Every chunk reads the head weight twice and updates its fp32 gradient once (``(vocab, dim)`` each), against
    ``chunk * vocab`` work on the block: chunks much shorter than ``dim`` are dominated by those passes, very long
    ones only add memory. Measured on CPU at dim 256, vocab 50,304, 2,048 tokens (benchmarks/loss_path.py, CPU
    time per train step vs ``F.cross_entropy`` on full logits): chunks of 64 / 166 / 512 / 2,048 tokens 0.97 /
    0.89 / 0.83 / 0.86. E.g. dim 256, vocab 50,304: 512 tokens (98 MiB); dim 4,096, vocab 128,256: 523 (256 MiB).
    """
    cap = DEFAULT_CHUNK_BYTES // (4 * max(vocab, 1))
    return max(1, min(tokens, 2 * dim, cap))


class _LinearCrossEntropySum(torch.autograd.Function):
    """Forward computes the loss and the gradients asked for (of ``hidden``, of ``weight``: a frozen head or frozen
    hidden states get none, so no (vocab, dim) buffer and no GEMM for them); backward scales them (once: in place)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, z_weight: float, grad_hidden: bool, grad_weight: bool):
        # Autocast would round some of the matmuls below and not others (out= and in-place ops are not cast):
        # the dtypes are the inputs' (a mixed-precision policy's bf16 weight), the math after the logits fp32.
        with torch.autocast(hidden.device.type, enabled=False):
            return _LinearCrossEntropySum._forward(
                ctx, hidden, weight, labels, chunk_size, z_weight, grad_hidden, grad_weight
            )

    @staticmethod
    def _forward(ctx, hidden, weight, labels, chunk_size: int, z_weight: float, grad_hidden: bool, grad_weight: bool):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE_INDEX
        safe_y = torch.where(valid, labels, 0)
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(lse)
        block = torch.empty(min(chunk_size, n_tokens), vocab, dtype=torch.float32, device=hidden.device)
        need_grad = grad_hidden or grad_weight
        grad_h = torch.empty_like(hidden) if grad_hidden else None
        grad_w = HeadGradAccumulator(weight) if grad_weight else None
        low_precision = hidden.dtype != torch.float32
        logits = probs = g = None
        for start in range(0, n_tokens, chunk_size):
            stop = min(start + chunk_size, n_tokens)
            h, y, ok = hidden[start:stop], safe_y[start:stop], valid[start:stop]
            logits = block[: stop - start]
            if low_precision:  # the head's own dtype (bf16 logits, as the module path computes them), then fp32
                logits.copy_(h @ weight.t())
            else:
                torch.mm(h, weight.t(), out=logits)
            target[start:stop] = logits.gather(1, y[:, None]).squeeze(1)
            row_max = logits.amax(dim=1)
            probs = logits.sub_(row_max[:, None]).exp_()  # unnormalized softmax, in place
            sum_exp = probs.sum(dim=1)
            lse[start:stop] = row_max + sum_exp.log()
            if not need_grad:
                continue
            # d(CE)/d(logits) = softmax - one_hot(target); d(w * lse^2)/d(logits) = 2 w lse softmax.
            # Ignored rows get a zero gradient: their row scale and their one-hot entry are 0.
            okf = ok.to(torch.float32)
            scale = okf / sum_exp
            if z_weight:
                scale = scale * (1.0 + 2.0 * z_weight * lse[start:stop])
            probs.mul_(scale[:, None]).scatter_add_(1, y[:, None], -okf[:, None])
            g = probs.to(hidden.dtype) if low_precision else probs
            if grad_hidden:
                torch.mm(g, weight, out=grad_h[start:stop])
            if grad_weight:  # summed in fp32 straight into the accumulator: no (vocab, dim) partial per chunk
                grad_w.add(g, h, probs)
        block = logits = probs = g = None  # the (chunk, vocab) block is free before the head gradient is cast in place
        grad_w = grad_w.finish() if grad_weight else None
        okf = valid.to(torch.float32)
        loss = ((lse - target) * okf).sum()
        z_sum = (lse.square() * okf).sum() if z_weight else torch.zeros((), device=hidden.device)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w)
        ctx.used = False
        ctx.mark_non_differentiable(z_sum)
        return loss + z_weight * z_sum, z_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor, _grad_z: torch.Tensor | None = None):
        if ctx.used:
            raise RuntimeError(
                "chunked_linear_cross_entropy_sum: backward ran twice through the same graph (retain_graph); "
                "its stored gradients are scaled in place, so recompute the loss instead."
            )
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        # In place: these buffers exist only for this backward; a copy would be fresh (vocab, dim) pages.
        grads = [None if g is None else g.mul_(grad_out.to(g.dtype)) for g in (grad_h, grad_w)]
        return *grads, None, None, None, None, None


def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies (plus z-loss) of ``hidden @ weight.T`` without materializing all logits.

    Args:
        hidden: ``(tokens, dim)`` or ``(batch, seq, dim)`` final hidden states (after the final norm).
        weight: ``(vocab, dim)`` output head weight (a plain tensor: not vocab-sharded), same dtype as
            ``hidden`` (fp32, or bf16 under a mixed-precision policy: the logits are then rounded to bf16
            as the head module would, and everything after is fp32).
        labels: ``(tokens,)`` or ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.
        chunk_size: tokens per chunk (> 0); the chunk's blocks are ``chunk_size * vocab * (4 + 2 s)`` bytes (``s``:
            the inputs' bytes per element; the module docstring lists all extra memory). None: :func:`default_chunk_size`.
        z_loss_weight: weight ``w`` of the z-loss ``w * logsumexp(logits)^2`` per target token (PaLM,
            arXiv:2204.02311 sec. 5); 0 turns it off.

    Under ``torch.no_grad`` / ``inference_mode`` (validation) only the loss is computed: no gradient
    buffers; an input that does not require grad (a frozen head, frozen hidden states) gets neither its GEMM nor
    its buffer. The gradients are computed in the forward and scaled in place by the one backward it allows.

    Returns:
        ``(loss_sum, z_sum)``: loss_sum is the fp32 scalar ``CE sum + w * z_sum`` (nats), differentiable
        w.r.t. ``hidden`` and ``weight``, where the CE sum equals ``F.cross_entropy(hidden @ weight.T,
        labels, reduction="sum", ignore_index=-100)``; z_sum is the non-differentiable sum of
        ``logsumexp^2`` over target tokens (0 when ``w == 0``).

    Raises:
        ValueError: ``chunk_size`` < 1, or ``hidden`` and ``labels`` disagree in token count.
        RuntimeError: a second backward through the same graph.
    """
    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], hidden2d.shape[0], hidden2d.shape[1])
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1.")
    if hidden2d.shape[0] != labels1d.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree in the number of tokens."
        )
    # Decided here, not in forward (which always runs with grad disabled, and sees requires_grad=True on a
    # parameter even under no_grad / inference_mode): validation computes no gradients.
    # Each input's own flag: a frozen head (LLaVA's stage 1, a FreezeSchedule on output.*) gets no gradient.
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropySum.apply(
        hidden2d, weight, labels1d, chunk_size, float(z_loss_weight), grad and hidden.requires_grad,
        grad and weight.requires_grad,
    )  # fmt: skip
