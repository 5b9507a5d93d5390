"""torchft's Manager for one replica group: quorum per step, gradient shards summed across groups, commit vote.

How a step runs with fault tolerance (torchft's protocol, https://github.com/pytorch/torchft, as torchtitan wires it
into FSDP2): :meth:`ReplicaGroups.start_step` asks the lighthouse for a quorum in the background while the forward
runs; the step's target-token count (:meth:`sum_across_groups`) and every FSDP unit's reduce-scattered gradient shard
(the all-reduce hook, :meth:`install_hooks`) are summed over the groups in the quorum; :meth:`should_commit` after the
backward tells whether every group's collectives succeeded (a group that died makes them fail: the step is dropped
everywhere and the next quorum goes on without it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import ReduceOp

from kempnerforge.resilience.ft_config import FaultTolerance


class ReplicaGroups:
    """One group's view of the replica groups (a ``torchft.Manager`` per rank, rank 0 hosting its server).

    Args:
        config: the strategy's :class:`~kempnerforge.resilience.ft_config.FaultTolerance`.
        group_rank: this rank in its group (the group's global rank).
        group_size: the group's world size.
        store_addr, store_port: the group's own TCPStore (the rendezvous store; the manager connects as a client).
        device_type: ``"cpu"`` (gloo across groups) or ``"cuda"`` (NCCL across groups).

    The Manager is built with ``init_sync=False``: every group initializes its weights from the same seed (and a
    resumed group from the same checkpoint), so step 0 needs no transfer; a group behind the others heals.
    """

    def __init__(
        self,
        config: FaultTolerance,
        group_rank: int,
        group_size: int,
        store_addr: str,
        store_port: int,
        device_type: str,
    ) -> None:
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.config = config
        self.group_id = config.replica_group_id
        timeout = timedelta(seconds=config.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.groups: tuple[int, ...] = ()  # the group ids of the last quorum (from the process group's configure)
        self._watch_configure(pg, group_size)
        self.manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replica_groups,
            use_async_quorum=True,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            rank=group_rank,
            world_size=group_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=config.lighthouse_address(),
            replica_id=f"replica_group_{config.replica_group_id}",
            init_sync=False,
        )
        self._first_quorum_done = False  # heal_before_first_step's quorum serves the first step too
        #: True while a heal before the first step is applied (else a heal is applied mid-step, at should_commit).
        self.starting = False
        self.committed: bool = True  # the last step's vote (the LR schedule and the step counter follow it)
        self._members: tuple[int, ...] | None = None  # groups in the last quorum this group logged
        self._quorum_id: int | None = None
        self._unhooked: list[torch.Tensor] = []  # parameters whose gradients no FSDP2 hook sums
        self.heal_seconds: float | None = None  # how long this group's last heal took (s)

    def _watch_configure(self, pg: Any, group_size: int) -> None:
        # torchft reconfigures the cross-group process group once per new quorum, with the members' global ranks
        # (group id * group size + group rank): the only place the quorum's membership is visible.
        configure = pg.configure

        def recording(*args: Any, **kwargs: Any) -> None:
            ranks = kwargs.get("global_ranks") or (args[7] if len(args) > 7 else None) or []
            self.groups = tuple(sorted(r // group_size for r in ranks))
            configure(*args, **kwargs)

        pg.configure = recording

    # -- state handed to a healing group -----------------------------------------------------------

    def register_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """What a live group sends a healing one under ``key`` (``save`` runs on the sender's quorum thread)."""
        self.manager.register_state_dict_fn(key, load, save)

    def set_step(self, step: int) -> None:
        """Start the manager's step count at ``step`` (a run resumed from a checkpoint at that optimizer step)."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": 0})

    def heal_before_first_step(self) -> bool:
        """The first quorum, run synchronously before the loader starts: a group behind the quorum's highest step
        receives and applies the live peer's state here, so its first batch is drawn at the peers' position.
        The same quorum serves this group's first step (no second quorum is asked for then). Returns whether it
        healed."""
        started = time.monotonic()
        self.manager.start_quorum()
        self.manager.wait_quorum()
        healed = bool(self.manager._healing)
        if healed:
            # torchft applies a pending heal at should_commit (async quorum) or right away (sync quorum); this is the
            # sync path's own sequence, run once, so the first batch already sees the healed state.
            self.starting = True
            try:
                self.manager._apply_pending_state_dict()
            finally:
                self.starting = False
            self.manager._healing = False
            self.heal_seconds = time.monotonic() - started
        self._first_quorum_done = True
        self._log_quorum(self.manager.current_step())
        return healed

    # -- per step ------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Ask for this step's quorum in the background (before the forward); the first step's came from
        :meth:`heal_before_first_step`."""
        if self._first_quorum_done:
            self._first_quorum_done = False
            return
        self.manager.start_quorum()

    def sum_across_groups(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the groups in the quorum (a group not taking part, e.g. while healing,
        adds zeros). Waits for the quorum and the collective. On a failed collective the tensor is left as is and
        the step will not commit."""
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def install_hooks(self, model: nn.Module) -> int:
        """Sum every FSDP2 unit's reduce-scattered gradient shard across the groups
        (``FSDPModule.set_all_reduce_hook``, as torchtitan does); returns the number of units hooked. A model left
        unwrapped (a one-rank group in fp32: FSDP2 has nothing to shard) has its gradients summed after the backward
        instead (:meth:`sum_unhooked_gradients`)."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_all_reduce_hook(self.sum_across_groups)
        self._unhooked = [] if units else [p for p in model.parameters() if p.requires_grad]
        return len(units)

    def sum_unhooked_gradients(self) -> None:
        """After the backward, for a model without FSDP2 units: every gradient summed across the groups (all the
        collectives issued, then awaited)."""
        works = [self.manager.allreduce(p.grad, reduce_op=ReduceOp.SUM) for p in self._unhooked if p.grad is not None]
        for work in works:
            work.wait()

    def should_commit(self, step: int) -> bool:
        """After the backward: whether every group in the quorum finished the step (torchft's vote); logs one line
        when it did not, and one line when the quorum changed."""
        self._log_quorum(step)  # the quorum was awaited by the step's collectives
        self.committed = bool(self.manager.should_commit())
        if not self.committed:
            rank_zero_warn(
                f"Replica group {self.group_id}: step {step} not committed (a group left the quorum mid-step or fewer "
                f"than min_replica_groups={self.config.min_replica_groups} took part); the step is dropped, weights, "
                "schedule and step counter unchanged."
            )
        return self.committed

    @property
    def participants(self) -> int:
        """Groups whose gradients this step summed (``train/replica_groups``)."""
        return self.manager.num_participants()

    def _log_quorum(self, step: int) -> None:
        # One line per new quorum (torchft numbers them): which groups left or joined, the steps committed before it,
        # and the heal.
        quorum_id, groups = self.manager._quorum_id, self.groups
        if quorum_id == self._quorum_id:
            return
        before, self._members, self._quorum_id = self._members, groups, quorum_id
        change = ""
        if before is not None:
            left, joined = sorted(set(before) - set(groups)), sorted(set(groups) - set(before))
            change = (f"; left: {left}" if left else "") + (f"; joined: {joined}" if joined else "")
            change = change or "; same groups, a member restarted"
        heal = ""
        if self.heal_seconds is not None and before is None:
            heal = f"; this group healed from a live group in {self.heal_seconds:.2f} s"
        rank_zero_info(
            f"Replica group {self.group_id}: quorum {quorum_id} at step {step}: groups "
            f"{list(groups)} of {self.config.num_replica_groups}{change}{heal}."
        )

    def shutdown(self) -> None:
        """Stop the manager server and the checkpoint transport (no wait: peers may be gone)."""
        self.manager.shutdown(wait=False)
