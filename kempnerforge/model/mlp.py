"""SwiGLU feed-forward block (Shazeer, arXiv:2002.05202), as in Llama 3 (arXiv:2407.21783)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``w2(silu(w1(x)) * w3(x))`` with bias-free linears.

    Module names follow torchtitan (``w1`` gate, ``w3`` up, ``w2`` down): the tensor-parallel plan
    shards w1/w3 column-wise and w2 row-wise by these names. With ``fused``, one ``w13`` (dim -> 2 * hidden_dim,
    row ``2i`` gate row ``i``, row ``2i + 1`` up row ``i``: :mod:`kempnerforge.model.fused`) replaces w1/w3.

    Args:
        dim: model width, channels.
        hidden_dim: SwiGLU hidden width, channels (``ModelConfig.ffn_hidden``).
        fused: one gate/up Linear (``ModelConfig.fuse_w13`` for the dense blocks); same math.

    Shapes: (batch, seq, dim) -> (batch, seq, dim).
    """

    def __init__(self, dim: int, hidden_dim: int, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        if fused:  # gate/up rows interleaved (kempnerforge.model.fused): TP's row chunks hold whole pairs
            self.w13 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        else:
            self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        if not fused:
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``x`` of shape (batch, seq, dim)."""
        if self.fused:
            gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
