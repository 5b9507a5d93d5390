"""Load sharded model and optimizer state from a DCP checkpoint into live (FSDP2 / DTensor) objects.

Uses ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``set_optimizer_state_dict``), so a checkpoint written under one mesh loads under another: DCP
reads each rank's slices from whatever shards hold them.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO

#: Optimizer state is saved flattened (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), as in
#: torchtitan: every key names one parameter, so ranks holding different parameters (pipeline stages)
#: never write conflicting ``param_groups`` lists, and a checkpoint loads under another pp degree.
#: No ``cpu_offload``: the state stays where it lives (views of the shards, no copy) and the checkpoint
#: IO copies it once to host memory (DCP's stager for async saves, DCP's writer for synchronous ones).
OPTIMIZER_SAVE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(model: nn.Module) -> dict:
    """The model's sharded state dict (DTensor shards on their device, sharing the parameters' storage)."""
    return get_model_state_dict(model)


def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (what ``trainer.optimizers`` may hold), else itself."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict:
    """The flattened, sharded optimizer state dict written to DCP (see :data:`OPTIMIZER_SAVE_OPTIONS`)."""
    optimizer = unwrap_optimizer(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=OPTIMIZER_SAVE_OPTIONS)


def fresh_start_meta() -> dict:
    """What ``strategy.load_checkpoint`` returns when there is nothing to resume: Lightning's restore then
    finds no loops, callbacks, optimizer or scheduler state, and the run starts at step 0."""
    import lightning

    return {"pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}


def load_model_and_optimizers(
    model: nn.Module, optimizers: list[Optimizer], path: Path, io: DCPCheckpointIO, strict: bool = True
) -> None:
    """Fill ``model`` (and ``optimizers``, if any) from checkpoint ``path`` in place; every rank calls it.

    Keys are those Lightning saved: ``state_dict`` for the module and ``optimizer_{i}`` per optimizer. One DCP
    load reads them all (one plan: each shard file is read front to back once, as torchtitan loads).

    Raises:
        RuntimeError: from DCP when a key is missing or a shape disagrees (``strict``), naming the key.
    """
    options = StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)
    optimizers = [unwrap_optimizer(optimizer) for optimizer in optimizers]
    state = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer, options=options)
    io.load_sharded(state, path)
    set_model_state_dict(model, state["state_dict"], options=options)
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=options)
