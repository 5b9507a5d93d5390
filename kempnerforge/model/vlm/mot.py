"""Mixture-of-Transformers backbone (``vlm.arch: mot``; Liang et al. 2024, arXiv:2411.04996).

Every non-embedding weight of a transformer block is untied per modality: the attention's Q/K/V/O
projections (and QK-norms), both RMSNorms and the SwiGLU FFN. Attention itself stays one global causal
self-attention over all tokens (visual prefix + text) with RoPE: each token is projected by its
modality's weights, then every query attends to every earlier key whatever its modality (paper sec.
2.2, Algorithm 1). The token embedding, final norm and output head are the text model's.

Module names (the contract for TP, AC, FSDP2, DCP FQNs and the warm start) insert the modality name
after the dense decoder's module: ``layers.{i}.attention.wq.{text|image}``,
``layers.{i}.attention_norm.{m}``, ``layers.{i}.feed_forward.{m}.w1``, ... Dropping that part gives
the dense :class:`~kempnerforge.model.Transformer` FQN, which is where every modality's copy is
seeded from at init and warm-started from: a fresh MoT equals the dense text model of the same seed,
and :meth:`MoTBackbone.load_text_state_dict` copies a text checkpoint into every modality.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.nn.attention.flex_attention import BlockMask

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.attention import attend
from kempnerforge.model.mlp import FeedForward
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import apply_rope, unpack_rope
from kempnerforge.model.vlm.base import register_arch
from kempnerforge.model.vlm.dispatch import MODALITY_NAMES, ModalityDispatch
from kempnerforge.model.vlm.prefix_backbone import PrefixBackbone
from kempnerforge.parallel.activation_checkpoint import register_checkpointable_block


def _per_modality(make) -> nn.ModuleDict:
    """One module per modality, keyed by :data:`MODALITY_NAMES`."""
    return nn.ModuleDict({name: make() for name in MODALITY_NAMES})


def _fns(modules: nn.ModuleDict) -> list[nn.Module]:
    """The modules in modality-id order (what :meth:`ModalityDispatch.apply` expects)."""
    return [modules[name] for name in MODALITY_NAMES]


class MoTAttention(nn.Module):
    """Global causal GQA self-attention with per-modality ``wq``/``wk``/``wv``/``wo`` (and QK-norms).

    As :class:`~kempnerforge.model.attention.Attention` (head counts read from the projection outputs,
    so column-wise TP sharding of every modality's projections runs unchanged), except that each
    token is projected by its own modality's weights (MoT, arXiv:2411.04996, Algorithm 1).

    Shapes: forward(parts (per modality id: (batch, n_m, dim), normed), cos (seq, head_dim), sin (seq,
    head_dim), mask (see :func:`~kempnerforge.model.attention.attend`), dispatch) -> (batch, seq, dim) in sequence order.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hd, n_q, n_kv = config.head_dim_resolved, config.n_heads, config.n_kv_heads_resolved
        self.head_dim = hd
        bias = config.attention_bias  # as the dense Attention: q/k/v only
        self.wq = _per_modality(lambda: nn.Linear(config.dim, n_q * hd, bias=bias))
        self.wk = _per_modality(lambda: nn.Linear(config.dim, n_kv * hd, bias=bias))
        self.wv = _per_modality(lambda: nn.Linear(config.dim, n_kv * hd, bias=bias))
        self.wo = _per_modality(lambda: nn.Linear(n_q * hd, config.dim, bias=False))
        self.q_norm = _per_modality(lambda: RMSNorm(hd, eps=config.norm_eps)) if config.qk_norm else None
        self.k_norm = _per_modality(lambda: RMSNorm(hd, eps=config.norm_eps)) if config.qk_norm else None

    def _project(self, parts: list[torch.Tensor], dispatch: ModalityDispatch, proj: nn.ModuleDict, norm):
        """Each modality's tokens through its projection (and per-head norm), back in sequence order:
        parts[m] (batch, n_m, dim) -> (batch, seq, heads, head_dim)."""
        heads = []
        for name, t in zip(MODALITY_NAMES, parts, strict=True):
            out = proj[name](t)
            out = out.view(*out.shape[:2], out.shape[-1] // self.head_dim, self.head_dim)  # -1 fails on 0 tokens
            heads.append(out if norm is None else norm[name](out))
        return dispatch.scatter(heads)

    def forward(
        self,
        parts: list[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
        dispatch: ModalityDispatch,
    ) -> torch.Tensor:
        """Causal self-attention over the whole sequence from its per-modality parts (already gathered
        and normed, so each modality's tokens are gathered once for Q, K and V) under ``mask``
        (:func:`~kempnerforge.model.attention.attend`: None is the is_causal kernel; padded keys are
        hidden by :func:`~kempnerforge.model.attention.padding_attention_mask`)."""
        q = apply_rope(self._project(parts, dispatch, self.wq, self.q_norm), cos, sin)
        k = apply_rope(self._project(parts, dispatch, self.wk, self.k_norm), cos, sin)
        v = self._project(parts, dispatch, self.wv, None)
        bsz, seq = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = attend(q, k, v, mask)
        return dispatch.apply(out.transpose(1, 2).reshape(bsz, seq, -1), _fns(self.wo))


@register_checkpointable_block
class MoTBlock(nn.Module):
    """Pre-norm MoT block: ``h = x + attn(norm_m(x)); out = h + ffn_m(ffn_norm_m(h))``, with ``_m`` the
    token's modality's weights and one global attention (arXiv:2411.04996, sec. 2.2).

    Shapes: forward(x (batch, seq, dim), rope (2, seq, head_dim) int32 (packed RoPE tables,
    :func:`~kempnerforge.model.rope.pack_rope`), key_mask (batch, seq) bool or None, dispatch, attn_mask) ->
    (batch, seq, dim).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = _per_modality(lambda: RMSNorm(config.dim, eps=config.norm_eps))
        self.attention = MoTAttention(config)
        self.ffn_norm = _per_modality(lambda: RMSNorm(config.dim, eps=config.norm_eps))
        self.feed_forward = _per_modality(lambda: FeedForward(config.dim, config.ffn_hidden))

    def _ffn(self, name: str):
        norm, ffn = self.ffn_norm[name], self.feed_forward[name]
        return lambda t: ffn(norm(t))

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        key_mask: torch.Tensor | None,
        dispatch: ModalityDispatch,
        attn_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Apply the block to ``x`` (batch, seq, dim); ``attn_mask`` is the backbone's attention mask
        (``key_mask`` is not needed: padding is in ``attn_mask``)."""
        cos, sin = unpack_rope(rope)
        normed = [self.attention_norm[name](dispatch.gather(x, m)) for m, name in enumerate(MODALITY_NAMES)]
        h = x + self.attention(normed, cos, sin, attn_mask, dispatch)
        return h + dispatch.apply(h, [self._ffn(name) for name in MODALITY_NAMES])


@register_arch("mot")
class MoTBackbone(PrefixBackbone):
    """Mixture-of-Transformers over ``[visual; text]`` (Liang et al. 2024, arXiv:2411.04996).

    ``n_layers`` :class:`MoTBlock` s in ``layers``; embedding, final norm, output head and RoPE from
    :class:`~kempnerforge.model.vlm.prefix_backbone.PrefixBackbone`. Causal, so usable for generation.

    Shapes: forward(input_ids (batch, n_text), visual (batch, n_visual, dim) or None, text_mask
    (batch, n_text) bool or None, visual_mask (batch, n_visual) bool or None) -> logits (batch,
    n_text, vocab_size).

    Raises:
        ValueError: at construction, ``ModelConfig.num_experts > 0``.
    """

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__(text, vlm)
        self.layers = nn.ModuleDict({str(i): MoTBlock(text) for i in range(text.n_layers)})

    def block_tp_plan(self) -> dict[str, ParallelStyle]:
        """Megatron split of every modality's weights (torchtitan ``apply_tp`` per modality): ``wq``,
        ``wk``, ``wv``, ``w1``, ``w3`` column-wise (heads / hidden channels), ``wo``, ``w2`` row-wise
        (replicated residual out); per-head QK-norms see only local heads (weights replicated DTensors)."""
        plan: dict[str, ParallelStyle] = {}
        for m in MODALITY_NAMES:
            plan.update({f"attention.{w}.{m}": ColwiseParallel() for w in ("wq", "wk", "wv")})
            plan[f"attention.wo.{m}"] = RowwiseParallel(output_layouts=Replicate())
            plan.update({f"feed_forward.{m}.{w}": ColwiseParallel() for w in ("w1", "w3")})
            plan[f"feed_forward.{m}.w2"] = RowwiseParallel(output_layouts=Replicate())
            if self.config.qk_norm:
                plan[f"attention.q_norm.{m}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
                plan[f"attention.k_norm.{m}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return plan

    def seed_fqn(self, fqn: str) -> str:
        """The dense text model's FQN (modality part dropped): every modality starts as the text model."""
        return _dense_fqn(fqn)

    def text_key(self, fqn: str) -> str | None:
        """Every modality's copy of a weight reads the dense weight of the same place."""
        return _dense_fqn(fqn)


def _dense_fqn(fqn: str) -> str:
    """``layers.0.attention.wq.image.weight`` -> ``layers.0.attention.wq.weight``."""
    return ".".join(part for part in fqn.split(".") if part not in MODALITY_NAMES)
