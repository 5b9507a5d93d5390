"""Token dispatch and combine for expert parallelism: two uneven ``all_to_all_single`` per MoE layer.

Follows torchtitan v0.2 (``torchtitan/distributed/expert_parallel.py``): each rank routes its own tokens;
rows sorted by global expert id are sent to the rank that owns the expert, run through the local
experts, and sent back in the same order. ``torch.distributed._functional_collectives.
all_to_all_single_autograd`` carries the gradients (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# No public autograd-aware, compile-traceable all-to-all with uneven splits in torch 2.13 (torchtitan uses this one).
from torch.distributed._functional_collectives import all_to_all_single_autograd

#: ``kforge estimate`` sets this while it simulates a step on fake tensors, which hold no counts to read back:
#: ``hook(x, n) -> (send_splits, recv_splits)`` gives the rows of ``x`` per group (EP rank here, expert in
#: :func:`kempnerforge.model.moe.grouped_mm`'s loop) under the routing it assumes
#: (:func:`kempnerforge.estimate.fake_ops.balanced_routing`). None (always, in training): the counts are read.
SPLITS_HOOK: Callable[[torch.Tensor, int], tuple[list[int], list[int]]] | None = None


def dispatch_combine(
    x: torch.Tensor,
    counts: torch.Tensor,
    group: dist.ProcessGroup,
    ep: int,
    local_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Run rows of ``x`` through experts spread over the ``ep`` ranks of ``group``.

    Rank r owns global experts ``[r * E_local, (r + 1) * E_local)``. Ranks with no tokens for some
    (or all) of a rank's experts send zero rows; every rank still joins both collectives, so nothing
    deadlocks.

    Args:
        x: (rows, dim) this rank's assignments, sorted by global expert id.
        counts: (num_experts,) int64 rows per global expert, summing to at most ``rows``; the rows
            after them (capacity-dropped assignments) are not sent and come back as zeros.
        group: the expert-parallel process group (size ``ep``).
        ep: expert-parallel degree; ``num_experts % ep == 0``.
        local_fn: ``(rows_local, dim), (E_local,) counts -> (rows_local, dim)``: the local experts on
            rows sorted by local expert id.

    Returns:
        (rows, dim): each row's expert output, in the order of ``x``.
    """
    e_local = counts.numel() // ep
    # How many rows every source rank sends to each of my local experts: (ep * E_local,) laid out (src, e).
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_by_src = recv_counts.view(ep, e_local)
    if SPLITS_HOOK is not None:  # kforge estimate: fake counts have no values to read back
        send_splits, recv_splits = SPLITS_HOOK(x, ep)
    else:
        # The host sync EP needs by nature: all_to_all takes its split sizes as host integers. Sent and
        # received sizes are read in one copy (one sync per MoE layer forward, and per recomputation).
        splits = torch.cat([counts.view(ep, e_local).sum(1), recv_by_src.sum(1)]).tolist()
        send_splits, recv_splits = splits[:ep], splits[ep:]
    rows, kept = x.shape[0], sum(send_splits)  # rows after the counted ones (capacity-dropped) stay home
    received = all_to_all_single_autograd(x[:kept], recv_splits, send_splits, group)
    # Received rows are blocks (src, local expert); the grouped GEMM wants them grouped by local expert.
    block_sizes = recv_by_src.flatten()
    block_id = torch.repeat_interleave(
        torch.arange(block_sizes.numel(), device=x.device), block_sizes, output_size=sum(recv_splits)
    )
    expert_of_row = block_id % e_local
    perm = torch.argsort(expert_of_row * ep + block_id // e_local, stable=True)
    out_local = local_fn(received[perm], recv_by_src.sum(0))
    back = torch.empty_like(out_local).index_copy(0, perm, out_local)
    out = all_to_all_single_autograd(back, send_splits, recv_splits, group)
    if torch.compiler.is_compiling():
        # Traced, kept is an unbacked symbol (see kempnerforge.parallel.compile): no branch on it.
        torch._check(kept <= rows)
        return torch.cat([out, out.new_zeros(rows - kept, out.shape[1])])
    return out if kept == rows else torch.cat([out, out.new_zeros(rows - kept, out.shape[1])])


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward.

    Expert weights on an EP group of size ``ep`` receive gradients from the tokens of all ``ep``
    ranks, while FSDP averages only over the remaining ``dp_shard / ep`` replicas; scaling by
    ``1 / ep`` makes the expert gradients the same global mean the dense parameters get.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
