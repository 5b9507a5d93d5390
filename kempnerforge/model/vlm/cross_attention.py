"""``cross_attention``: a text-only residual stream that reads visual tokens through gated cross-attention.

Llama 3-V (Grattafiori et al., arXiv:2407.21783, sec. 7.2; the released Mllama layers): before
every ``cross_attn_every``-th decoder layer (layers 0, N, 2N, ...) a cross-attention block

    h = x + tanh(cross_attention_gate) * cross_attention(cross_attention_norm(x), visual)
    out = h + tanh(cross_ffn_gate) * cross_feed_forward(cross_ffn_norm(h))

with both gates initialized to zero, so a fresh model is exactly the text model. The cross-attention
uses grouped-query attention (``cross_attn_n_kv_heads`` key/value heads), per-head RMSNorm on q and
k (as Mllama), no RoPE and no causal mask (every text token sees every real visual token).
The text parts keep the dense decoder's module names, so a text checkpoint loads unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.decoder_init import init_decoder_
from kempnerforge.model.mlp import FeedForward
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import model_rope_tables, pack_rope
from kempnerforge.model.tp_plan import TPPlan, dense_decoder_tp_plan
from kempnerforge.model.transformer import Transformer, TransformerBlock
from kempnerforge.model.vlm.base import VLMBackbone, register_arch
from kempnerforge.model.vlm.joint_decoder import load_matching_state
from kempnerforge.parallel.activation_checkpoint import register_checkpointable_block

#: Cross-attention projections that write into the residual stream (scaled init like ``attention.wo``).


class CrossAttention(nn.Module):
    """Multi-head / grouped-query attention of text queries over visual keys and values.

    Submodules: ``wq`` (dim -> n_heads*head_dim), ``wk``/``wv`` (dim -> n_kv_heads*head_dim), ``wo``,
    ``q_norm``/``k_norm`` (RMSNorm over head_dim). Head counts are read from projection outputs at run
    time, so column-wise TP sharding works unchanged.

    Shapes: forward(x (batch, text, dim), visual (batch, n_visual, dim), visual_mask (batch, n_visual)
    bool or None) -> (batch, text, dim). A sample without any real visual token gets zeros.
    """

    def __init__(self, config: ModelConfig, n_kv_heads: int) -> None:
        super().__init__()
        hd = config.head_dim_resolved
        self.head_dim = hd
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.q_norm = RMSNorm(hd, eps=config.norm_eps)
        self.k_norm = RMSNorm(hd, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, visual: torch.Tensor, visual_mask: torch.Tensor | None) -> torch.Tensor:
        """Cross-attention output (batch, text, dim); see the class docstring for shapes."""
        bsz, seq, _ = x.shape
        n_vis = visual.shape[1]
        q = self.q_norm(self.wq(x).view(bsz, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(visual).view(bsz, n_vis, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(visual).view(bsz, n_vis, -1, self.head_dim).transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        mask = None
        if visual_mask is not None:
            # A sample with no real visual token would softmax over nothing (NaN): let it see all keys,
            # then zero its output below.
            has_any = visual_mask.any(dim=1)
            mask = (visual_mask | ~has_any[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if visual_mask is not None:
            out = out * has_any[:, None, None].to(out.dtype)
        return self.wo(out)


@register_checkpointable_block
class CrossAttentionDecoderLayer(TransformerBlock):
    """A dense decoder layer, preceded (when ``has_cross``) by the tanh-gated cross-attention block.

    Shapes: forward(x (batch, text, dim), rope (2, text, rope_head_dim) int32 (packed RoPE tables,
    :func:`~kempnerforge.model.rope.pack_rope`), key_mask (batch, text) bool or None, visual (batch,
    n_visual, dim) or None, visual_mask (batch, n_visual) bool or None) -> (batch, text, dim). With
    ``visual`` None the cross block is skipped (a text-only batch).
    """

    def __init__(self, config: ModelConfig, layer: int, has_cross: bool, n_kv_heads: int) -> None:
        super().__init__(config, layer)
        self.has_cross = has_cross
        if has_cross:
            self.cross_attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
            self.cross_attention = CrossAttention(config, n_kv_heads)
            self.cross_ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
            self.cross_feed_forward = FeedForward(config.dim, config.ffn_hidden)
            self.cross_attention_gate = nn.Parameter(torch.zeros(1))
            self.cross_ffn_gate = nn.Parameter(torch.zeros(1))

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        visual: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gated cross block (if any and ``visual`` given), then the dense decoder layer."""
        if self.has_cross and visual is not None:
            attn = self.cross_attention(self.cross_attention_norm(x), visual, visual_mask)
            x = x + torch.tanh(self.cross_attention_gate) * attn
            x = x + torch.tanh(self.cross_ffn_gate) * self.cross_feed_forward(self.cross_ffn_norm(x))
        return super().forward(x, rope, key_mask)


