"""Model configuration for the Llama-3 style dense decoder.

Follows Llama 3 (Grattafiori et al., arXiv:2407.21783) for the architecture and
torchtitan's ``ModelArgs`` for the field names. All validation happens in
``__post_init__``, before any tensor is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kempnerforge.config.mla import mla_layer_params, validate_attention, validate_mla_extras
from kempnerforge.config.moe import moe_layer_params, validate_moe
from kempnerforge.config.rope import RopeScaling, rope_scaling_from_dict
from kempnerforge.metrics.flops import transformer_flops_per_token


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-3 style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Raises:
        ValueError: on construction, naming the offending field and the allowed values, when a size
            is not positive, ``dim`` is not divisible by ``n_heads`` (with ``head_dim=None``), ``n_heads`` is
            not divisible by ``n_kv_heads``, ``head_dim`` is odd (RoPE rotates channel pairs), or
            ``rope_scaling`` is invalid (:class:`~kempnerforge.config.rope.RopeScaling`).
    """

    dim: int = 256
    """Model (residual stream) width, channels."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Number of query heads; head_dim = dim / n_heads unless ``head_dim`` is set."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention (GQA, arXiv:2305.13245); None = n_heads (MHA)."""
    vocab_size: int = 50257
    """Vocabulary size, tokens (rows of the embedding and of the output head)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover, tokens."""
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden size; None = Llama rule from dim, ffn_dim_multiplier and multiple_of."""
    ffn_dim_multiplier: float | None = None
    """Multiplier on the Llama rule's 8/3*dim hidden size (Llama-3 8B: 1.3); None = 1."""
    multiple_of: int = 256
    """The Llama-rule hidden size is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base frequency (Llama 3: 500000)."""
    qk_norm: bool = False
    """Apply RMSNorm over head_dim to queries and keys before RoPE (not in HF Llama)."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head."""
    init_std: float = 0.02
    """Std of the truncated-normal (+-3 std) init of embeddings and linears; wo/w2 get 1/sqrt(2*n_layers) of it."""
    rope_scaling: RopeScaling | None = None
    """RoPE context extension ('llama3' of Llama 3.1-3.3, or 'yarn'); None = plain RoPE. A dict of
    :class:`~kempnerforge.config.rope.RopeScaling` fields is accepted (checkpoint metadata, YAML)."""
    head_dim: int | None = None
    """Channels per attention head (even); None = dim / n_heads (:attr:`head_dim_resolved`). Qwen 3 sets it
    so that n_heads * head_dim != dim (wq: dim -> n_heads * head_dim, wo back to dim)."""
    attention_bias: bool = False
    """Bias on the q/k/v projections, not on the output projection (Qwen 2 / 2.5); zeros at init."""
    fuse_qkv: bool = True
    """One ``attention.wqkv`` Linear instead of ``wq``/``wk``/``wv`` (torchtitan's ``fuse_qkv``; rows grouped per KV
    head, :mod:`kempnerforge.model.fused`); same math, init and HF export. GQA attention only (MLA ignores it). On by
    default (faster steps); False for ``optimizer.name='muon'`` or to resume a checkpoint with separate projections."""
    fuse_w13: bool = True
    """One ``feed_forward.w13`` Linear (gate/up rows interleaved) instead of ``w1``/``w3`` in the dense SwiGLU
    blocks (MoE experts and shared experts keep theirs); same math, init and HF export. Needs tp | ffn_hidden. On by
    default; False for ``optimizer.name='muon'`` or to resume a checkpoint with separate ``w1``/``w3``."""

    # -- Attention kind (validated by kempnerforge.config.mla.validate_attention) -----------------------
    attention: str = "gqa"
    """'gqa' (grouped-query attention, :mod:`kempnerforge.model.attention`) or 'mla' (multi-head latent attention,
    DeepSeek-V2 arXiv:2405.04434, :mod:`kempnerforge.model.mla`; the five fields below, n_kv_heads None)."""
    q_lora_rank: int = 0
    """MLA query latent width (DeepSeek-V3: 1536); 0 = no query compression (one ``wq`` projection)."""
    kv_lora_rank: int = 0
    """MLA key/value latent width, the cached width per token (DeepSeek-V3: 512); 'mla' needs >= 1."""
    qk_nope_head_dim: int = 0
    """MLA per-head query/key channels without RoPE (DeepSeek-V3: 128); 'mla' needs >= 1."""
    qk_rope_head_dim: int = 0
    """MLA per-head query/key channels with RoPE, the key part shared by all heads (DeepSeek-V3: 64); even."""
    v_head_dim: int = 0
    """MLA per-head value channels (DeepSeek-V3: 128); 'mla' needs >= 1."""

    # -- Mixture-of-Experts (validated by kempnerforge.config.moe.validate_moe) --------------------
    num_experts: int = 0
    """Routed experts per MoE layer; 0 = dense model (bit-identical to a config without MoE fields)."""
    top_k: int = 2
    """Routed experts each token is sent to (1..num_experts)."""
    moe_frequency: int = 1
    """Layer i is MoE when (i + 1) % moe_frequency == 0 (HF Qwen-MoE ``decoder_sparse_step``); 1 = every layer."""
    n_dense_layers: int = 0
    """The first n_dense_layers blocks keep the dense SwiGLU (of width ffn_hidden) whatever moe_frequency says
    (HF DeepSeek-V3 ``first_k_dense_replace``); 0 = none."""
    num_expert_groups: int = 1
    """Group-limited routing (DeepSeek-V3 ``n_group``): the routed experts form this many equal groups, each token
    picks num_limited_groups groups by the sum of their two highest (biased) scores, then top_k experts inside
    them; 1 = no group limit."""
    num_limited_groups: int = 1
    """Groups each token may route to (DeepSeek-V3 ``topk_group``, 1..num_expert_groups); used when
    num_expert_groups > 1."""
    n_shared_experts: int = 0
    """Always-active SwiGLU experts per MoE layer, each of width expert_hidden (DeepSeekMoE, arXiv:2401.06066)."""
    expert_width_multiplier: float = 1.0
    """Expert SwiGLU width = int(ffn_hidden * multiplier); < 1 gives fine-grained experts (DeepSeekMoE)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' sum by sigmoid(Linear(dim, 1)(x)) (Qwen1.5/2-MoE)."""
    router: str = "softmax"
    """'softmax' (Mixtral, Qwen-MoE) or 'sigmoid' (DeepSeek-V3, with the selection-only expert bias)."""
    router_renormalize: bool = True
    """Divide the top-k gate weights by their sum (Mixtral: always; Qwen-MoE ``norm_topk_prob``)."""
    route_scale: float = 1.0
    """Multiplier on the routed gate weights (DeepSeek-V3 ``routed_scaling_factor``)."""
    aux_loss_weight: float = 0.0
    """Weight of the Switch-Transformer load-balancing loss (arXiv:2101.03961 eq. 4); 0 = off."""
    seq_aux_loss_weight: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (arXiv:2412.19437 eq. 17-20); 0 = off."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss (ST-MoE, arXiv:2202.08906 eq. 5); 0 = off."""
    capacity_factor: float = 0.0
    """Expert capacity = ceil(capacity_factor * tokens * top_k / num_experts) per micro-batch; overflow
    assignments (in token order) are dropped. 0 = no capacity limit, nothing dropped."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3 aux-loss-free balancing rate gamma (sigmoid router only): once per optimizer step
    bias += gamma * sign(mean load - load), then centered. 0 = bias stays zero."""

    def __post_init__(self) -> None:
        self._check_positive()
        validate_attention(self)
        self.rope_scaling = rope_scaling_from_dict(self.rope_scaling)
        if self.head_dim is not None:
            if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
                raise ValueError(f"ModelConfig.head_dim={self.head_dim!r} must be a positive even integer or None")
        elif self.attention == "gqa" and self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads} "
                f"(head_dim = dim / n_heads); got remainder {self.dim % self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads_resolved != 0:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                f"(each KV head serves n_heads / n_kv_heads query heads); allowed: {_divisors(self.n_heads)}"
            )
        if self.head_dim is None:
            if self.attention == "gqa" and self.dim // self.n_heads % 2 != 0:
                raise ValueError(
                    f"ModelConfig head_dim = dim / n_heads = {self.dim} / {self.n_heads} = {self.dim // self.n_heads} "
                    "must be even (RoPE rotates pairs of channels)"
                )
        elif self.attention == "gqa" and self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs of channels)")
        for name in ("attention_bias", "fuse_qkv", "fuse_w13"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be True or False")
        validate_mla_extras(self)
        validate_moe(self)

    def _check_positive(self) -> None:
        required = ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of")
        optional = ("n_kv_heads", "ffn_hidden_dim")
        for name in required + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                allowed = "a positive integer or None" if name in optional else "a positive integer"
                raise ValueError(f"ModelConfig.{name}={value!r} must be {allowed}")
        for name in ("init_std", "norm_eps", "rope_theta", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if name == "ffn_dim_multiplier" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number (> 0)")

    @property
    def rope_head_dim(self) -> int:
        """Channels per head that RoPE rotates (the RoPE tables' width): head_dim, or qk_rope_head_dim for MLA."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim_resolved

    @property
    def n_kv_heads_resolved(self) -> int:
        """Number of key/value heads, with None meaning n_heads (multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim_resolved(self) -> int:
        """Channels per attention head: ``head_dim``, with None meaning dim / n_heads.

        ``head_dim`` itself stays None when not given (as ``n_kv_heads`` does): a resolved value stored in the
        field would travel with the instance (the CLI's default ``ModelConfig()`` gave every recipe its
        dim 256 / 8 heads = 32, and ``dataclasses.replace(cfg, dim=...)`` kept the old width)."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden size (Llama rule unless ``ffn_hidden_dim`` is set).

        Llama rule (Meta's llama reference code; SwiGLU arXiv:2002.05202 keeps the MLP's parameter
        count of a 4*dim GELU MLP): hidden = int(2 * 4 * dim / 3); times ``ffn_dim_multiplier`` if
        set; rounded up to a multiple of ``multiple_of``. dim 4096, multiplier 1.3, multiple_of 1024
        gives 14336 (Llama-3 8B).
        """
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def expert_hidden(self) -> int:
        """SwiGLU width of one routed or shared expert: int(ffn_hidden * expert_width_multiplier)."""
        return int(self.ffn_hidden * self.expert_width_multiplier)

    def is_moe_layer(self, layer: int) -> bool:
        """True when block ``layer`` (0-based) has an MoE feed-forward: num_experts > 0,
        layer >= n_dense_layers and (layer + 1) % moe_frequency == 0."""
        return self.num_experts > 0 and layer >= self.n_dense_layers and (layer + 1) % self.moe_frequency == 0

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Number of distinct trainable parameters, computed analytically (no model needed).

        MoE layers count their router, every routed expert and the shared experts (the router's
        selection bias is a buffer, not a parameter).

        Equals ``sum(p.numel() for p in Transformer(cfg).parameters())`` (a tied matrix counts once).

        Args:
            exclude_embedding: drop the token-embedding table (vocab_size * dim). The output head is
                kept when untied; when tied the shared matrix is the embedding and is dropped.
        """
        return self._count_params(exclude_embedding, active=False)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: as :meth:`num_params`, but MoE layers count only ``top_k``
        routed experts (plus router and shared experts). Equals ``num_params`` for a dense model."""
        return self._count_params(exclude_embedding, active=True)

    def _count_params(self, exclude_embedding: bool, active: bool) -> int:
        dim, hd = self.dim, self.head_dim_resolved
        attn = 2 * dim * self.n_heads * hd + 2 * dim * self.n_kv_heads_resolved * hd
        if self.attention_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads_resolved) * hd
        if self.qk_norm:
            attn += 2 * hd
        if self.attention == "mla":
            attn = mla_layer_params(self)
        dense_ffn = 3 * dim * self.ffn_hidden
        blocks = 0
        for i in range(self.n_layers):
            ffn = moe_layer_params(self, active) if self.is_moe_layer(i) else dense_ffn
            blocks += attn + ffn + 2 * dim  # + attention_norm, ffn_norm
        embedding = self.vocab_size * dim
        head = 0 if self.tie_embeddings else self.vocab_size * dim
        total = embedding + blocks + dim + head  # + final norm
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), FLOP/token.

        PaLM convention (Chowdhery et al., arXiv:2204.02311, appendix B; same as torchtitan):
        ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``, where N counts every weight used in a matmul for
        each token (all non-embedding parameters plus the output head, also when it is tied to the
        embedding, since the head matmul runs either way), and the second term is the attention
        score and value matmuls (QK^T and AV) without discounting the causal mask. Norm weights
        and q/k/v biases are included in N (negligible). MFU divides achieved FLOP/s by peak FLOP/s with this count.
        With ``attention='mla'`` that term is ``6 * n_layers * n_heads * (qk_nope_head_dim + qk_rope_head_dim
        + v_head_dim) * seq_len`` (the same count with MLA's head widths; equal to the PaLM term when both
        widths are head_dim).

        Raises:
            ValueError: if ``seq_len`` is not a positive integer.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"flops_per_token(seq_len={seq_len!r}): seq_len must be a positive integer")
        n_matmul = self.num_active_params(exclude_embedding=True)
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim
        if self.attention == "mla":  # QK^T over qk_nope + qk_rope channels, AV over v_head_dim, per head
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return 6 * n_matmul + 6 * self.n_layers * self.n_heads * (qk + self.v_head_dim) * seq_len
        return transformer_flops_per_token(n_matmul, self.n_layers, self.n_heads * self.head_dim_resolved, seq_len)
