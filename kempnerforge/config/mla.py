"""Validation and parameter counting for the attention-kind fields of :class:`ModelConfig` (GQA or MLA).

Multi-head latent attention (MLA, DeepSeek-V2, arXiv:2405.04434, sec. 2.1; DeepSeek-V3, arXiv:2412.19437,
sec. 2.1.1) compresses keys and values into a ``kv_lora_rank``-wide latent (plus one shared RoPE key of
``qk_rope_head_dim`` channels) and optionally queries into a ``q_lora_rank``-wide latent. The field names
follow torchtitan's ``deepseek_v3`` model args. Kept apart from ``model.py`` (as :mod:`kempnerforge.config.moe`)
so the dense config stays readable; this module imports nothing from ``model.py``.
"""

from __future__ import annotations

from typing import Protocol

#: Attention kinds: grouped-query attention (Llama, Qwen, Mixtral) or multi-head latent attention (DeepSeek-V2/V3).
ATTENTIONS = ("gqa", "mla")
#: The MLA width fields, each an integer >= 0 (``q_lora_rank`` 0 = no query compression).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class AttentionFields(Protocol):
    """The fields of :class:`~kempnerforge.config.model.ModelConfig` read here (see it for their meaning)."""

    dim: int
    n_heads: int
    n_kv_heads: int | None
    head_dim: int | None
    attention_bias: bool
    qk_norm: bool
    attention: str
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def validate_attention(cfg: AttentionFields) -> None:
    """Check ``attention`` and the MLA widths of ``cfg``.

    Raises:
        ValueError: naming the field and the allowed values: ``attention`` not in :data:`ATTENTIONS`; an MLA
            width that is not an integer >= 0; with ``'gqa'`` an MLA width != 0 (it would be ignored); with
            ``'mla'`` ``kv_lora_rank`` / ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim`` < 1, an odd
            ``qk_rope_head_dim`` (RoPE rotates channel pairs), ``n_kv_heads`` other than None / ``n_heads``
            (every head has its own keys, decompressed from the one latent) or ``qk_norm`` (MLA normalizes
            the latents instead).
    """
    if cfg.attention not in ATTENTIONS:
        raise ValueError(f"ModelConfig.attention={cfg.attention!r} is not allowed; choose one of {list(ATTENTIONS)}")
    for name in MLA_FIELDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"ModelConfig.{name}={value!r} must be an integer >= 0")
    if cfg.attention == "gqa":
        for name in MLA_FIELDS:
            if getattr(cfg, name):
                raise ValueError(
                    f"ModelConfig.{name}={getattr(cfg, name)} is used only with attention='mla'; "
                    "set attention='mla' or leave it 0"
                )
        return
    for name in MLA_FIELDS[1:]:
        if getattr(cfg, name) < 1:
            raise ValueError(f"ModelConfig.{name}={getattr(cfg, name)} must be >= 1 with attention='mla'")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(
            f"ModelConfig.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs of channels)"
        )
    if cfg.n_kv_heads not in (None, cfg.n_heads):
        raise ValueError(
            f"ModelConfig.n_kv_heads={cfg.n_kv_heads} must be None or n_heads={cfg.n_heads} with attention='mla' "
            "(every head decompresses its own keys and values from the shared latent)"
        )
    if cfg.qk_norm:
        raise ValueError("ModelConfig.qk_norm=True is not allowed with attention='mla' (MLA normalizes its latents)")


def validate_mla_extras(cfg: AttentionFields) -> None:
    """With ``attention='mla'``, refuse the GQA-only fields that would be ignored.

    Raises:
        ValueError: naming the field: ``head_dim`` other than None / ``dim // n_heads`` (MLA's head widths are
            ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), ``attention_bias`` True (MLA's
            projections are bias-free, as DeepSeek-V3's).
    """
    if cfg.attention != "mla":
        return
    if cfg.head_dim is not None and cfg.head_dim != cfg.dim // cfg.n_heads:
        raise ValueError(
            f"ModelConfig.head_dim={cfg.head_dim} is not used with attention='mla' (its head widths are "
            "qk_nope_head_dim, qk_rope_head_dim and v_head_dim); leave it None"
        )
    if cfg.attention_bias:
        raise ValueError("ModelConfig.attention_bias=True is not allowed with attention='mla'; allowed: False")


def mla_layer_params(cfg: AttentionFields) -> int:
    """Parameters of one MLA attention layer (projections and the latent RMSNorm gains), exactly as
    :class:`kempnerforge.model.mla.MultiHeadLatentAttention` holds them."""
    heads, dim = cfg.n_heads, cfg.dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = dim * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk  # wq_a, q_norm, wq_b
    else:
        q = dim * heads * qk  # wq
    kv = dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank  # wkv_a, kv_norm
    kv += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # wkv_b
    return q + kv + heads * cfg.v_head_dim * dim  # + wo
