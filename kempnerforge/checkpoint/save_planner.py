"""Where a checkpoint's replicated items are written, so that a restoring rank opens O(1) shard files.

DCP writes an item every rank holds (a replicated one) once, from the rank whose plan is smallest so far: the
flattened optimizer state's per-parameter ``param_groups`` values and AdamW ``step`` counters, norms replicated
over tensor parallelism, all a few bytes each, end up spread over every rank's shard file. Every rank reads all
of them back, so a restore at 512 ranks opens 512 shard files on every rank (262,144 opens of a parallel
filesystem) to read a few bytes from each.

:class:`SmallReplicasOnRankZero` writes the small replicated items (under :data:`SMALL` bytes) from rank 0,
beside its own shards, so a restoring rank reads its own shard file and rank 0's. Large replicated chunks (a
shard that HSDP's replicas all hold) are still spread by DCP's own balancing, so every replica writes its part.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from typing_extensions import override

#: Replicated items below this many bytes (and every non-tensor item) are written by rank 0.
SMALL = 1 << 20


class SmallReplicasOnRankZero(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose small replicated items are written by the lowest rank holding them (rank 0
    for state every rank holds); everything else as DCP plans it."""

    @override
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        return super().create_global_plan(small_replicas_to_lowest_rank(all_plans))


def small_replicas_to_lowest_rank(plans: list[SavePlan]) -> list[SavePlan]:
    """``plans`` (one per rank) with every replicated item under :data:`SMALL` bytes, or not a tensor, kept only on
    the lowest rank that holds it; DCP's dedup then finds them on one plan and leaves them there.

    Args:
        plans: every rank's local save plan (what the coordinator gathers).
    """
    holders: dict[Any, list[int]] = defaultdict(list)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
    keep: list[set[Any]] = [set() for _ in plans]
    for rank, plan in enumerate(plans):
        for item in plan.items:
            small = item.type == WriteItemType.BYTE_IO or (item.tensor_storage_size() or 0) < SMALL
            if not small or len(holders[item.index]) == 1 or holders[item.index][0] == rank:
                keep[rank].add(item.index)
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if item.index in keep[rank]])
        for rank, plan in enumerate(plans)
    ]
