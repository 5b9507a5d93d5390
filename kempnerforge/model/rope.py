"""Rotary position embeddings (RoFormer, Su et al., arXiv:2104.09864), HF Llama convention.

We use the non-interleaved "rotate_half" layout of HF ``LlamaForCausalLM``: channel ``i`` is paired
with channel ``i + head_dim/2`` (not ``2i`` with ``2i+1`` as in Meta's reference code). With this
layout, converting q/k projection weights to and from HF is a pure rename, no permutation.
"""

from __future__ import annotations

import torch


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for positions 0..max_seq_len-1, in fp32.

    Computed exactly as HF Llama does (fp32 inverse frequencies ``theta ** (-2i / head_dim)``,
    elementwise position * frequency), so logits match HF to fp32 rounding.

    Args:
        head_dim: channels per head (even).
        max_seq_len: number of positions, tokens.
        theta: RoPE base (Llama 3: 500000).
        device: where to build the tables (default: the current default device).

    Returns:
        ``(cos, sin)``, each (max_seq_len, head_dim) fp32; the two halves of the last dim repeat.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the halves (a, b) of the last dim to (-b, a): the 90-degree rotation of each channel pair."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their position's angles, in fp32, cast back to ``x.dtype``.

    Args:
        x: (batch, seq, heads, head_dim).
        cos, sin: (seq, head_dim) tables for positions 0..seq-1 (slices of :func:`rope_tables`).

    Returns:
        (batch, seq, heads, head_dim), same dtype as ``x``.
    """
    cos = cos[None, :, None, :].float()
    sin = sin[None, :, None, :].float()
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def apply_rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` with a position per row (decoding with left padding or a KV cache).

    Args:
        x: (batch, seq, heads, head_dim).
        cos, sin: (batch, seq, head_dim), e.g. ``rope_cos[positions]`` for positions (batch, seq).

    Returns:
        (batch, seq, heads, head_dim), same dtype as ``x``; equals :func:`apply_rope` when every row
        has positions 0..seq-1.
    """
    cos = cos[:, :, None, :].float()
    sin = sin[:, :, None, :].float()
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)
