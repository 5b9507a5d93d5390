"""Rotary position embeddings (RoFormer, Su et al., arXiv:2104.09864), HF Llama convention.

We use the non-interleaved "rotate_half" layout of HF ``LlamaForCausalLM``: channel ``i`` is paired
with channel ``i + head_dim/2`` (not ``2i`` with ``2i+1`` as in Meta's reference code). With this
layout, converting q/k projection weights to and from HF is a pure rename, no permutation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kempnerforge.config.model import ModelConfig
    from kempnerforge.config.rope import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the channel pairs and the attention factor on cos/sin, in fp32 on CPU.

    Op for op as ``transformers``' ``ROPE_INIT_FUNCTIONS`` (``default``, ``llama3``, ``yarn``), so the
    tables are bitwise HF's: default ``theta ** (-2i / head_dim)``; ``llama3`` (Llama 3.1, arXiv:2407.21783)
    divides wavelengths above ``original_max_position_embeddings / low_freq_factor`` by ``factor`` and
    interpolates up to ``.../ high_freq_factor``; ``yarn`` (arXiv:2309.00071) blends interpolated and
    extrapolated frequencies over the correction range of ``beta_fast``..``beta_slow`` rotations.

    Args:
        head_dim: channels per head that RoPE rotates (even).
        theta: RoPE base.
        scaling: None (plain RoPE) or a :class:`~kempnerforge.config.rope.RopeScaling`.

    Returns:
        ``(inv_freq, attention_factor)``: (head_dim // 2,) fp32, radians per token; and the multiplier
        on cos/sin (1.0 except yarn: :func:`yarn_attention_factor`).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    return _yarn_inv_freq(head_dim, theta, scaling), yarn_attention_factor(scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:  # channel index that makes `rotations` turns over the context
        return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``), arXiv:2309.00071 eq. 22.

    DeepSeek-V3 also multiplies the softmax scale by ``yarn_get_mscale(factor, mscale_all_dim) ** 2``.
    """
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The multiplier YaRN puts on cos and sin (transformers' ``attention_factor``): as given, else
    ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` when both are set
    (DeepSeek-V3), else ``yarn_get_mscale(factor)``."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return float(
            yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
        )
    return yarn_get_mscale(scaling.factor)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for positions 0..max_seq_len-1, in fp32.

    Computed exactly as HF does (fp32 inverse frequencies from :func:`rope_inv_freq`, elementwise
    position * frequency, then cos/sin times the attention factor), so logits match HF to fp32 rounding.

    Args:
        head_dim: channels per head (even).
        max_seq_len: number of positions, tokens.
        theta: RoPE base (Llama 3: 500000).
        device: where to build the tables (default: the current default device).
        scaling: RoPE scaling (``ModelConfig.rope_scaling``); None = plain RoPE.

    Returns:
        ``(cos, sin)``, each (max_seq_len, head_dim) fp32; the two halves of the last dim repeat.
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
    inv_freq = inv_freq.to(device)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def model_rope_tables(
    config: ModelConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_tables` for a decoder config: ``config.rope_head_dim``, ``max_seq_len``, ``rope_theta``, ``rope_scaling``."""
    return rope_tables(config.rope_head_dim, config.max_seq_len, config.rope_theta, device, config.rope_scaling)


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
