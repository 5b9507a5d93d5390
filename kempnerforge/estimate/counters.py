"""Per-rank FLOPs and collective bytes of one simulated step, counted op by op (a ``TorchDispatchMode``).

Like torch's ``MemTracker``, the mode lets DTensor desugar first (it returns ``NotImplemented`` for DTensor
ops), so it sees the local ops a rank really runs: local matmul shapes under TP / EP, and the collectives
FSDP2, TP (DTensor redistribution), EP (all-to-all) and the loss issue, with their process groups.

- FLOPs: ``torch.utils.flop_counter``'s formulas (matmuls, SDPA kernels), plus the kernels it has no entry
  for that our models run: the CPU flash-attention kernels (the simulation runs on CPU; same FLOPs as the
  CUDA kernels), ``torch._grouped_mm`` (MoE experts) and in-place matmuls (``addmm_``, in the fused head + loss). Activation recomputation is included: these are
  the FLOPs executed, not the model FLOPs of the 6N rule.
- Collectives: bytes per kind (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
  ``broadcast``, ``send_recv``) and mesh axis (``tp``, ``dp_shard``, ``ep``, ...), sized as torch's
  ``fake_collectives.CollectiveOp`` does: the gathered (all-gather) or reduced (reduce-scatter) full buffer,
  the all-reduced tensor, sent + received bytes for an all-to-all.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

#: Collective kind of each c10d / functional collective op name (the op's name without namespace and overload).
KIND_OF_OP: dict[str, str] = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send_recv",
    "recv_": "send_recv",
    "isend": "send_recv",
    "irecv": "send_recv",
}


def _cpu_flash_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """``torch._grouped_mm``: ``(M, K) x (G, K, N)`` groups M, ``(M, K) x (K, N)`` groups K (weight grads),
    ``(G, M, K) x (G, K, N)`` is a batched matmul; each is ``2 * M * K * N`` summed over groups."""
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:  # groups along N
        return 2 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[-1]


#: FLOP formulas for kernels ``torch.utils.flop_counter`` does not know (keyed by op overload packet).
EXTRA_FLOPS: dict[Any, Any] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_flops),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward_flops),
    ("_grouped_mm", _grouped_mm_flops),
):
    if hasattr(aten, _name):
        EXTRA_FLOPS[getattr(aten, _name)] = _fn
# In-place variants count as their out-of-place op (e.g. ``addmm_``, which the fused head + loss uses).
for _packet, _fn in list(flop_registry.items()):
    _inplace = getattr(aten, f"{getattr(_packet, '__name__', '')}_", None)
    if _inplace is not None and _inplace not in flop_registry:
        EXTRA_FLOPS[_inplace] = _fn


class StepCounter(TorchDispatchMode):
    """Counts the FLOPs and collective bytes this rank executes while active.

    Args:
        axis_of_group: process-group name -> mesh axis label (e.g. ``{"2": "tp"}``); groups not in it are
            reported as ``"world"`` when they span the world, else ``"other"``.

    Attributes:
        flops: executed FLOPs (multiply-add = 2).
        comm: ``{(kind, axis): bytes}`` over the step.
        calls: ``{(kind, axis): number of collective calls}``.
    """

    def __init__(self, axis_of_group: dict[str, str]) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.flops = 0
        self._propagating = 0
        self.comm: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __enter__(self):
        # DTensor derives an op's global output shape by running it once on fake global-shape tensors (the
        # first time it sees an op schema); those runs reach this mode too, but no rank executes them: a
        # full-vocab head matmul per step at tp=2 (the debug model at tp=2 counted 127 GFLOP instead of 46).
        self._propagating = 0
        self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        counter, propagate = self, self._propagate

        def propagate_uncounted(propagator, op_schema):
            counter._propagating += 1
            try:
                return propagate(propagator, op_schema)
            finally:
                counter._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_uncounted
        return super().__enter__()

    def __exit__(self, *exc):
        ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
        return super().__exit__(*exc)

    def add_flops(self, flops: int) -> None:
        """Add FLOPs counted analytically (a module the simulation could not run, see ``fake_ops``)."""
        self.flops += int(flops)

    def add_comm(self, kind: str, axis: str, nbytes: int) -> None:
        """Record a communication the simulation does not execute as a collective (pipeline send/recv)."""
        self.comm[(kind, axis)] += int(nbytes)
        self.calls[(kind, axis)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._propagating:
            return out
        if func in collective_ops:
            if func not in sync_ops:
                self._record_collective(func, out, args, kwargs)
            return out
        packet = func._overloadpacket
        formula = flop_registry.get(packet) or EXTRA_FLOPS.get(packet)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out

    def _record_collective(self, func, out, args, kwargs) -> None:
        name = func._opname
        kind = KIND_OF_OP.get(name, name)
        try:
            group = CollectiveOp.get_process_group(func, args)
            axis = self.axis_of_group.get(group.group_name, "other")
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
        except TypeError:  # an op torch's table does not size (e.g. a batched p2p): counted, size unknown
            axis, nbytes = "other", 0
        self.comm[(kind, axis)] += int(nbytes)
        self.calls[(kind, axis)] += 1


def mesh_groups(parallel_mesh: Any) -> dict[str, tuple[str, Any]]:
    """Process-group name -> (mesh-axis label, group) for every group a
    :class:`~kempnerforge.parallel.mesh.ParallelMesh` hands out (the 1-D axes of more than one rank, the flattened
    ``dp`` group, the ``cp`` and expert meshes' groups) and the world group. A group serving two roles keeps the
    first label."""
    groups: dict[str, tuple[str, Any]] = {}

    def add(group: Any, label: str) -> None:
        groups.setdefault(group.group_name, (label, group))

    world = parallel_mesh.world
    for axis in world.mesh_dim_names:
        if world[axis].size() > 1:
            group = world.get_group(axis)
            groups[group.group_name] = (axis, group)
    dims = parallel_mesh.dims
    if dims.dp > 1:
        add(parallel_mesh.dp.get_group(), "dp")
    if dims.cp > 1:  # FSDP2 shards over dp_shard x cp; the loss counts tokens over dp x cp
        fsdp = parallel_mesh.fsdp
        group = fsdp.get_group(fsdp.ndim - 1)
        groups[group.group_name] = ("dp_shard_cp", group)
        add(parallel_mesh.dp_cp.get_group(), "dp_cp")
    if dims.ep > 1:
        group = parallel_mesh.ep.get_group()
        groups[group.group_name] = ("ep", group)
        expert_fsdp = parallel_mesh.expert_fsdp  # (dp_replicate, dp_shard_mod_ep) with HSDP, else 1-D
        for i, axis in enumerate(expert_fsdp.mesh_dim_names):
            if expert_fsdp.size(i) > 1:
                lent = "dp_shard" if dims.cp == 1 else "dp_shard_cp"  # the axis ep borrows from
                add(expert_fsdp.get_group(i), f"{lent}/ep" if axis == "dp_shard_mod_ep" else axis)
        if parallel_mesh.expert_shard is not None:  # EP + HSDP: experts' norms reduce over it
            add(parallel_mesh.expert_shard.get_group(), "dp_shard")
    add(dist.group.WORLD, "world")
    return groups


def axis_of_group(parallel_mesh: Any) -> dict[str, str]:
    """Process-group name -> mesh-axis label for every group of :func:`mesh_groups`."""
    return {name: label for name, (label, _) in mesh_groups(parallel_mesh).items()}
