"""Model configuration for the Llama-3 style dense decoder.

Follows Llama 3 (Grattafiori et al., arXiv:2407.21783) for the architecture and
torchtitan's ``ModelArgs`` for the field names. All validation happens in
``__post_init__``, before any tensor is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kempnerforge.metrics.flops import transformer_flops_per_token


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-3 style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP).

    Raises:
        ValueError: on construction, naming the offending field and the allowed values, when a size
            is not positive, ``dim`` is not divisible by ``n_heads``, ``n_heads`` is not divisible by
            ``n_kv_heads``, or ``head_dim`` is odd (RoPE rotates channel pairs).
    """

    dim: int = 256
    """Model (residual stream) width, channels."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Number of query heads; head_dim = dim / n_heads."""
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

    def __post_init__(self) -> None:
        self._check_positive()
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim={self.dim} must be divisible by n_heads={self.n_heads} "
                f"(head_dim = dim / n_heads); got remainder {self.dim % self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads_resolved != 0:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                f"(each KV head serves n_heads / n_kv_heads query heads); allowed: {_divisors(self.n_heads)}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig head_dim = dim / n_heads = {self.dim} / {self.n_heads} = {self.head_dim} "
                "must be even (RoPE rotates pairs of channels)"
            )

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
    def head_dim(self) -> int:
        """Channels per attention head: dim / n_heads."""
        return self.dim // self.n_heads

    @property
    def n_kv_heads_resolved(self) -> int:
        """Number of key/value heads, with None meaning n_heads (multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

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

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Number of distinct trainable parameters, computed analytically (no model needed).

        Equals ``sum(p.numel() for p in Transformer(cfg).parameters())`` (a tied matrix counts once).

        Args:
            exclude_embedding: drop the token-embedding table (vocab_size * dim). The output head is
                kept when untied; when tied the shared matrix is the embedding and is dropped.
        """
        dim, hd = self.dim, self.head_dim
        attn = 2 * dim * self.n_heads * hd + 2 * dim * self.n_kv_heads_resolved * hd
        if self.qk_norm:
            attn += 2 * hd
        block = attn + 3 * dim * self.ffn_hidden + 2 * dim  # + attention_norm, ffn_norm
        embedding = self.vocab_size * dim
        head = 0 if self.tie_embeddings else self.vocab_size * dim
        total = embedding + self.n_layers * block + dim + head  # + final norm
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), FLOP/token.

        PaLM convention (Chowdhery et al., arXiv:2204.02311, appendix B; same as torchtitan):
        ``6 * N + 12 * n_layers * dim * seq_len``, where N counts every weight used in a matmul for
        each token (all non-embedding parameters plus the output head, also when it is tied to the
        embedding, since the head matmul runs either way), and the second term is the attention
        score and value matmuls (QK^T and AV) without discounting the causal mask. Norm weights are
        included in N (negligible). MFU divides achieved FLOP/s by peak FLOP/s with this count.

        Raises:
            ValueError: if ``seq_len`` is not a positive integer.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"flops_per_token(seq_len={seq_len!r}): seq_len must be a positive integer")
        n_matmul = self.num_params(exclude_embedding=True)
        if self.tie_embeddings:
            n_matmul += self.vocab_size * self.dim
        return transformer_flops_per_token(n_matmul, self.n_layers, self.dim, seq_len)
