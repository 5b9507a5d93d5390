"""Small DTensor helpers shared by the model wrapper, init, checks and tests."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard


def to_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``t.full_tensor()`` for a DTensor (a collective on its mesh), else ``t`` itself.

    Under :class:`kempnerforge.strategies.KempnerStrategy` parameters are DTensors when FSDP2 or TP
    applied (any dp or tp degree > 1, or bf16 parameters) and plain tensors otherwise.
    """
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``t``: ``t.to_local()`` for a DTensor (no communication), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """For each dim of ``t``, the global indices along that dim of the elements this rank stores, in local order.

    This rank's local tensor (``t.to_local()``, shape ``(len(i0), len(i1), ...)``) is the global tensor indexed by
    the outer product of the returned index vectors: ``local[a, b, ...] == global[i0[a], i1[b], ...]``. Works for
    any placement DTensor, FSDP2 or TP produce: ``Shard(d)`` on any dim (uneven chunks and empty shards included),
    several mesh dims sharding one tensor dim, FSDP2 x TP ``_StridedShard``, ``Replicate``. Each vector is what
    ``distribute_tensor`` keeps of ``arange(size)`` along that dim (local slicing only, no communication), so the
    answer follows DTensor's own chunking rules whatever they are. A plain tensor gives ``arange`` per dim.

    Args:
        t: a plain tensor or DTensor of global shape (n0, n1, ...).

    Returns:
        one int64 vector per dim, on the local tensor's device (O(sum of dims) memory, never O(numel)).

    Raises:
        ValueError: a ``Partial`` placement (a parameter is never a pending reduction).
        RuntimeError: the indices disagree with the local tensor's shape (a placement this helper misreads).
    """
    device = local_part(t).device
    if not isinstance(t, DTensor):
        return [torch.arange(n, device=device) for n in t.shape]
    for p in t.placements:
        if p.is_partial():
            raise ValueError(f"shard_indices: placement {p} is a pending reduction, not a layout of a parameter.")
    out = []
    for d, n in enumerate(t.shape):
        # Only the placements that split dim d matter for it; a view of shape (1, .., n, .., 1) keeps the DTensor's
        # placements (and their dims) valid without touching the other dims.
        placements = [p if _splits(p, d) else Replicate() for p in t.placements]
        view = [1] * t.ndim
        view[d] = n
        idx = torch.arange(n, device=t.device_mesh.device_type).view(view)
        out.append(distribute_tensor(idx, t.device_mesh, placements, src_data_rank=None).to_local().reshape(-1))
    local_shape = tuple(local_part(t).shape)
    if tuple(len(i) for i in out) != local_shape:
        raise RuntimeError(
            f"shard_indices: placements {t.placements} of a {tuple(t.shape)} tensor give local shape "
            f"{tuple(len(i) for i in out)}, but the local tensor is {local_shape}."
        )
    return [i.to(device) for i in out]


def _splits(p, d: int) -> bool:
    return isinstance(p, Shard | _StridedShard) and p.dim == d


def index_runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values in a 1-D int index vector, as ``(local_start, global_start, length)``.

    ``index = [4, 5, 6, 9, 10]`` gives ``[(0, 4, 3), (3, 9, 2)]``: slicing ``global[4:7]`` and ``global[9:11]``
    reads exactly the elements at ``index``. Shards of ``Shard`` placements are one run; ``_StridedShard`` gives one
    run per stride.
    """
    if index.numel() == 0:
        return []
    index = index.cpu()
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).reshape(-1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, index.numel()]
    return [(s, int(index[s]), e - s) for s, e in zip(starts, ends, strict=True)]
