"""Connectors: patch features of the vision tower -> visual tokens at the text width ``dim``.

Token counts are a pure function of the config and the patch grid (:func:`connector_tokens`), so
``max_seq_len`` is checked before any weight exists; the forward produces exactly that many tokens.
Initialization follows the decoder's rule (:mod:`kempnerforge.model.init`): every weight drawn from
the counter-based (seed, FQN, element index) generator, each rank only its own shard, so it is
identical on any mesh.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.vision import ConnectorConfig
from kempnerforge.model.init import trunc_normal_init_


def connector_tokens(cfg: ConnectorConfig, grid: tuple[int, int], width: int) -> int:
    """Visual tokens per image produced by a ``cfg`` connector on a ``grid`` (rows, cols) of patches.

    Args:
        cfg: the connector config.
        grid: (rows, cols) of the patch grid; non-square grids are allowed.
        width: feature width of the vision tower (attn_pool's heads must divide it).

    Raises:
        ValueError: avg_pool with a grid side not a multiple of ``pool_size``, or attn_pool with
            ``n_heads`` not dividing ``width`` (each names the fields and values).
    """
    rows, cols = grid
    if cfg.type == "avg_pool":
        if rows % cfg.pool_size or cols % cfg.pool_size:
            raise ValueError(
                f"connector.pool_size={cfg.pool_size} must divide both sides of the patch grid {rows}x{cols} "
                "(image_size / patch_size); choose a pool_size that divides both."
            )
        return (rows // cfg.pool_size) * (cols // cfg.pool_size)
    if cfg.type == "attn_pool":
        if width % cfg.n_heads:
            raise ValueError(f"connector.n_heads={cfg.n_heads} must divide the encoder width {width}.")
        return cfg.n_queries
    return rows * cols


class _MLP2(nn.Sequential):
    """Linear(width -> dim) -> GELU -> Linear(dim -> dim) (LLaVA-1.5's projector)."""

    def __init__(self, width: int, dim: int) -> None:
        super().__init__(nn.Linear(width, dim), nn.GELU(), nn.Linear(dim, dim))


class Connector(nn.Module):
    """Maps patch features (batch, rows*cols, width) to visual tokens (batch, n_visual, dim).

    ``n_visual`` is :func:`connector_tokens` (see :class:`~kempnerforge.config.vision.ConnectorConfig`
    for the four types and their papers). Submodules: ``proj`` (``linear``: one Linear; else the
    2-layer MLP); attn_pool adds ``queries`` (n_queries, width), ``attn`` (``nn.MultiheadAttention``)
    and ``attn_norm`` (LayerNorm).

    Raises:
        ValueError: at construction, the rules of :func:`connector_tokens`; in forward, features
            whose length is not rows*cols of the grid given at construction.
    """

    def __init__(self, cfg: ConnectorConfig, width: int, dim: int, grid: tuple[int, int]) -> None:
        super().__init__()
        self.cfg = cfg
        self.grid = grid
        self.n_tokens = connector_tokens(cfg, grid, width)
        self.proj = nn.Linear(width, dim) if cfg.type == "linear" else _MLP2(width, dim)
        if cfg.type == "attn_pool":
            self.queries = nn.Parameter(torch.empty(cfg.n_queries, width))
            self.attn_norm = nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, cfg.n_heads, batch_first=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Visual tokens (batch, n_tokens, dim) from patch features (batch, rows*cols, width)."""
        bsz, n, width = features.shape
        rows, cols = self.grid
        if n != rows * cols:
            raise ValueError(f"connector got {n} patch features, expected {rows}x{cols}={rows * cols}.")
        if self.cfg.type == "avg_pool":
            grid = features.transpose(1, 2).reshape(bsz, width, rows, cols)
            features = F.avg_pool2d(grid, self.cfg.pool_size).flatten(2).transpose(1, 2)
        elif self.cfg.type == "attn_pool":
            keys = self.attn_norm(features)
            queries = self.queries.unsqueeze(0).expand(bsz, -1, -1)
            features, _ = self.attn(queries, keys, keys, need_weights=False)
        return self.proj(features)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, prefix: str = "connector") -> None:
        """Weights N(0, (1/sqrt(fan_in))**2) truncated at 3 std from (seed, FQN); biases zero, LayerNorm ones/zeros.

        ``prefix`` is this module's FQN in the model (it enters the per-parameter seeds).
        """
        for name, p in self.named_parameters():
            fqn = f"{prefix}.{name}"
            if name.endswith("bias"):
                p.zero_()
            elif name.startswith("attn_norm"):
                p.fill_(1.0)
            else:
                fan_in = p.shape[-1]
                trunc_normal_init_(p, fqn, seed, 1.0 / math.sqrt(fan_in))
