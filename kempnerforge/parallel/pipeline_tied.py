"""Tied embeddings under pipeline parallelism: one logical weight held by the first and the last stage.

The embedding lives on the first stage, the output head on the last. As in Megatron-LM (its
"embedding group" of the first and last pipeline rank), the last stage holds its own copy of the
weight: the pruned model keeps ``tok_embeddings`` next to the head there, so the copy has the
embedding's canonical FQN (``tok_embeddings.weight``), is initialized by the same per-FQN counter
(:mod:`kempnerforge.model.init`: identical values, no broadcast), follows the embedding's optimizer
rule (no weight decay), and is written once by DCP (both ranks save the same key and shards; DCP keeps
one). Once per optimizer step the two gradients are summed over the first/last group
(:func:`reduce_tied_grads`), so both copies take the same update and stay identical; the gradient norm
counts the weight once (the last stage's copy is left out of it, :meth:`PipelineRunner.norm_skip`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def tied_embedding_group(world: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of the first and the last ``pp`` rank of this rank's pipeline, or None on a middle
    pp rank. Every rank must call it (new groups are created collectively, in the same order everywhere).

    Args:
        world: the world mesh with ``pp`` as its outermost dim (``ParallelMesh.world``).
    """
    ranks = world.mesh
    pp = ranks.shape[0]
    if pp == 2:  # the first/last pair is the pp group itself
        return world["pp"].get_group()
    me, mine = dist.get_rank(), None
    columns = ranks.reshape(pp, -1)
    for j in range(columns.shape[1]):
        pair = [int(columns[0, j]), int(columns[-1, j])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


@torch.no_grad()
def reduce_tied_grads(weight: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``weight.grad`` (this stage's copy of the tied embedding) with the other stage's, in place.

    Both copies have the same global shape and sharding (FSDP2 / TP over identical sub-meshes on the
    first and last pp rank), so their local shards line up element for element and are all-reduced
    as plain tensors. A missing gradient counts as zeros (the other rank still takes part).

    Args:
        weight: ``tok_embeddings.weight`` of this rank (plain tensor or DTensor), ``(vocab_size, dim)``.
        group: :func:`tied_embedding_group`.
    """
    grad = weight.grad
    if grad is None:
        grad = torch.zeros_like(weight)
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local = local.contiguous()
    dist.all_reduce(local, group=group)
    if isinstance(grad, DTensor):
        grad = DTensor.from_local(local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride())
    else:
        grad = local
    weight.grad = grad
