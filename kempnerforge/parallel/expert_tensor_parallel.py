"""Tensor parallelism inside MoE layers: routed experts sharded by expert-TP, the router replicated.

The layout (torchtitan's expert-TP, ``TensorParallel`` / ``ExpertTensorParallel`` in
``torchtitan/distributed/expert_parallel.py``; Megatron-LM's MLP split, arXiv:1909.08053 sec. 3, applied per
expert): every TP rank routes the same tokens with the same replicated router, and every routed expert's SwiGLU is
split along its hidden channels like the dense feed-forward: ``w1`` / ``w3`` (num_experts, hidden, dim) are
``Shard(1)`` (column-wise), ``w2`` (num_experts, dim, hidden) is ``Shard(2)`` (row-wise). Each rank computes a
partial sum of every expert's output; the MoE layer's output (routed + shared experts, both partial) is reduced
once over TP at the layer boundary, as the dense feed-forward's: an all-reduce, or a reduce-scatter with sequence
parallel. With expert parallelism the experts' dim 0 is further split over ``ep``
(:func:`kempnerforge.parallel.expert_parallel.apply_ep`): the weights are DTensors on the 2-D ``(ep, tp)`` mesh,
``(Shard(0), Shard(1 | 2))``, and each TP rank's all-to-all runs inside its own EP group (the ranks with the same
TP coordinate), carrying the same tokens the other TP ranks carry.

Why this layout rather than torchtitan's default EP-over-TP one ("ETP = 1": experts whole on each rank, the tokens
split over the TP ranks before dispatch, ``ep`` borrowing the TP ranks): it needs no change to the mesh (``ep``
borrows ranks from ``dp_shard`` only, :mod:`kempnerforge.parallel.mesh`), it works for ``ep = 1`` without
replicating expert weights (and their gradient all-reduce) over TP, every parameter keeps one DTensor layout FSDP2
and DCP understand (``(dp_shard_mod_ep, ep, tp)``), and the routing, capacity and counts stay identical on every TP
rank, so nothing about them changes. Its cost: each TP rank sends every token through the EP all-to-all (``tp``
times the bytes of ETP = 1), and the expert GEMMs are ``hidden / tp`` wide.

Gradients. Inside the layer the tokens and the router are replicated over TP, the expert outputs partial. Three
tensors therefore get Megatron's "f" operator (identity forward, all-reduce of the gradient backward,
:func:`grad_all_reduce`): the tokens entering the routed experts (each rank's hidden slice contributes part of
their gradient), the gate weights ``(assignments,)`` (their gradient is a dot product with the partial expert
output) and the shared-expert gate ``(tokens, 1)``. The shared experts' own input gradient is reduced by DTensor
(``ColwiseParallel``). The router's weight and the tokens' router gradient come out whole and identical on every
TP rank, as a replicated parameter's must.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

#: Tensor dim of each packed expert weight that expert-TP shards: hidden channels (w1/w3 column-wise, w2 row-wise).
EXPERT_TP_DIMS: dict[str, int] = {"w1": 1, "w2": 2, "w3": 1}


def grad_all_reduce(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Megatron's "f" operator on a tensor replicated over ``tp_mesh``: ``x`` itself forward, its gradient summed
    over the TP ranks backward (each holds a partial gradient).

    Built from DTensor's own autograd rules (a ``Replicate`` view whose local gradient is declared ``Partial``),
    so it needs no custom collective. Shapes: any; returns a plain tensor shaped like ``x``.
    """
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ExpertTensorParallel(ParallelStyle):
    """The parallel style of a :class:`~kempnerforge.model.moe.GroupedExperts` bank: expert-TP (module docstring).

    Shards ``w1`` / ``w3`` (num_experts, hidden, dim) as ``Shard(1)`` and ``w2`` (num_experts, dim, hidden) as
    ``Shard(2)`` over the 1-D TP mesh (meta stays meta) and sets ``module.tp_mesh``, which makes the MoE layer use
    the local shards and :func:`grad_all_reduce` (see :meth:`kempnerforge.model.moe.MoE.forward`). The module's
    forward then maps ``(rows, dim)`` replicated rows to ``(rows, dim)`` partial sums over TP.

    Source: torchtitan ``TensorParallel`` (``torchtitan/distributed/expert_parallel.py``).

    Raises:
        TypeError: the module has no packed ``w1`` / ``w2`` / ``w3`` (it is not an expert bank).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in EXPERT_TP_DIMS.items():
            weight = getattr(module, name, None)
            if not isinstance(weight, nn.Parameter) or weight.ndim != 3:
                raise TypeError(f"ExpertTensorParallel needs packed (num_experts, ., .) {name}; got {type(module)}.")
            sharded = distribute_tensor(weight.data, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            setattr(module, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        module.tp_mesh = device_mesh
        return module
