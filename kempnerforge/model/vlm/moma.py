"""MoMa backbone (``vlm.arch: moma``; Lin et al. 2024, arXiv:2407.21770): modality-aware mixture of experts.

Each block keeps the dense decoder's shared parts (pre-norms and one global causal self-attention
over ``[visual; text]``, :class:`~kempnerforge.model.attention.Attention` or, with ``attention='mla'``,
:class:`~kempnerforge.model.mla.MultiHeadLatentAttention`) and replaces the FFN by one
group of ``vlm.moma_experts_per_modality`` SwiGLU experts per modality: image tokens go only to the
image group and text tokens only to the text group (sec. 2.2, "modality-aware sparsity"); inside a
group, experts choose tokens (:mod:`~kempnerforge.model.vlm.expert_choice`) per sequence with
capacity ``vlm.moma_capacity_factor``.

TRAINING ONLY: expert choice is non-causal (a token's routing depends on later tokens of its sample),
so this backbone cannot decode autoregressively as trained (the paper adds auxiliary routers for
that, which this implementation does not). ``MoMaBackbone.training_only`` is True; ``kforge generate``
must refuse it.

Module names: ``layers.{i}.attention_norm``, ``layers.{i}.attention.wq`` ... as the dense decoder;
``layers.{i}.feed_forward.{text|image}.router`` (Linear dim -> experts) and
``layers.{i}.feed_forward.{text|image}.experts.w1/w2/w3`` (packed, ``(experts, hidden, dim)``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.attention.flex_attention import BlockMask

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.attention import Attention
from kempnerforge.model.mla import MultiHeadLatentAttention
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import unpack_rope
from kempnerforge.model.tp_plan import dense_decoder_tp_plan
from kempnerforge.model.vlm.base import register_arch
from kempnerforge.model.vlm.dispatch import MODALITY_NAMES, ModalityDispatch
from kempnerforge.model.vlm.expert_choice import ExpertChoiceFFN
from kempnerforge.model.vlm.prefix_backbone import PrefixBackbone
from kempnerforge.parallel.activation_checkpoint import register_checkpointable_block


@register_checkpointable_block
class MoMaBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x)); out = h + experts_m(ffn_norm(h))`` where
    ``experts_m`` is the expert-choice group of each token's modality (arXiv:2407.21770, sec. 2.2).

    Norms and attention are shared by all modalities (as the paper); the FFN is per modality. The attention is the
    text model's: GQA, or multi-head latent attention with ``attention='mla'`` (DeepSeek-V2, arXiv:2405.04434).

    Shapes: forward(x (batch, seq, dim), rope (2, seq, rope_head_dim) int32 (packed RoPE tables,
    :func:`~kempnerforge.model.rope.pack_rope`), key_mask (batch, seq) bool or None, dispatch, attn_mask) ->
    (batch, seq, dim). Padded positions (``key_mask`` False) take no expert capacity.
    """

    def __init__(self, config: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = MultiHeadLatentAttention(config) if config.attention == "mla" else Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        n_exp, cf = vlm.moma_experts_per_modality, vlm.moma_capacity_factor
        self.feed_forward = nn.ModuleDict(
            {m: ExpertChoiceFFN(config.dim, config.expert_hidden, n_exp, cf) for m in MODALITY_NAMES}
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        key_mask: torch.Tensor | None,
        dispatch: ModalityDispatch,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Apply the block to ``x`` (batch, seq, dim); ``attn_mask`` is the backbone's attention mask,
        ``key_mask`` keeps padded positions out of the expert choice."""
        cos, sin = unpack_rope(rope)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_mask)
        normed = self.ffn_norm(h)
        parts = []
        for m, name in enumerate(MODALITY_NAMES):
            real = None if key_mask is None else dispatch.gather(key_mask, m)
            parts.append(self.feed_forward[name](dispatch.gather(normed, m), real))
        return h + dispatch.scatter(parts)


@register_arch("moma")
class MoMaBackbone(PrefixBackbone):
    """Modality-aware mixture of experts over ``[visual; text]`` (Lin et al. 2024, arXiv:2407.21770).

    ``n_layers`` :class:`MoMaBlock` s; embedding, final norm, output head and RoPE from
    :class:`~kempnerforge.model.vlm.prefix_backbone.PrefixBackbone`. Expert width is
    ``ModelConfig.expert_hidden`` (``ffn_hidden * expert_width_multiplier``). Training only (see the
    module docstring): ``training_only`` is True.

    Shapes: as :class:`~kempnerforge.model.vlm.base.VLMBackbone` (logits for text positions).

    Raises:
        ValueError: at construction, ``ModelConfig.num_experts > 0`` (token-choice MoE layers and
            MoMa's expert groups do not combine).
    """

    training_only: ClassVar[bool] = True

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__(text, vlm)
        self.layers = nn.ModuleDict({str(i): MoMaBlock(text, vlm) for i in range(text.n_layers)})

    def block_tp_plan(self) -> dict[str, ParallelStyle]:
        """The dense decoder's attention split (Q/K/V column-wise, O row-wise, QK-norms on local heads; MLA's heads
        split and its module's own style, :class:`~kempnerforge.model.tp_plan.LatentAttentionTensorParallel`, which
        sums the shared RoPE key's gradient over TP); the expert groups and routers stay replicated over the TP ranks
        (packed expert weights are not ``nn.Linear`` modules; each TP rank computes the same expert outputs and
        gradients)."""
        dense = dense_decoder_tp_plan(self.config, sequence_parallel=False, loss_parallel=False).block
        return {k: v for k, v in dense.items() if k == "attention" or k.startswith("attention.")}

    def text_key(self, fqn: str) -> str | None:
        """Shared parts read their own dense key; every expert of a group reads the dense FFN weight
        (sparse upcycling, Komatsuzaki et al., arXiv:2212.05055); routers keep their init (None).

        Raises:
            ValueError: the experts' width differs from the dense FFN's (``expert_width_multiplier != 1``).
        """
        parts = fqn.split(".")
        if len(parts) > 3 and parts[2] == "feed_forward":
            if parts[4] == "router":
                return None
            if self.config.expert_hidden != self.config.ffn_hidden:
                raise ValueError(
                    "moma warm start copies the dense FFN into every expert, which needs expert_hidden == "
                    f"ffn_hidden; got {self.config.expert_hidden} != {self.config.ffn_hidden} "
                    "(set ModelConfig.expert_width_multiplier=1)."
                )
            return ".".join([*parts[:3], parts[-1], "weight"])  # layers.i.feed_forward.w1.weight
        return fqn

    def text_copies(self, fqn: str) -> int:
        """Expert weights stack ``moma_experts_per_modality`` copies of the dense FFN weight (0 for the rest)."""
        return self.vlm_config.moma_experts_per_modality if ".experts." in fqn else 0

    def from_text(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """Expert weights: the dense (out, in) matrix repeated over the group's experts."""
        copies = self.text_copies(fqn)
        return full[None].expand(copies, *full.shape) if copies else full
