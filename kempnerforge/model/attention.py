"""Causal grouped-query self-attention (GQA, Ainslie et al., arXiv:2305.13245) with RoPE, and its masks.

As in Llama 3 (arXiv:2407.21783): bias-free q/k/v/o projections (q/k/v biases with ``attention_bias``, Qwen 2), rotary embeddings on q and k,
``n_kv_heads`` key/value heads each shared by ``n_heads / n_kv_heads`` query heads.

Which kernel runs (:func:`attend`) follows from the mask, built once per forward for all layers:

- None: ``scaled_dot_product_attention(is_causal=True)`` (flash / memory-efficient on CUDA). Unpacked
  text and right-padded batches take it (:func:`padding_attention_mask`).
- a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``, CUDA): packed documents
  (:func:`document_attention_mask`) and padding inside a sequence; the block mask holds only which
  (128 x 128) blocks are full, partial or empty, never a ``(seq, seq)`` matrix, and the compiled kernel
  skips the empty blocks.
- a bool ``(batch, 1, seq, seq)`` tensor: the same masks materialized (:func:`document_causal_mask`,
  :func:`causal_key_mask`) on devices without FlexAttention's backward (CPU); they are also the
  oracle the FlexAttention path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import apply_rope, apply_rope_rows
from kempnerforge.parallel.context_parallel import gather_kv


class Attention(nn.Module):
    """Causal multi-head / grouped-query attention via ``F.scaled_dot_product_attention``.

    Head counts are read from the projection outputs at run time (``view(batch, seq, -1, head_dim)``),
    never stored: after column-wise tensor-parallel sharding of wq/wk/wv each rank holds
    ``n_heads / tp`` query and ``n_kv_heads / tp`` KV heads and the same code runs unchanged.

    Submodules: ``wq`` (dim -> n_heads*head_dim), ``wk``, ``wv`` (dim -> n_kv_heads*head_dim), or with
    ``fused`` (default ``config.fuse_qkv``) one ``wqkv`` (dim -> (n_heads + 2*n_kv_heads)*head_dim, rows grouped per
    KV head, :mod:`kempnerforge.model.fused`; the same math as the three),
    ``wo`` (n_heads*head_dim -> dim; ``head_dim`` may differ from dim / n_heads, as in Qwen 3); with
    ``config.attention_bias`` wq/wk/wv carry a bias (Qwen 2), and with ``config.qk_norm`` ``q_norm``/``k_norm``:
    RMSNorm over head_dim applied per head before RoPE (Qwen 3's placement, tested against transformers).

    With context parallelism (``cp_mesh`` set by :func:`~kempnerforge.parallel.context_parallel.apply_cp`) the
    keys and values of every cp rank are all-gathered after RoPE and the local queries attend to all of them
    under the mask the model passes (:meth:`~kempnerforge.parallel.context_parallel.ContextShard.attention_mask`).

    Shapes: forward(x (batch, seq, dim), cos (seq, head_dim), sin (seq, head_dim),
    key_mask (batch, seq) bool or None) -> (batch, seq, dim); under cp, seq is this rank's share.
    """

    #: The 1-D ``cp`` mesh K/V are gathered over (context parallelism), or None.
    cp_mesh: DeviceMesh | None = None

    def __init__(self, config: ModelConfig, fused: bool | None = None) -> None:
        super().__init__()
        hd, n_q, n_kv = config.head_dim_resolved, config.n_heads, config.n_kv_heads_resolved
        self.head_dim = hd
        self.heads_per_kv = n_q // n_kv
        self.fused = config.fuse_qkv if fused is None else fused
        bias = config.attention_bias  # Qwen 2: q/k/v only, never the output projection
        if self.fused:  # rows grouped per KV head (kempnerforge.model.fused): TP's row chunks hold whole groups
            self.wqkv = nn.Linear(config.dim, (n_q + 2 * n_kv) * hd, bias=bias)
        else:
            self.wq = nn.Linear(config.dim, n_q * hd, bias=bias)
            self.wk = nn.Linear(config.dim, n_kv * hd, bias=bias)
            self.wv = nn.Linear(config.dim, n_kv * hd, bias=bias)
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
        (:func:`causal_key_mask`); a (batch, 1, seq, seq) bool mask or a FlexAttention ``BlockMask``
        is used as given (see :func:`attend`; e.g. :func:`document_attention_mask` for packed
        documents); None is plain causal attention (the fast ``is_causal`` kernel).
        """
        bsz, seq, _ = x.shape
        q, k, v = self._qkv(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # (batch, heads, seq, head_dim) for the kernels; GQA broadcasts KV heads without a copy.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = causal_key_mask(key_mask) if isinstance(key_mask, torch.Tensor) and key_mask.dim() == 2 else key_mask
        k, v = context_parallel_kv(k, v, self.cp_mesh, mask)
        out = attend(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q, k, v (batch, seq, heads, head_dim) of ``x`` before RoPE, QK-norm applied."""
        bsz, seq, _ = x.shape
        if self.fused:
            # (batch, seq, kv_heads, heads_per_kv + 2, head_dim); kv_heads is this rank's under TP.
            qkv = self.wqkv(x).view(bsz, seq, -1, self.heads_per_kv + 2, self.head_dim)
            q, k, v = qkv.split([self.heads_per_kv, 1, 1], dim=3)
            q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3)
        else:
            q = self.wq(x).view(bsz, seq, -1, self.head_dim)
            k = self.wk(x).view(bsz, seq, -1, self.head_dim)
            v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def cache_dims(self) -> tuple[int, int, int]:
        """What :class:`~kempnerforge.model.kv_cache.KVCache` holds per token: ``(n_kv_heads, head_dim, head_dim)``."""
        if self.fused:
            return self.wqkv.weight.shape[0] // ((self.heads_per_kv + 2) * self.head_dim), self.head_dim, self.head_dim
        return self.wk.weight.shape[0] // self.head_dim, self.head_dim, self.head_dim

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


def context_parallel_kv(
    k: torch.Tensor, v: torch.Tensor, cp_mesh: DeviceMesh | None, mask: torch.Tensor | BlockMask | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (batch, kv_heads, seq, head_dim) as attention sees them: unchanged without context
    parallelism, else every cp rank's gathered (:func:`~kempnerforge.parallel.context_parallel.gather_kv`).

    Raises:
        RuntimeError: under cp without a mask: the causal kernel would compare gathered keys by their index,
            not their global position (the batch must come through ``shard_batch``).
    """
    if cp_mesh is None:
        return k, v
    if mask is None:
        raise RuntimeError(
            "context parallelism needs the cp attention mask: pass the batch through "
            "kempnerforge.parallel.context_parallel.shard_batch and its 'cp' entry to the model (cp=...)."
        )
    return gather_kv(k, v, cp_mesh)


#: ``torch.compile`` d ``flex_attention`` (its eager form is a slow reference path), made on first use.
_FLEX: list = []


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | BlockMask | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention with the kernel the mask calls for (see the module docstring).

    Args:
        q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim), ``heads % kv_heads == 0``
            (grouped-query attention broadcasts the KV heads without copying them); v may be narrower or
            wider than q/k (MLA: v_head_dim != qk head dim; SDPA and FlexAttention both allow it).
        mask: None (causal, ``is_causal`` kernel), a FlexAttention ``BlockMask`` (its ``mask_mod`` already
            holds causality), or a bool SDPA mask broadcastable to (batch, heads, seq, seq), True = may attend.
        scale: the logits' scale; None = 1 / sqrt(q's head_dim).

    Returns:
        (batch, heads, seq, v's head_dim).
    """
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if isinstance(mask, BlockMask):
        if not _FLEX:
            _FLEX.append(torch.compile(flex_attention, dynamic=False))
        return _FLEX[0](q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def flex_attention_supported(device: torch.device) -> bool:
    """Whether masks for ``device`` are FlexAttention block masks: CUDA only (torch 2.13 has no
    FlexAttention backward on CPU, so CPU training keeps the dense masks)."""
    return device.type == "cuda"


def document_attention_mask(doc_ids: torch.Tensor, flex: bool | None = None) -> torch.Tensor | BlockMask:
    """The mask for packed documents (:func:`document_causal_mask`'s rule) in the form :func:`attend` runs
    fastest: a FlexAttention ``BlockMask`` on CUDA (nothing ``(seq, seq)`` is materialized), the dense
    bool mask elsewhere.

    Args:
        doc_ids: (batch, seq) int, non-decreasing document index per position.
        flex: force the block mask (True) or the dense mask (False); None: :func:`flex_attention_supported`.

    Raises:
        ValueError: ``doc_ids`` is not 2-D.
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (batch, seq), got shape {tuple(doc_ids.shape)}")
    if not (flex_attention_supported(doc_ids.device) if flex is None else flex):
        return document_causal_mask(doc_ids)

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    return _block_mask(same_document_causal, doc_ids)


def padding_attention_mask(
    key_mask: torch.Tensor | None, right_padded: bool, flex: bool | None = None
) -> torch.Tensor | BlockMask | None:
    """The causal self-attention mask of a padded batch, decided on the host (no device read-back).

    With right padding (every padded position after every real one, e.g. text padded at its end,
    or ``[visual; text]`` with all visual tokens real) the answer is None, the ``is_causal`` kernel: a
    query at a real position i sees keys j <= i, which are all real, so its output equals the masked
    one exactly; a padded query sees earlier padding, a finite value that reaches no real position
    and whose label is ignored. Padding inside the sequence (padded video frames before the text)
    needs the mask: a FlexAttention ``BlockMask`` on CUDA, :func:`causal_key_mask` elsewhere.

    Args:
        key_mask: (batch, seq) bool, True at real positions, or None (nothing padded).
        right_padded: the caller knows the padding is all at the end of each row.
        flex: as in :func:`document_attention_mask`.
    """
    if key_mask is None or right_padded:
        return None
    if not (flex_attention_supported(key_mask.device) if flex is None else flex):
        return causal_key_mask(key_mask)

    def causal_real_keys(b, h, q, kv):
        return ((q >= kv) & key_mask[b, kv]) | (q == kv)  # every query sees itself (see causal_key_mask)

    return _block_mask(causal_real_keys, key_mask)


def _block_mask(mask_mod, like: torch.Tensor) -> BlockMask:
    bsz, seq = like.shape
    # _compile builds the block structure chunk by chunk instead of evaluating a (batch, seq, seq) grid.
    compile_mask = like.device.type == "cuda"
    return create_block_mask(mask_mod, bsz, None, seq, seq, device=like.device, _compile=compile_mask)


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
