"""Gradient-norm clipping that returns the true global norm for DTensor parameters on several meshes.

``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors from different meshes (dense FSDP/TP params
vs expert params, pipeline stages). As in torchtitan's ``dist_utils.clip_grad_norm_``, norms are
computed per mesh, turned into full (replicated) values, and combined as an L2 sum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _group_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return groups


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Global L2 norm of all gradients (a plain scalar tensor, identical on every rank).

    Args:
        parameters: parameters whose ``.grad`` may be plain tensors or DTensors on any meshes.
        norm_type: 2.0 only (the norms of separate meshes combine as an L2 sum).

    Raises:
        ValueError: ``norm_type`` other than 2.
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type}: only the L2 norm (2.0) is supported.")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    squares = []
    for group in _group_by_mesh(grads).values():
        # CPU fp32 reductions over millions of elements drift by ~1e-5 relative; accumulate in fp64 there.
        dtype = torch.float64 if group[0].device.type == "cpu" else None
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dtype=dtype) for g in group])
        )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces the Partial / Shard placements across the mesh
        squares.append(norm.float() ** 2)
    return torch.stack(squares).sum().sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm`` (0: no clipping).

    Every gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))`` (the coefficient of
    ``torch.nn.utils.clip_grad_norm_``), one mesh group at a time.

    Returns:
        The global norm before clipping (scalar tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(params)
    if max_norm > 0 and params:
        # One coefficient for all, applied per mesh: a foreach op cannot mix DTensors of different
        # meshes (e.g. TP+FSDP2 2-D weights next to FSDP2-only 1-D norm weights).
        by_mesh: dict[object, list[torch.Tensor]] = {}
        for p in params:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return norm
