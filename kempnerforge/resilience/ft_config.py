"""The ``fault_tolerance`` option of ``KempnerStrategy``: replica groups managed by torchft, and its validation.

Imports nothing heavy (no torch, no torchft): the checks run before any process group exists.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from kempnerforge.errors import UserError

#: Where the lighthouse address comes from when ``lighthouse`` is not set (torchft's own variable).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
FIELD = "trainer.strategy.init_args.fault_tolerance"


@dataclass(frozen=True)
class FaultTolerance:
    """Replica-group fault tolerance (torchft, https://github.com/pytorch/torchft; torchtitan's ``--fault_tolerance``).

    The job is ``num_replica_groups`` copies of one training run, each an ordinary FSDP2 (x TP x CP ...) job with its
    own world, rendezvous port and ``dp_replicate=1`` mesh. torchft's lighthouse forms a quorum of the groups alive at
    every step; each group's gradient shards are summed over the quorum (rank ``r`` of every group holds the same shard),
    the step commits only when the quorum agrees, and a group that (re)joins is healed from a live peer over HTTP
    (model and optimizer shards, LR schedule, loop counters, data position) before its first step.

    Args:
        replica_group_id: this group's id, ``0 <= id < num_replica_groups`` (``$SLURM_PROCID``-like: one per job step).
        num_replica_groups: the groups the job was launched with (>= 1); each reads its own data shards
            (group ``g``, data-parallel rank ``d`` of ``D`` reads shard ``g * D + d`` of ``num_replica_groups * D``).
        min_replica_groups: the fewest groups a step may commit with (1 <= min <= num); with fewer alive the
            groups wait (their steps do not commit, the step counter does not move).
        lighthouse: ``http://host:port`` of the lighthouse (``kforge lighthouse``); None: ``$TORCHFT_LIGHTHOUSE``.
        timeout_s: seconds for a cross-group collective, a commit vote or a heal transfer (> 0).
        quorum_timeout_s: seconds a group waits for a quorum (> 0; longer than a step).

    Raises (from :func:`check_fault_tolerance`):
        UserError: a field outside the ranges above, or no lighthouse address.
    """

    replica_group_id: int = 0
    num_replica_groups: int = 2
    min_replica_groups: int = 1
    lighthouse: str | None = None
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0

    def lighthouse_address(self) -> str | None:
        """``lighthouse``, else ``$TORCHFT_LIGHTHOUSE`` (None when neither is set)."""
        return self.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None


def check_fault_tolerance(ft: FaultTolerance | None, degrees: dict[str, int]) -> None:
    """Every rule that needs neither a process group nor the module (the strategy's constructor runs it).

    Args:
        ft: the option (None: off, nothing to check).
        degrees: the strategy's mesh degrees (``dp_replicate``, ``pp``, ...).

    Raises:
        UserError: one line naming the field and what is allowed.
    """
    if ft is None:
        return
    if not isinstance(ft, FaultTolerance):
        raise UserError(FIELD, f"expected a FaultTolerance mapping, got {type(ft).__name__}")
    if importlib.util.find_spec("torchft") is None:
        raise UserError(FIELD, "needs torchft: pip install 'kempnerforge[ft]'")
    n = ft.num_replica_groups
    if not isinstance(n, int) or n < 1:
        raise UserError(f"{FIELD}.num_replica_groups", f"an int >= 1, got {n!r}")
    if not isinstance(ft.replica_group_id, int) or not 0 <= ft.replica_group_id < n:
        raise UserError(f"{FIELD}.replica_group_id", f"an int in [0, {n}), got {ft.replica_group_id!r}")
    if not isinstance(ft.min_replica_groups, int) or not 1 <= ft.min_replica_groups <= n:
        raise UserError(f"{FIELD}.min_replica_groups", f"an int in [1, {n}], got {ft.min_replica_groups!r}")
    for name in ("timeout_s", "quorum_timeout_s"):
        value = getattr(ft, name)
        if not isinstance(value, int | float) or not value > 0:
            raise UserError(f"{FIELD}.{name}", f"a number of seconds > 0, got {value!r}")
    address = ft.lighthouse_address()
    if not address or not address.startswith(("http://", "https://")):
        raise UserError(
            f"{FIELD}.lighthouse", f"the lighthouse's http://host:port (or ${LIGHTHOUSE_ENV}), got {address!r}"
        )
    if degrees.get("dp_replicate", 1) != 1:
        raise UserError(
            "trainer.strategy.init_args.dp_replicate",
            "1 with fault_tolerance (the replica groups are the replicate axis; torchft manages it)",
        )
    if degrees.get("pp", 1) != 1:
        raise UserError("trainer.strategy.init_args.pp", "1 with fault_tolerance (not built for pipeline stages yet)")


def check_fault_tolerance_run(ft: FaultTolerance | None, module: object, datamodule: object) -> None:
    """The rules that need the module and the data (``check_layout`` runs them before the rendezvous).

    Raises:
        UserError: an MoE model (its router-bias statistics are reduced within a group only, so the groups' weights
            would drift apart), or a datamodule whose loader position cannot be handed to a healing group.
    """
    if ft is None:
        return
    config = getattr(module, "config", None)
    if getattr(config, "num_experts", 0):
        raise UserError(
            "model.config.num_experts",
            "0 with fault_tolerance (MoE load statistics are reduced within a replica group only)",
        )
    from kempnerforge.data.datamodule import ResumableLoaders

    if datamodule is not None and not isinstance(datamodule, ResumableLoaders):
        raise UserError(
            "data",
            f"a datamodule built on ResumableLoaders with fault_tolerance (a healing group takes over the "
            f"sampler position), got {type(datamodule).__name__}",
        )


def check_accumulation_ft(ft: FaultTolerance | None, accumulate_grad_batches: int) -> None:
    """Raises UserError: ``trainer.accumulate_grad_batches`` > 1 with fault tolerance (a step's commit vote and its
    heal are per optimizer step; accumulation across a quorum change is not built)."""
    if ft is not None and accumulate_grad_batches != 1:
        raise UserError("trainer.accumulate_grad_batches", "1 with fault_tolerance")