@register_arch("cross_attention")
class CrossAttentionDecoder(VLMBackbone):
    """Llama 3-V style backbone (see the module docstring): self-attention over text only.

    Module names: the dense decoder's (``tok_embeddings``, ``layers.{i}.attention...``, ``norm``,
    ``output``) plus ``layers.{i}.cross_*`` in layers ``0, N, 2N, ...`` (N = ``cross_attn_every``).
    """

    tie_weights = Transformer.tie_weights

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__(text, vlm)
        n_kv = vlm.cross_attn_n_kv_heads or text.n_heads
        if text.n_heads % n_kv:
            raise ValueError(
                f"vlm.cross_attn_n_kv_heads={n_kv} must divide model.config.n_heads={text.n_heads} (GQA groups)."
            )
        every = vlm.cross_attn_every
        self.cross_layers = [i for i in range(text.n_layers) if i % every == 0]
        self.tok_embeddings = nn.Embedding(text.vocab_size, text.dim)
        self.layers = nn.ModuleDict(
            {str(i): CrossAttentionDecoderLayer(text, i, i % every == 0, n_kv) for i in range(text.n_layers)}
        )
        self.norm = RMSNorm(text.dim, eps=text.norm_eps)
        self.output = nn.Linear(text.dim, text.vocab_size, bias=False)
        cos, sin = model_rope_tables(text)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The dense decoder's plan; the cross blocks, present in some layers only, go in ``root`` by full path:
        ``wq/wk/wv`` and ``cross_feed_forward.w1/w3`` column-wise, ``wo`` and ``w2`` row-wise (Megatron split);
        ``q_norm``/``k_norm`` act on whole local heads and stay replicated.

        Raises:
            ValueError: ``sequence_parallel`` (the cross blocks' visual input is not sequence-sharded).
        """
        if sequence_parallel:
            raise ValueError("cross_attention does not support sequence_parallel; set sequence_parallel=False.")
        plan = dense_decoder_tp_plan(self.config, sequence_parallel=False, loss_parallel=loss_parallel)
        for i in self.cross_layers:
            p = f"layers.{i}"
            plan.root.update(
                {
                    f"{p}.cross_attention.wq": ColwiseParallel(),
                    f"{p}.cross_attention.wk": ColwiseParallel(),
                    f"{p}.cross_attention.wv": ColwiseParallel(),
                    f"{p}.cross_attention.wo": RowwiseParallel(),
                    f"{p}.cross_feed_forward.w1": ColwiseParallel(),
                    f"{p}.cross_feed_forward.w3": ColwiseParallel(),
                    f"{p}.cross_feed_forward.w2": RowwiseParallel(),
                }
            )
        return plan

    def sequence_length(self, n_visual: int, n_text: int) -> int:
        """``n_text``: visual tokens are keys of the cross-attention only, never RoPE positions."""
        return n_text

    def load_text_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a dense Transformer state dict into the text parts; cross blocks keep their (zero-gated) init.

        Raises:
            KeyError: text keys missing from ``state`` or unknown keys in it (named).
        """
        load_matching_state(self, state)

    def forward(
        self,
        input_ids: torch.Tensor,
        visual: torch.Tensor | None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **loss: Any,
    ) -> Any:
        """Text logits (batch, n_text, vocab_size), or with ``labels`` the fused loss (:meth:`VLMBackbone.head`);
        raises ValueError when n_text > max_seq_len."""
        seq = input_ids.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"text length {seq} exceeds ModelConfig.max_seq_len={self.rope_cos.shape[0]}")
        rope = pack_rope(self.rope_cos[:seq], self.rope_sin[:seq])  # int32 bits: no bf16 cast at the blocks
        h = self.tok_embeddings(input_ids)
        if visual is not None:
            visual = visual.to(h.dtype)
        for layer in self.layers.values():
            # text_mask is right padding: causal queries at real positions never see a padded key, so the
            # self-attention takes the is_causal kernel (padding_attention_mask); the cross-attention masks
            # padded visual tokens.
            h = layer(h, rope, None, visual, visual_mask)
        return self.head(h, slice(None), labels, **loss)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The dense decoder's rules (:meth:`Transformer.init_weights`: per-FQN truncated normal, residual
        outputs scaled by 1/sqrt(2 n_layers), RMSNorm ones, RoPE tables) extended to the cross blocks
        (``cross_attention.wo`` and ``cross_feed_forward.w2`` scaled like residual outputs), and both
        gates zero, so the model starts as the text model.

        With :attr:`init_from`, the text parts are read from the text model's folder (:meth:`load_init_from_`); the
        cross blocks keep this init.

        Raises:
            RuntimeError: a parameter no rule covers.
            KeyError, ValueError: see :meth:`load_init_from_`.
        """
        gates: set[int] = self.load_init_from_()
        for layer in self.modules():  # through any AC / compile wrapper
            if isinstance(layer, CrossAttentionDecoderLayer) and layer.has_cross:
                layer.cross_attention_gate.zero_()
                layer.cross_ffn_gate.zero_()
                gates |= {id(layer.cross_attention_gate), id(layer.cross_ffn_gate)}
        init_decoder_(self, self.config, seed, done=gates)
