"""``KempnerStrategy``'s fault-tolerance steps: connect the group's torchft manager, hook the model, heal, commit.

Each function is one point of the strategy's life with ``fault_tolerance`` set
(:class:`~kempnerforge.resilience.ft_config.FaultTolerance`); the torchft side is
:class:`~kempnerforge.resilience.replica_groups.ReplicaGroups`, the state a healing group receives
:mod:`kempnerforge.resilience.heal_state`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from kempnerforge.resilience.auto_resume import AutoResume
from kempnerforge.resilience.ft_config import FaultTolerance
from kempnerforge.resilience.heal_state import (
    load_loop_position,
    load_model_shards,
    load_optimizer_shards,
    load_step_mid_step,
    loop_position,
    model_shards,
    optimizer_shards,
    sharded_tensors,
    train_sampler,
)

log = logging.getLogger(__name__)


def group_dir(ft: FaultTolerance) -> str:
    """The sub-folder of every checkpoint folder this group writes to and resumes from."""
    return f"replica_group_{ft.replica_group_id}"


def connect(strategy: Any) -> Any:
    """After the group's process group exists: a :class:`ReplicaGroups` on the group's rendezvous store."""
    from kempnerforge.resilience.replica_groups import ReplicaGroups

    env = strategy.cluster_environment
    return ReplicaGroups(
        strategy.fault_tolerance,
        group_rank=strategy.global_rank,
        group_size=strategy.world_size,
        store_addr=env.main_address,
        store_port=env.main_port,
        device_type=strategy.root_device.type,
    )


def attach(strategy: Any, trainer: Any) -> None:
    """After the model is wrapped and the optimizer built: hook the gradient shards, make the step's token count a
    sum over the groups, register what a healing peer receives, and move every checkpoint folder to the group's
    own sub-folder (the groups' loader and RNG states differ; each group resumes its own)."""
    groups, module = strategy.replica_groups, strategy.lightning_module
    groups.install_hooks(module.model)
    module._step_tokens.outer_reduce = groups.sum_across_groups
    tensors = sharded_tensors(module.model)
    mbs = int(getattr(trainer.datamodule, "micro_batch_size", 0) or 0) if trainer.datamodule is not None else 0

    def save() -> dict[str, Any]:
        return {
            "model": model_shards(tensors),
            "optimizers": [optimizer_shards(o) for o in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "loop": loop_position(trainer),
            "tokens_seen": int(module.tokens_seen),
        }

    def load(state: dict[str, Any]) -> None:
        load_model_shards(tensors, state["model"])
        for optimizer, sd in zip(trainer.optimizers, state["optimizers"], strict=True):
            load_optimizer_shards(optimizer, sd)
        for config, sd in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(sd)
        strategy._refresh_float8_scales()
        if groups.starting:
            load_loop_position(trainer, state["loop"], mbs or _loader_batch_size(trainer))
            module.tokens_seen = state["tokens_seen"]
            return
        # Mid-step (torchft applies the heal at should_commit): the sender's state is from this step's start.
        load_step_mid_step(trainer, state["loop"])
        module.tokens_seen = state["tokens_seen"] + module.last_step_tokens
        rank_zero_info(
            f"Replica group {groups.group_id}: behind the quorum's step {state['loop']['global_step']}; healed from a "
            "live group during the step."
        )

    groups.register_state("kempnerforge", load, save)
    sub = group_dir(strategy.fault_tolerance)
    for callback in trainer.callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is not None and Path(dirpath).name != sub:
            callback.dirpath = os.path.join(dirpath, sub)


def _loader_batch_size(trainer: Any) -> int:
    return int(train_sampler(trainer).loader_batch_size or 1)


def group_auto_resume(checkpoint_path: Any, ft: FaultTolerance) -> Any:
    """``--ckpt_path auto`` resumes from the group's own sub-folder (:func:`group_dir`); other paths as given."""
    if isinstance(checkpoint_path, AutoResume) and checkpoint_path.folder is not None:
        if checkpoint_path.folder.name != group_dir(ft):
            return AutoResume(checkpoint_path.folder / group_dir(ft))
    return checkpoint_path


def first_quorum(strategy: Any) -> None:
    """At ``on_train_start``: the manager's step count from the restored step, then the first quorum (a heal when
    this group is behind). Raises ValueError when the training loader has no resumable sampler."""
    trainer = strategy.lightning_module.trainer
    train_sampler(trainer)  # the heal hands over its position: refuse before any peer waits on us
    groups = strategy.replica_groups
    groups.set_step(trainer.global_step)
    if groups.heal_before_first_step():
        log.info(
            "Replica group %d healed from a live group: continuing at step %d.",
            strategy.fault_tolerance.replica_group_id,
            trainer.global_step,
        )


def commit(strategy: Any) -> bool:
    """After the backward: torchft's vote. A step that does not commit leaves the weights, the optimizer, the LR
    schedule (the module skips ``lr_scheduler_step``) and Lightning's step counter as they were: the counter counts
    committed steps, so every group stops at ``max_steps`` together; ``tokens_seen`` drops the step's tokens. Returns
    whether the step commits."""
    trainer = strategy.lightning_module.trainer
    strategy.replica_groups.sum_unhooked_gradients()
    if strategy.replica_groups.should_commit(trainer.global_step):
        return True
    # Lightning counts the step around the module's optimizer_step hook (ready before, completed after): take this
    # one back inside the hook, so the counter is unchanged once the hook returns.
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        tracker.ready -= 1
        tracker.completed -= 1
    module = strategy.lightning_module
    module.tokens_seen -= module.last_step_tokens  # not trained
    return False
