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


def pack_rope(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The fp32 ``cos`` / ``sin`` tables as one int32 tensor holding their bits, for crossing block boundaries.

    FSDP2's ``MixedPrecisionPolicy`` (``cast_forward_inputs``) casts every floating-point tensor a unit
    receives to its ``param_dtype``: fp32 RoPE tables handed to a bf16 block would be rounded to bf16
    (2e-3 max error in the rotation). An integer tensor is never cast, and the bit view is exact and free;
    :func:`unpack_rope` views it back inside the block. (torchtitan passes a complex ``freqs_cis`` for the
    same reason; inductor has no complex code generation, so per-block compile would fall back there.)

    Args:
        cos, sin: (..., head_dim) fp32 tables (slices of :func:`rope_tables`, or per-row gathers of them).

    Returns:
        (2, ..., head_dim) int32.
    """
    return torch.stack((cos.float(), sin.float())).view(torch.int32)


def unpack_rope(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` fp32 views of a :func:`pack_rope` tensor (2, ..., head_dim) int32; no copy.

    Raises:
        TypeError: ``rope`` is not int32 (e.g. fp32 tables passed where the packed tensor belongs).
    """
    if rope.dtype != torch.int32:
        raise TypeError(f"expected the packed RoPE tables (int32, kempnerforge.model.rope.pack_rope), got {rope.dtype}")
    tables = rope.view(torch.float32)
    return tables[0], tables[1]
