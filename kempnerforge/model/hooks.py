"""Interpretability hooks: the explicit attention-probability path for chosen layers.

``Attention.forward`` uses ``F.scaled_dot_product_attention``, which never materializes the
probabilities. :func:`attention_probs` recomputes them for one layer from the layer's own inputs and
weights, so only the layers being inspected pay the ``(batch, heads, seq, seq)`` cost.
"""

from __future__ import annotations

import math

import torch

from kempnerforge.model.attention import Attention
from kempnerforge.model.rope import apply_rope


@torch.no_grad()
def attention_probs(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities ``softmax(q k^T / sqrt(head_dim) + causal mask)`` of one layer.

    Same projections, QK-norm and RoPE as :meth:`Attention.forward`; with GQA each KV head is
    repeated for its ``n_heads / n_kv_heads`` query heads. ``probs @ v`` equals the SDPA output. For
    :class:`~kempnerforge.model.mla.MultiHeadLatentAttention` the scores are its decompressed per-head
    ``q . k * softmax_scale``.

    Args:
        attn: the attention module.
        x: its input ``(batch, seq, dim)`` (after ``attention_norm``).
        cos, sin: RoPE tables ``(seq, head_dim)``.

    Returns:
        ``(batch, n_heads, seq, seq)`` fp32 probabilities (rows sum to 1, zero above the diagonal).
    """
    bsz, seq, _ = x.shape
    if hasattr(attn, "qkv"):  # multi-head latent attention: per-head q/k after RoPE, its own scale
        q, k, _ = attn.qkv(x, cos, sin)
        scores = q.transpose(1, 2).float() @ k.transpose(1, 2).float().transpose(-2, -1) * attn.softmax_scale
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    q, k, _ = attn._qkv(x)  # the projections (separate or fused wqkv) and QK-norm of Attention.forward
    q, k = apply_rope(q, cos, sin).transpose(1, 2).float(), apply_rope(k, cos, sin).transpose(1, 2).float()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: KV head j serves query heads j*g .. j*g+g-1
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
