"""Causal grouped-query self-attention (GQA, Ainslie et al., arXiv:2305.13245) with RoPE.

As in Llama 3 (arXiv:2407.21783): bias-free q/k/v/o projections, rotary embeddings on q and k,
``n_kv_heads`` key/value heads each shared by ``n_heads / n_kv_heads`` query heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import apply_rope, apply_rope_rows


class Attention(nn.Module):
    """Causal multi-head / grouped-query attention via ``F.scaled_dot_product_attention``.

    Head counts are read from the projection outputs at run time (``view(batch, seq, -1, head_dim)``),
    never stored: after column-wise tensor-parallel sharding of wq/wk/wv each rank holds
    ``n_heads / tp`` query and ``n_kv_heads / tp`` KV heads and the same code runs unchanged.

    Submodules: ``wq`` (dim -> n_heads*head_dim), ``wk``, ``wv`` (dim -> n_kv_heads*head_dim),
    ``wo`` (n_heads*head_dim -> dim), and with ``config.qk_norm`` ``q_norm``/``k_norm``: RMSNorm over
    head_dim applied per head before RoPE (as in Qwen3 / OLMo-style QK-norm).

    Shapes: forward(x (batch, seq, dim), cos (seq, head_dim), sin (seq, head_dim),
    key_mask (batch, seq) bool or None) -> (batch, seq, dim).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hd, n_q, n_kv = config.head_dim, config.n_heads, config.n_kv_heads_resolved
        self.head_dim = hd
        self.wq = nn.Linear(config.dim, n_q * hd, bias=False)
        self.wk = nn.Linear(config.dim, n_kv * hd, bias=False)
        self.wv = nn.Linear(config.dim, n_kv * hd, bias=False)
        self.wo = nn.Linear(n_q * hd, config.dim, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal self-attention over ``x`` (batch, seq, dim) at positions 0..seq-1.

        ``key_mask`` (batch, seq) bool, True at real positions, hides padded keys from every query
        (:func:`causal_key_mask`); a (batch, 1, seq, seq) bool mask is used as given (True = may
        attend; e.g. :func:`document_causal_mask` for packed documents); None is plain causal
        attention (the fast ``is_causal`` kernel).
        """
        bsz, seq, _ = x.shape
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA wants (batch, heads, seq, head_dim); enable_gqa broadcasts KV heads without a copy.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        if key_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask = key_mask if key_mask.dim() == 4 else causal_key_mask(key_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q, k, v (batch, seq, heads, head_dim) of ``x`` before RoPE, QK-norm applied."""
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """Incremental attention for decoding: the new positions ``x`` attend to the cached ones and themselves.

        The training path (:meth:`forward`) is untouched; this runs the same projections, QK-norm and
        RoPE, stores the new keys/values in ``cache`` and attends over everything cached.

        Args:
            x: (batch, new, dim) hidden states of the new positions.
            cos, sin: (batch, new, head_dim) RoPE tables at each row's own positions (left padding
                shifts them per row).
            cache: a :class:`~kempnerforge.model.kv_cache.KVCache` inside a step (``begin`` called).
            layer: this layer's index in ``cache``.
            attn_mask: (batch, 1, new, cached + new) bool from :meth:`KVCache.begin`.

        Returns:
            (batch, new, dim).
        """
        bsz, seq, _ = x.shape
        q, k, v = self._qkv(x)
        q, k = apply_rope_rows(q, cos, sin), apply_rope_rows(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = cache.update(layer, k, v)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def causal_key_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask (batch, 1, seq, seq): query i sees key j when j <= i and ``key_mask[:, j]``.

    Every query also sees itself, so a padded query whose earlier keys are all padding gets a finite
    (meaningless) output instead of a softmax over nothing (NaN that would leak into gradients).

    Args:
        key_mask: (batch, seq) bool, True at real tokens, False at padding.

    Raises:
        ValueError: ``key_mask`` is not a 2-D bool tensor.
    """
    if key_mask.dtype != torch.bool or key_mask.dim() != 2:
        raise ValueError(f"key_mask must be a (batch, seq) bool tensor, got {key_mask.dtype} {tuple(key_mask.shape)}")
    seq = key_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=key_mask.device).tril()
    eye = torch.eye(seq, dtype=torch.bool, device=key_mask.device)
    return ((causal & key_mask[:, None, :]) | eye)[:, None]


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask (batch, 1, seq, seq) for packed documents: query i sees key j when j <= i and
    both belong to the same document, so no token attends across a document boundary.

    Args:
        doc_ids: (batch, seq) int, non-decreasing document index per position
            (:func:`kempnerforge.data.packing.document_ids`).

    Raises:
        ValueError: ``doc_ids`` is not 2-D.
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (batch, seq), got shape {tuple(doc_ids.shape)}")
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
