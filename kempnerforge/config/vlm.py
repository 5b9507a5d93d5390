"""Vision-language configuration: which architecture joins visual tokens to the text backbone.

The text backbone itself is a :class:`~kempnerforge.config.model.ModelConfig`; this dataclass holds
what the VLM adds on top of it. Validation happens in ``__post_init__``, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Allowed values of ``VLMConfig.arch`` (each a registered :class:`~kempnerforge.model.vlm.base.VLMBackbone`).
VLM_ARCHS: tuple[str, ...] = ("joint_decoder", "cross_attention", "mot", "moma")

#: Modality ids used in every ``modality`` tensor (batch, seq) int64; a video frame is an image.
TEXT, IMAGE = 0, 1
N_MODALITIES = 2


@dataclass
class VLMConfig:
    """How visual tokens enter the text backbone.

    Architectures (``arch``):

    - ``joint_decoder`` (LLaVA, Liu et al., arXiv:2304.08485): visual tokens prepended to the text.
    - ``cross_attention`` (Llama 3-V, arXiv:2407.21783 sec. 7): a text-only residual stream with a
      zero-initialized, tanh-gated cross-attention block before every ``cross_attn_every``-th layer.
    - ``mot`` (Mixture-of-Transformers, Liang et al., arXiv:2411.04996): per-modality projections,
      norms and FFNs, one global causal self-attention.
    - ``moma`` (MoMa, Lin et al., arXiv:2407.21770): shared attention, per-modality groups of
      ``moma_experts_per_modality`` experts with expert-choice routing at ``moma_capacity_factor``.

    Raises:
        ValueError: on construction, naming the field and the allowed values.
    """

    arch: str = "joint_decoder"
    """One of :data:`VLM_ARCHS`."""
    cross_attn_every: int = 2
    """cross_attention: a gated cross-attention block before layers 0, N, 2N, ... (>= 1)."""
    cross_attn_n_kv_heads: int | None = None
    """cross_attention: key/value heads of the cross-attention (GQA); None = the backbone's n_heads."""
    moma_experts_per_modality: int = 4
    """moma: experts in each modality's group (>= 1)."""
    moma_capacity_factor: float = 1.0
    """moma: each expert takes ``capacity_factor * tokens_of_its_modality / experts_per_modality`` tokens (> 0)."""

    def __post_init__(self) -> None:
        if self.arch not in VLM_ARCHS:
            raise ValueError(f"vlm.arch={self.arch!r} is not allowed; choose one of {list(VLM_ARCHS)}.")
        if self.cross_attn_every < 1:
            raise ValueError(f"vlm.cross_attn_every={self.cross_attn_every} must be >= 1.")
        if self.cross_attn_n_kv_heads is not None and self.cross_attn_n_kv_heads < 1:
            raise ValueError(f"vlm.cross_attn_n_kv_heads={self.cross_attn_n_kv_heads} must be >= 1 or null.")
        if self.moma_experts_per_modality < 1:
            raise ValueError(f"vlm.moma_experts_per_modality={self.moma_experts_per_modality} must be >= 1.")
        if not self.moma_capacity_factor > 0:
            raise ValueError(f"vlm.moma_capacity_factor={self.moma_capacity_factor} must be > 0.")
