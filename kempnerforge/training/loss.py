"""Cross-entropy normalized by the number of target tokens in the global batch.

Averaging per-rank means and then averaging across ranks weights each rank equally, which is wrong
when ranks hold different numbers of target tokens (padding, ignore_index). Here the sum of token
losses is divided by the global token count, as in torchtitan and Megatron-LM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: Label value excluded from the loss (PyTorch / Hugging Face convention).
IGNORE_INDEX = -100


def global_token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over this rank's targets, divided by the global target count.

    Args:
        logits: ``(batch, seq, vocab)``, any float dtype (computed in fp32).
        labels: ``(batch, seq)`` int64; ``IGNORE_INDEX`` positions are excluded.
        group: the data-parallel process group (None: this process alone).

    Returns:
        ``(loss, global_mean, n_global)``: ``loss`` to backpropagate, scaled by the group size because
        FSDP2 / DDP average gradients over data-parallel ranks (so the summed gradient equals that of
        the global mean); ``global_mean`` the detached mean loss per target token over the whole
        global batch (nats); ``n_global`` the global number of target tokens.

    Raises:
        ValueError: ``logits`` and ``labels`` disagree in batch or sequence size.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree in (batch, seq).")
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    stats = torch.stack([loss_sum.detach(), (labels != IGNORE_INDEX).sum().to(loss_sum.dtype)])
    world = 1
    if group is not None:
        dist.all_reduce(stats, group=group)
        world = dist.get_world_size(group)
    n_global = stats[1].clamp(min=1)
    return loss_sum * (world / n_global), stats[0] / n_global, stats[1]
