"""AdamW with decoupled weight decay and parameter groups that exempt norms, biases and embeddings.

Follows Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (arXiv:1711.05101), and the
GPT-2 / nanoGPT / litgpt convention of not decaying 1-D parameters and embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters (``--model.optimizer.*`` on the CLI)."""

    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to 2-D weight matrices."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    decay_norms_and_biases: bool = False
    """Also decay 1-D parameters (norm weights, biases)."""
    decay_embeddings: bool = False
    """Also decay embedding tables (and a head tied to them)."""
    fused: bool | None = None
    """Use the fused AdamW kernel (None: on CUDA only)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr} must be > 0.")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay={self.weight_decay} must be >= 0.")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimizerConfig.{name}={getattr(self, name)} must be in [0, 1).")
        if not self.eps > 0:
            raise ValueError(f"OptimizerConfig.eps={self.eps} must be > 0.")


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Embedding parameters are found by module type (``nn.Embedding``), so a head tied to the embedding
    follows the embedding's rule. Returns groups with ``weight_decay`` set; empty groups are dropped.
    """
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        exempt = (p.ndim < 2 and not cfg.decay_norms_and_biases) or (
            id(p) in embedding_ids and not cfg.decay_embeddings
        )
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` of ``model`` (works on FSDP2 / DTensor parameters)."""
    params = list(model.parameters())
    fused = cfg.fused if cfg.fused is not None else bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused
    )
