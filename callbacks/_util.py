"""Small helpers shared by the callbacks: batch token counts and the data-parallel degree."""

from __future__ import annotations

from typing import Any

import torch


def batch_tokens(batch: Any) -> torch.Tensor | None:
    """The token tensor of a batch: ``batch["input_ids"]`` for dict batches, else the first tensor
    (a tensor batch itself, or element 0 of a tuple/list). None when there is none."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            if isinstance(item, torch.Tensor):
                return item
    return None


def data_parallel_size(trainer: Any) -> int:
    """Number of data-parallel replicas: the ``dp`` sub-mesh of KempnerStrategy's ``parallel_mesh``,
    else the world size (DDP and single-device strategies: every rank is a data-parallel rank)."""
    mesh = getattr(trainer.strategy, "parallel_mesh", None)
    if mesh is not None:
        return mesh.dp.size()
    return trainer.world_size
