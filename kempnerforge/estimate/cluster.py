"""A simulated cluster in one process: torch's fake process group plus a Lightning cluster environment.

``torch.testing._internal.distributed.fake_pg`` registers the ``"fake"`` backend: a process group of any
size whose collectives return at once without moving data (torchtitan's memory estimator and torch's
own FSDP tests use it), so a DeviceMesh of 512 ranks, its sub-groups, FSDP2's all-gathers and TP's
all-reduces all run here with the shapes and groups of the real cluster. Values are never exchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only
from torch.testing._internal.distributed.fake_pg import FakeStore
from typing_extensions import override


class SimulatedEnvironment(LightningEnvironment):
    """The Lightning cluster environment of one rank of ``num_nodes x devices_per_node`` processes.

    Lightning's strategy derives its global rank as ``node_rank * devices + local_rank``; this environment
    answers as rank ``rank`` of that cluster would, without any process being launched.

    Args:
        num_nodes: nodes of the simulated cluster.
        devices_per_node: processes (GPUs) per node.
        rank: the global rank this process plays.

    Raises:
        ValueError: a count < 1 or ``rank`` outside ``[0, num_nodes * devices_per_node)``.
    """

    def __init__(self, num_nodes: int, devices_per_node: int, rank: int) -> None:
        super().__init__()
        if num_nodes < 1 or devices_per_node < 1:
            raise ValueError(f"num_nodes={num_nodes} and devices_per_node={devices_per_node} must be >= 1.")
        if not 0 <= rank < num_nodes * devices_per_node:
            raise ValueError(f"rank={rank} must be in [0, {num_nodes * devices_per_node}).")
        self._devices = devices_per_node
        self._rank = rank
        self._world_size = num_nodes * devices_per_node
        self._global_rank = rank

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """True: Lightning must not launch processes for the simulated ranks."""
        return True

    @override
    def local_rank(self) -> int:
        """Rank within the node: ``rank % devices_per_node``."""
        return self._rank % self._devices

    @override
    def node_rank(self) -> int:
        """Node index: ``rank // devices_per_node``."""
        return self._rank // self._devices


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans.

    Those caches are keyed by DeviceMesh equality, which compares the ranks' layout and axis names but not
    the process groups: after one simulated world is destroyed, the next world's mesh (same shape) would hit
    entries holding the old mesh and run collectives on its destroyed groups.
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """Initialize a fake default process group of ``world_size`` ranks as ``rank``; destroy it on exit.

    Lightning's ``rank_zero_only.rank`` (which Lightning sets from the strategy's global rank) and
    ``sys.excepthook`` (which ``init_process_group`` wraps with a rank prefix) are restored on exit too, and DTensor's mesh-keyed caches are cleared on entry and exit (:func:`clear_dtensor_caches`),
    so code that runs after an estimate in the same process is unaffected.

    Raises:
        RuntimeError: a process group is already initialized in this process (the simulation needs its own).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "kforge estimate needs its own (fake) process group, but one is already initialized in this process; "
            "run the estimate in a fresh process or destroy the group first."
        )
    saved = getattr(rank_zero_only, "rank", 0), sys.excepthook  # init_process_group chains a "[rankN]:" hook
    clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        clear_dtensor_caches()
        rank_zero_only.rank, sys.excepthook = saved
