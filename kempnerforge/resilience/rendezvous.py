"""The world size a job's settings imply, and a rendezvous that gives up after a timeout saying who is missing.

``torch.distributed.init_process_group`` waits for the whole world with the collective timeout (30 min by
default in Lightning) and then reports a store error; a job whose settings promise more ranks than were
started (``num_nodes: 2`` on one machine) sits at ``MEMBER: 1/2`` that long. :func:`rendezvous` creates the
job's TCPStore itself (rank 0 hosts it, as ``env://`` does), counts the ranks that arrive and, after
``timeout_s``, raises :class:`~kempnerforge.errors.RendezvousTimeoutError` with the joined and expected counts
and the setting the count comes from (:func:`expected_world`). The store then serves ``init_process_group``
(``store=``), with the collective timeout from there on. torchrun's agent works the same way
(``--rdzv-conf join_timeout``, 600 s by default).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info

from kempnerforge.errors import RendezvousTimeoutError

log = logging.getLogger(__name__)

#: Seconds the ranks of a job wait for each other at the start (torchrun's default join timeout).
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class WorldSpec:
    """How many ranks a job expects, this process's rank, and which setting says so.

    Attributes:
        size: world size (processes).
        rank: this process's global rank.
        field: the setting that fixes the count (``trainer.num_nodes``, ``SLURM_NTASKS``, ``WORLD_SIZE``).
        source: how the count is made up, for messages (``trainer.num_nodes=2 x trainer.devices=1``).
        hint: what to change when ranks are missing.
    """

    size: int
    rank: int
    field: str
    source: str
    hint: str


def expected_world(strategy: Any) -> WorldSpec:
    """The world a Lightning parallel strategy will initialize, known before any process group exists.

    As ``ParallelStrategy.set_world_ranks`` and the cluster environments compute it: SLURM and torchrun
    fix the size in their variables (``SLURM_NTASKS``, ``WORLD_SIZE``); Lightning's own launcher multiplies
    ``trainer.num_nodes`` by the devices per node.
    """
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    env = strategy.cluster_environment
    nodes, devices = strategy.num_nodes, strategy.num_processes
    if isinstance(env, SLURMEnvironment):
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
        made_of = f" (SLURM_NNODES={os.environ.get('SLURM_NNODES', '?')} x SLURM_NTASKS_PER_NODE={per_node})"
        return WorldSpec(
            env.world_size(),
            env.global_rank(),
            "SLURM_NTASKS",
            f"SLURM_NTASKS={env.world_size()}" + (made_of if per_node else ""),
            "check that every task of the job step started (srun) and can reach the first node",
        )
    if isinstance(env, TorchElasticEnvironment):
        return WorldSpec(
            env.world_size(),
            env.global_rank(),
            "WORLD_SIZE",
            f"WORLD_SIZE={env.world_size()} (torchrun --nnodes x --nproc-per-node)",
            "start torchrun on every node with the same --rdzv-endpoint",
        )
    if isinstance(env, LightningEnvironment):
        field = "trainer.num_nodes" if nodes > 1 else "trainer.devices"
        return WorldSpec(
            nodes * devices,
            strategy.node_rank * devices + strategy.local_rank,
            field,
            f"trainer.num_nodes={nodes} x trainer.devices={devices}",
            "run the same command on each of the other nodes with NODE_RANK, MASTER_ADDR and MASTER_PORT set "
            "(or use srun / torchrun), or lower trainer.num_nodes / trainer.devices",
        )
    name = type(env).__name__
    return WorldSpec(env.world_size(), env.global_rank(), name, f"the {name} cluster environment", "start every rank")


def _key() -> str:
    # A torchrun restart reuses its agent's store: each restart counts again.
    return f"kempnerforge/rendezvous/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def rendezvous(
    host: str, port: int, world: WorldSpec, timeout_s: float, collective_timeout: timedelta | None = None
) -> dist.TCPStore:
    """Meet the other ranks of ``world`` at ``host:port`` within ``timeout_s``; return the job's store.

    Rank 0 hosts the store (unless a torchrun agent already does, ``TORCHELASTIC_USE_AGENT_STORE``). Every rank
    adds itself to a counter; the last one to arrive sets a flag, which the others check at growing intervals
    (up to 1 s: a few thousand small requests per second at 512 ranks, for the seconds a start takes).

    Args:
        host, port: the rendezvous address (``MASTER_ADDR`` / ``MASTER_PORT``).
        world: the expected world (:func:`expected_world`).
        timeout_s: seconds to wait for all ranks (> 0).
        collective_timeout: the store's timeout afterwards (gloo / NCCL set-up waits on it); None: 30 min.

    Returns:
        The ``TCPStore``, for ``init_process_group(store=...)``.

    Raises:
        RendezvousTimeoutError: not every rank arrived in time (joined / expected counts, ``world.source``), or
            this rank could not reach rank 0's store at all.
        ValueError: ``timeout_s`` <= 0.
    """
    if not timeout_s > 0:
        raise ValueError(f"rendezvous_timeout_s={timeout_s!r} must be > 0 seconds.")
    wait = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    is_master = world.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"{host}:{port}"
    setting = "trainer.strategy.init_args.rendezvous_timeout_s"
    if world.rank == 0:
        rank_zero_info(f"Rendezvous: waiting up to {timeout_s:g} s for {world.size} ranks at {where} ({world.source}).")
    try:
        store = dist.TCPStore(host, port, world.size, is_master, wait, wait_for_workers=False)
    except RuntimeError as err:  # DistNetworkError: rank 0's store never answered, or rank 0 cannot listen
        if is_master:
            raise RendezvousTimeoutError(
                "MASTER_PORT",
                f"rank 0 could not open the rendezvous at {where}: {str(err).splitlines()[0] if str(err) else err}; "
                "set MASTER_PORT to a free port (or leave it unset on one machine)",
                None,
                world.size,
            ) from err
        raise RendezvousTimeoutError(
            world.field,
            f"rank {world.rank} could not reach rank 0's rendezvous at {where} within {timeout_s:g} s ({setting}); "
            f"the world size {world.size} comes from {world.source}: {world.hint}. ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})",
            None,
            world.size,
        ) from err
    key = _key()
    if store.add(key, 1) == world.size:
        store.set(f"{key}/all", "1")
    elif not _wait_for(store, f"{key}/all", deadline):
        joined = _count(store, key)
        raise RendezvousTimeoutError(
            world.field,
            f"{'?' if joined is None else joined} of {world.size} ranks joined the rendezvous at {where} "
            f"within {timeout_s:g} s ({setting}); the world size {world.size} comes from {world.source}: "
            f"{world.hint}.",
            joined,
            world.size,
        )
    store.set_timeout(collective_timeout or timedelta(minutes=30))
    return store


def _wait_for(store: dist.TCPStore, key: str, deadline: float) -> bool:
    """Check ``key`` until it exists (True) or ``deadline`` passes (False). ``store.wait`` would do the same but
    logs socket time-outs from C++ when it gives up."""
    pause = 0.05
    while True:
        try:
            if store.check([key]):
                return True
        except RuntimeError:  # rank 0 (the store) is gone: it gave up first
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 1.0)


def _count(store: dist.TCPStore, key: str) -> int | None:
    try:
        return int(store.add(key, 0))
    except RuntimeError:  # rank 0 (the store) is gone
        return None
