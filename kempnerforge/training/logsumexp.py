"""Log-sum-exp over a vocabulary split across tensor-parallel ranks, without gathering the logits.

``torch.logsumexp`` on vocab-sharded DTensor logits (``Shard(-1)``, loss parallel) makes DTensor all-gather the
whole ``(tokens, vocab)`` fp32 logits first: at 8,192 tokens and a 128k vocabulary 4.2 GB per rank per step,
received and held until the backward. Here each rank reduces its own vocabulary shard to a row max and a row
sum of ``exp(x - max)`` and two all-reduces of ``tokens`` floats (MAX, then SUM) over the tensor-parallel group
finish the reduction, as the vocab-parallel cross-entropy does (Megatron-LM, Shoeybi et al., arXiv:1909.08053
sec. 3; torch's ``loss_parallel`` log-softmax).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


class _VocabParallelLogSumExp(torch.autograd.Function):
    """Forward: the row max and sum-of-exp of the local shard, reduced over ``group``; backward:
    ``d lse / d x = exp(x - lse)`` on the local shard, with no communication (``lse`` is already global)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # fp32 math (fp64 for fp64 logits): ``logits - row_max`` promotes a bf16 shard into one fresh fp32 block.
        # The max of a row is one of its values (exact in fp32); any shift gives the same lse, the global max
        # keeps every exp() <= 1.
        row_max = logits.amax(dim=-1).to(torch.promote_types(logits.dtype, torch.float32))
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (logits - row_max.unsqueeze(-1)).exp_().sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        lse = row_max + sum_exp.log()
        # The input in its own dtype (bf16 under a mixed-precision policy: half an fp32 copy); the
        # backward recomputes the same fp32 exp() from it.
        ctx.save_for_backward(logits, lse)
        return lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lse: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, lse = ctx.saved_tensors
        grad = (logits - lse.unsqueeze(-1)).exp_().mul_(grad_lse.unsqueeze(-1))
        return grad.to(logits.dtype), None


def _sharded_vocab_group(logits: DTensor) -> dist.ProcessGroup | None:
    """The process group of the mesh dim that shards the last (vocab) dim of ``logits`` (None: replicated)."""
    vocab_dim = logits.ndim - 1
    group = None
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim in (-1, vocab_dim) and group is None:
            group = logits.device_mesh.get_group(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"vocab_parallel_logsumexp needs logits sharded on the vocab dim on one mesh dim and replicated "
                f"elsewhere; got placements {logits.placements}."
            )
    return group


def vocab_parallel_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits, dim=-1)`` in fp32 (fp64 for fp64 logits; differentiable); on vocab-sharded DTensor logits computed from each
    rank's shard with two all-reduces of ``logits.shape[:-1]`` fp32 values, never gathering the logits.

    Memory: one fp32 temporary the size of the local shard in the forward and one in the backward; the input is
    kept for the backward in its own dtype (the plain path of ``torch.logsumexp(logits.float())`` keeps an fp32
    copy, the DTensor path a gathered ``(..., vocab)`` fp32 copy).

    Args:
        logits: ``(..., vocab)`` plain tensor of any float dtype, or a DTensor sharded ``Shard(-1)`` over
            one mesh dim (tensor parallel with loss parallel: local ``(..., vocab / tp)``) and replicated over
            any other.

    Returns:
        ``(...)`` fp32 (fp64) plain tensor, equal on every rank of the sharding group.

    Raises:
        ValueError: a DTensor sharded on another dim, or on the vocab over more than one mesh dim.
    """
    if isinstance(logits, DTensor):
        group = _sharded_vocab_group(logits)
        return _VocabParallelLogSumExp.apply(logits.to_local(), group)
    return _VocabParallelLogSumExp.apply(logits, None)
