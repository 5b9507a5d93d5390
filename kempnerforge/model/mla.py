"""Multi-head latent attention (MLA): DeepSeek-V2 (arXiv:2405.04434, sec. 2.1) as DeepSeek-V3 uses it.

Keys and values are decompressed per head from one ``kv_lora_rank``-wide latent ``c_kv = kv_norm(W_dkv x)``;
RoPE is "decoupled" (sec. 2.1.3): each query head carries ``qk_rope_head_dim`` extra channels rotated by RoPE,
matched by one rotated key of that width shared by all heads; queries optionally go through a
``q_lora_rank``-wide latent too. Module names follow torchtitan's ``deepseek_v3`` model (``wq`` or ``wq_a`` /
``q_norm`` / ``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``, ``wo``); the math is HF ``DeepseekV3Attention``'s with
``rope_interleave=False`` (the HF converter, :mod:`kempnerforge.checkpoint.hf_deepseek_v3`, permutes the RoPE
channels of interleaved checkpoints into this half-split layout).

Training (:meth:`MultiHeadLatentAttention.forward`) expands the latent into per-head keys and values and runs the
same kernels as GQA (:func:`~kempnerforge.model.attention.attend`: SDPA, FlexAttention block masks or dense bool
masks) with q/k head width ``qk_nope_head_dim + qk_rope_head_dim`` and value width ``v_head_dim``. Decoding
(:meth:`~MultiHeadLatentAttention.forward_cached`) caches only the latent and the rotated shared key,
``kv_lora_rank + qk_rope_head_dim`` values per token and layer (DeepSeek-V2's point: 576 instead of
2 * 128 * 128 per token for V3), and attends in the latent space by absorbing ``wkv_b`` into the query and the
output (sec. 2.1.2, "absorb" inference), so nothing per head is ever cached or re-expanded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import attend, causal_key_mask, context_parallel_kv
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import apply_rope, apply_rope_rows, yarn_get_mscale
from kempnerforge.parallel.expert_tensor_parallel import grad_all_reduce


def mla_softmax_scale(config: ModelConfig) -> float:
    """The attention logits' scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
    ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` under YaRN RoPE scaling with ``mscale_all_dim`` set (DeepSeek-V3's
    long-context setting; HF ``DeepseekV3Attention`` / ``yarn_apply_mscale``, same operation order)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim:
        mscale = yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention with decoupled RoPE; same call contract as
    :class:`~kempnerforge.model.attention.Attention`.

    Submodules (bias-free Linears, fp32-reducing RMSNorms with ``config.norm_eps``):

    - queries: ``wq`` (dim -> n_heads * qk_head_dim) when ``q_lora_rank == 0``, else ``wq_a`` (dim -> q_lora_rank),
      ``q_norm`` (RMSNorm over q_lora_rank), ``wq_b`` (q_lora_rank -> n_heads * qk_head_dim); each head's
      channels are ``[nope (qk_nope_head_dim) | rope (qk_rope_head_dim)]``.
    - keys/values: ``wkv_a`` (dim -> kv_lora_rank + qk_rope_head_dim: the latent, then the shared RoPE key),
      ``kv_norm`` (RMSNorm over kv_lora_rank), ``wkv_b`` (kv_lora_rank -> n_heads * (qk_nope_head_dim + v_head_dim),
      each head's ``[k_nope | v]``).
    - ``wo`` (n_heads * v_head_dim -> dim).

    Tensor parallelism shards heads: ``wq`` / ``wq_b`` and ``wkv_b`` column-wise, ``wo`` row-wise
    (:func:`~kempnerforge.model.tp_plan.dense_decoder_tp_plan`); ``wq_a``, ``wkv_a`` and the two norms see the
    whole (replicated) input and stay replicated plain parameters whose gradients come out whole (the shared RoPE
    key's gradient is summed over TP here, ``tp_mesh`` set by the plan). Head counts
    are read from the projections' outputs at run time, so the sharded module runs unchanged. Context parallelism
    (``cp_mesh``) gathers the per-head keys and values as :class:`~kempnerforge.model.attention.Attention` does.

    Shapes: forward(x (batch, seq, dim), cos (seq, qk_rope_head_dim), sin (seq, qk_rope_head_dim),
    key_mask (batch, seq) bool / (batch, 1, seq, seq) bool / BlockMask / None) -> (batch, seq, dim).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, dim = config.n_heads, config.dim
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.softmax_scale = mla_softmax_scale(config)
        if config.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(dim, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, eps=config.norm_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, heads * self.qk_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps=config.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, dim, bias=False)
        self.tp_mesh = None  # set by the TP plan (LatentAttentionTensorParallel): heads split over it
        self.cp_mesh = None  # set by apply_cp: keys and values gathered over it (context parallelism)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal self-attention over ``x`` (batch, seq, dim) at positions 0..seq-1; ``key_mask`` as in
        :meth:`Attention.forward <kempnerforge.model.attention.Attention.forward>`."""
        bsz, seq, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = causal_key_mask(key_mask) if isinstance(key_mask, torch.Tensor) and key_mask.dim() == 2 else key_mask
        k, v = context_parallel_kv(k, v, self.cp_mesh, mask)
        out = attend(q, k, v, mask, scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-head queries and keys (batch, seq, heads, qk_head_dim) after RoPE and values (batch, seq, heads,
        v_head_dim) of ``x`` at positions 0..seq-1 (``cos``/``sin`` (seq, qk_rope_head_dim))."""
        q_nope, q_pe = self._queries(x)
        latent, k_pe = self._latent(x)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)
        k_nope, v = self._expand(latent)
        k_pe = apply_rope(k_pe, cos, sin).expand(-1, -1, k_nope.shape[2], -1)
        return q, torch.cat([k_nope, k_pe], dim=-1), v

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq, heads, qk_nope_head_dim) and (batch, seq, heads, qk_rope_head_dim), RoPE not yet applied."""
        bsz, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seq, -1, self.qk_dim)
        return q.split([self.nope_dim, self.rope_dim], dim=-1)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized KV latent (batch, seq, kv_lora_rank) and the shared key (batch, seq, 1, qk_rope_head_dim)
        before RoPE."""
        latent, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        if self.tp_mesh is not None:  # every head reads the shared key; this rank holds only its own heads
            k_pe = grad_all_reduce(k_pe, self.tp_mesh)
        return self.kv_norm(latent), k_pe.unsqueeze(2)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``k_nope`` (batch, seq, heads, qk_nope_head_dim) and ``v`` (batch, seq, heads, v_head_dim)."""
        bsz, seq, _ = latent.shape
        kv = self.wkv_b(latent).view(bsz, seq, -1, self.nope_dim + self.v_dim)
        return kv.split([self.nope_dim, self.v_dim], dim=-1)

    def cache_dims(self) -> tuple[int, int, int]:
        """What :class:`~kempnerforge.model.kv_cache.KVCache` holds per token: ``(heads, key width, value width)``
        = ``(1, kv_lora_rank + qk_rope_head_dim, 0)``: the latent and the rotated shared key, no values."""
        return 1, self.kv_rank + self.rope_dim, 0

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """Incremental attention for decoding over a latent cache (the "absorb" form of DeepSeek-V2 sec. 2.1.2).

        With ``wkv_b`` split per head into ``W_uk`` (nope, rank) and ``W_uv`` (v, rank), a head's score is
        ``q_nope . (W_uk c) + q_pe . k_pe = (W_uk^T q_nope) . c + q_pe . k_pe`` and its output
        ``sum_t p_t W_uv c_t = W_uv (sum_t p_t c_t)``: one SDPA call with a single shared KV head of width
        ``kv_lora_rank + qk_rope_head_dim`` (values: its first ``kv_lora_rank`` channels), the same math as
        :meth:`forward` up to rounding order.

        Args:
            x: (batch, new, dim) hidden states of the new positions.
            cos, sin: (batch, new, qk_rope_head_dim) RoPE tables at each row's own positions.
            cache: a :class:`~kempnerforge.model.kv_cache.KVCache` built with :meth:`cache_dims`, inside a step.
            layer: this layer's index in ``cache``.
            attn_mask: (batch, 1, new, cached + new) bool from :meth:`KVCache.begin`.

        Returns:
            (batch, new, dim).
        """
        bsz, seq, _ = x.shape
        q_nope, q_pe = self._queries(x)
        latent, k_pe = self._latent(x)
        k_pe = apply_rope_rows(k_pe, cos, sin)
        keys, _ = cache.update(layer, torch.cat([latent.unsqueeze(2), k_pe], dim=-1).transpose(1, 2), None)
        w = self.wkv_b.weight.view(-1, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)
        q = torch.cat([q_latent, apply_rope_rows(q_pe, cos, sin).transpose(1, 2)], dim=-1)
        out = F.scaled_dot_product_attention(
            q, keys, keys[..., : self.kv_rank], attn_mask=attn_mask, scale=self.softmax_scale, enable_gqa=True
        )
        return self.wo(torch.einsum("bhsr,hvr->bshv", out, w_uv).reshape(bsz, seq, -1))
