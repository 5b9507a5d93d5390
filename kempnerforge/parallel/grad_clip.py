"""Gradient-norm clipping that returns the true global norm for DTensor parameters on several meshes.

``torch.nn.utils.clip_grad_norm_`` cannot mix DTensors from different meshes (dense FSDP/TP params
vs expert params, pipeline stages). As in torchtitan's ``dist_utils.clip_grad_norm_``, norms are
computed per mesh, turned into full (replicated) values, and combined as an L2 sum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

#: Elements per fp32 partial norm on CPU (see :func:`_cpu_norm`).
_CPU_ROW = 1024


def _group_by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return groups


def _cpu_norm(g: torch.Tensor) -> torch.Tensor:
    """L2 norm of a plain CPU tensor, accurate to ~1e-7 relative at fp32 speed.

    torch's CPU fp32 ``vector_norm`` accumulates sequentially: over millions of elements it drifts by
    ~1e-4 relative, and by ~1e-5 even over 64k (which breaks single- vs multi-process parity and the
    equality of a callback's fp64 norm with ``train/grad_norm``); fp64 is exact but 2-3x slower. Norms of
    1024-element rows (one batched call), combined the same way level by level, stay within ~1e-7 and
    are faster than one flat call.
    """
    flat = g.reshape(-1)
    if flat.numel() <= _CPU_ROW:
        return torch.linalg.vector_norm(flat)
    whole = flat.numel() // _CPU_ROW * _CPU_ROW
    parts = [torch.linalg.vector_norm(flat[:whole].view(-1, _CPU_ROW), dim=1)]
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:]).reshape(1))
    return _cpu_norm(torch.cat(parts))


def _group_norm(group: list[torch.Tensor]) -> torch.Tensor:
    if group[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(group)  # foreach norms, then the norm of those
    if isinstance(group[0], DTensor):
        # DTensor's norm rules need the whole (sharded) tensor; accumulate in fp64 for the accuracy above.
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in group]))
        return norm.full_tensor().float()  # reduces the Partial / Shard placements across the mesh
    return torch.linalg.vector_norm(torch.stack([_cpu_norm(g) for g in group]))


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 norm of all gradients (a plain fp32 scalar tensor, identical on every rank).

    Args:
        parameters: parameters whose ``.grad`` may be plain tensors or DTensors on any meshes.
        norm_type: 2.0 only (the norms of separate meshes combine as an L2 sum).
        pp_group: with pipeline parallelism, the ``pp`` group: each rank holds other stages' parameters,
            so the squared norms are summed over it (every pp rank must call this).

    Raises:
        ValueError: ``norm_type`` other than 2.
    """
    if norm_type != 2.0:
        raise ValueError(f"norm_type={norm_type}: only the L2 norm (2.0) is supported.")
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = [torch.zeros((), device=grads[0].device if grads else "cpu")]
    for group in _group_by_mesh(grads).values():
        norm = _group_norm(group)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _grads_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # A foreach op cannot mix DTensors of different meshes (e.g. TP+FSDP2 2-D weights next to
    # FSDP2-only 1-D norm weights): one list per mesh.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    return list(by_mesh.values())


@torch.no_grad()
def scale_grads_(parameters: Iterable[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every ``.grad`` in place by ``factor`` (one ``_foreach_mul_`` per mesh; None grads skipped).

    Args:
        parameters: parameters with plain or DTensor ``.grad``.
        factor: a Python number or a scalar tensor; a tensor stays on its device (no host read-back),
            moved to each gradient's device and dtype.
    """
    for grads in _grads_by_mesh([p for p in parameters if p.grad is not None]):
        f = factor.to(grads[0].device, torch.float32) if isinstance(factor, torch.Tensor) else factor
        torch._foreach_mul_(grads, f)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    grad_scale: torch.Tensor | float = 1.0,
    pp_group: dist.ProcessGroup | None = None,
    norm_skip: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients by ``grad_scale``, then clip them to global L2 norm ``max_norm`` (0: no clipping).

    Both happen in one multiply per gradient: ``g *= grad_scale * min(1, max_norm / (norm + 1e-6))``
    with ``norm = grad_scale * ||g||`` (the coefficient of ``torch.nn.utils.clip_grad_norm_``), one
    mesh group at a time. Nothing is read back on the host: the coefficient stays a device scalar.
    With ``max_norm == 0`` and ``grad_scale == 1`` the gradients are not touched (the norm is only measured).

    Args:
        parameters: parameters with plain or DTensor ``.grad`` (None is skipped).
        max_norm: clip threshold on the scaled norm; 0 scales only.
        grad_scale: factor applied to every gradient before the norm is measured (a number or a scalar tensor).
        pp_group: the pipeline group when ``pp > 1`` (the norm covers every stage; see :func:`total_grad_norm`).
        norm_skip: parameters scaled and clipped but left out of the norm: a second copy of one logical
            weight (the last pipeline stage's tied embedding, counted on the first stage).

    Returns:
        The global norm of the scaled gradients before clipping (fp32 scalar tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params and pp_group is None:
        return torch.tensor(0.0)
    scaled = isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0
    skip = {id(p) for p in norm_skip}
    norm = total_grad_norm([p for p in params if id(p) not in skip], pp_group=pp_group)
    if scaled:
        norm = norm * grad_scale
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        scale_grads_(params, coef * grad_scale if scaled else coef)
    elif scaled:
        scale_grads_(params, grad_scale)
    return norm


def check_lightning_clipping(gradient_clip_val: float | None) -> None:
    """Refuse Lightning's ``trainer.gradient_clip_val``: clipping is the module's ``grad_clip``.

    The modules clip in ``on_before_optimizer_step`` by the true global norm over DTensor, expert and
    pipeline gradients (:func:`clip_grad_norm_`). Lightning's clipping would run ``torch.nn.utils`` on
    top of that: a second clip under FSDP2, a crash on TP's mixed meshes. ``None`` and 0 (Lightning's
    "off") pass.

    Raises:
        ValueError: ``gradient_clip_val`` set and not 0 (one line naming ``model.grad_clip``).
    """
    if gradient_clip_val is None or float(gradient_clip_val) == 0.0:
        return
    raise ValueError(
        f"trainer.gradient_clip_val={gradient_clip_val} is not supported: kempnerforge clips by the global gradient "
        f"norm over every mesh and pipeline stage itself; set model.grad_clip={gradient_clip_val} (default 1.0, "
        "0 disables it) and remove trainer.gradient_clip_val."
    )
