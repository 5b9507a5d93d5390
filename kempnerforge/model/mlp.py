"""SwiGLU feed-forward block (Shazeer, arXiv:2002.05202), as in Llama 3 (arXiv:2407.21783)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``w2(silu(w1(x)) * w3(x))`` with bias-free linears.

    Module names follow torchtitan (``w1`` gate, ``w3`` up, ``w2`` down): the tensor-parallel plan
    shards w1/w3 column-wise and w2 row-wise by these names.

    Args:
        dim: model width, channels.
        hidden_dim: SwiGLU hidden width, channels (``ModelConfig.ffn_hidden``).

    Shapes: (batch, seq, dim) -> (batch, seq, dim).
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``x`` of shape (batch, seq, dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
