"""Expert parallelism (EP): shard every MoE layer's packed experts over the ``ep`` mesh (chain step 2).

Follows torchtitan v0.2 (``apply_moe_ep_tp`` / ``ExpertParallel``): expert weights become DTensors
``Shard(0)`` on the 1-D ``ep`` mesh (rank r keeps experts ``[r * E / ep, (r + 1) * E / ep)``), and the
MoE layer sends each token to the rank owning its expert with ``all_to_all_single`` and back
(:mod:`kempnerforge.parallel.ep_dispatch`). ``ep`` borrows ranks from ``dp_shard``: the expert
weights are then FSDP2-sharded over the remaining ``dp_shard / ep`` ranks
(:func:`kempnerforge.parallel.fsdp.apply_fsdp` with ``expert_mesh``).

With tensor parallelism too, TP has already split every expert's hidden channels over ``tp`` (expert-TP,
:mod:`kempnerforge.parallel.expert_tensor_parallel`); EP then splits dim 0 of those shards, and the weights
become DTensors on the 2-D ``(ep, tp)`` mesh, ``(Shard(0), Shard(1))`` for ``w1`` / ``w3`` and
``(Shard(0), Shard(2))`` for ``w2``. The tokens of each TP rank are dispatched inside its own EP group.

Its place in the chain is fixed (TP -> **EP** -> FP8 -> AC -> compile -> FSDP2, see
:mod:`kempnerforge.parallel.order`): after TP, which shards the experts' hidden channels and leaves dim 0
whole, and before FP8, whose filter must still see the expert Linears by FQN to skip them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from kempnerforge.parallel.contract import is_moe_layer
from kempnerforge.parallel.order import record_step


def moe_layers(model: nn.Module) -> list[str]:
    """FQNs of the modules that declare themselves MoE layers (attribute ``is_moe = True``)."""
    return [name for name, m in model.named_modules() if is_moe_layer(m)]


def validate_ep(ep: int, num_experts: int) -> None:
    """Check the EP degree against the model before anything is allocated.

    Raises:
        ValueError: ``ep > 1`` for a dense model (``num_experts == 0``), or ``num_experts`` not
            divisible by ``ep`` (every rank holds the same number of experts).
    """
    if ep > 1 and num_experts == 0:
        raise ValueError(f"ep={ep} needs MoE layers (ModelConfig.num_experts > 0); use ep=1 for a dense model.")
    if ep > 1 and num_experts % ep:
        allowed = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"ModelConfig.num_experts={num_experts} must be divisible by ep={ep}; allowed ep: {allowed}")


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Expert-parallelize ``model`` in place over ``ep_mesh`` (the EP step of the chain).

    With ``ep_mesh`` of size 1 (or None) the experts stay whole on every rank and the step only
    records its place in the chain. Otherwise each MoE layer's ``experts.w1/w2/w3`` (num_experts, ...)
    become DTensors ``Shard(0)`` over ``ep_mesh`` (meta stays meta; ``init_weights`` later generates
    only this rank's experts, element by element from the sharding-invariant counter-based init), and
    ``experts.ep_group`` is set so the forward dispatches tokens with all-to-all. Weights TP has sharded
    (DTensors on the 1-D ``tp`` mesh) become DTensors on the 2-D ``(ep, tp)`` mesh with ``Shard(0)``
    prepended to their TP placement.

    Args:
        model: the model (meta or materialized), after TP.
        ep_mesh: 1-D expert-parallel mesh (``ParallelMesh.ep``), or None when ``ep == 1``.

    Raises:
        TransformOrderError: EP applied twice, or after FP8 / AC / compile / FSDP2.
        ValueError: ``ep_mesh`` has size > 1 but ``model`` has no MoE layer, or ``num_experts`` is
            not divisible by the mesh size.
    """
    record_step(model, "ep")
    ep = 1 if ep_mesh is None else ep_mesh.size()
    if ep == 1:
        return
    layers = [m for m in model.modules() if is_moe_layer(m)]
    if not layers:
        raise ValueError(f"ep={ep} needs MoE layers, but the model has none; use ep=1.")
    for moe in layers:
        experts = moe.experts
        validate_ep(ep, experts.num_experts)
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            mesh, placements, shard = ep_mesh, [Shard(0)], full.detach()
            if isinstance(full, DTensor):  # expert-TP (tp > 1): split dim 0 of this rank's TP shard
                mesh = _ep_tp_mesh(ep_mesh, full.device_mesh)
                placements, shard = [Shard(0), *full.placements], full.to_local().detach()
            rank = ep_mesh.get_local_rank()
            local = shard.chunk(ep, dim=0)[rank] if not shard.is_meta else _meta_chunk(shard, ep)
            dt = DTensor.from_local(
                local.contiguous(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        experts.ep_group = ep_mesh.get_group()
        experts.ep_size = ep


def _ep_tp_mesh(ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D ``(ep, tp)`` mesh of expert weights under EP and TP (both 1-D meshes of one world mesh)."""
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_ep: expert weights on a {tp_mesh.ndim}-D mesh {tp_mesh.mesh_dim_names}; expected 1-D tp."
        )
    # No public way to join two sub-meshes of one root in torch 2.13; FSDP2 joins its mesh to ours the same way.
    return DeviceMesh._concatenate([ep_mesh, tp_mesh])


def _meta_chunk(full: torch.Tensor, ep: int) -> torch.Tensor:
    return torch.empty((full.shape[0] // ep, *full.shape[1:]), dtype=full.dtype, device="meta")
