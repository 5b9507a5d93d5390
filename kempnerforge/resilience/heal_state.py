"""What a live replica group hands a healing one: this rank's local shards and the loop's position.

Rank ``r`` of a healing group receives from rank ``r`` of a live group (torchft's HTTP transport, ``torch.save``
format): every group has the same mesh, so the shards match one to one and only local tensors travel (a DTensor
would pickle its mesh). Nothing here does a collective; the sender's functions run on torchft's quorum thread while
its main thread waits for that quorum, so the state is the one at the start of the step both groups then run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sendable(t: torch.Tensor) -> torch.Tensor:
    # torchft's streaming save writes a tensor's whole storage and drops the view (FSDP2's local shard is a view of a
    # padded buffer): a view is copied (a CUDA tensor is copied to the host by the transport anyway).
    t = _local(t)
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def sharded_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by FQN (buffers prefixed ``buffer:``), taken while the model is sharded
    (after setup): FSDP2 swaps a unit's registered parameters for unsharded tensors during its forward and backward,
    and the sender's state is read on torchft's quorum thread while its forward runs, so the sharded parameter objects
    (the ones the optimizer holds) are kept from here."""
    out = dict(model.named_parameters())
    out.update({f"buffer:{name}": b for name, b in model.named_buffers()})
    return out


def model_shards(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's local shard of every tensor of :func:`sharded_tensors` (no copy unless the shard is a view of a
    larger buffer: the transport serializes them before the sender's next optimizer step, see the module docstring)."""
    return {name: _sendable(t.detach()) for name, t in tensors.items()}


@torch.no_grad()
def load_model_shards(tensors: dict[str, torch.Tensor], shards: dict[str, torch.Tensor]) -> None:
    """Copy :func:`model_shards` of a peer into the local shards of :func:`sharded_tensors` in place.

    Raises:
        KeyError: a parameter or buffer the peer did not send (the groups' models differ).
        RuntimeError: a shard of another shape (the groups' layouts differ), naming the tensor.
    """
    for name, tensor in tensors.items():
        local, received = _local(tensor), shards[name]
        if received.shape != local.shape:
            raise RuntimeError(
                f"{name}: received shard {tuple(received.shape)}, this rank holds {tuple(local.shape)}: the replica "
                "groups' layouts differ (every group must have the same mesh and degrees)."
            )
        local.copy_(received)


def optimizer_shards(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor state (moments) replaced by its local shard."""
    sd = optimizer.state_dict()
    state = {
        idx: {k: _sendable(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for idx, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_shards(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load :func:`optimizer_shards` of a peer: each local moment becomes a DTensor laid out like its parameter
    (same mesh and placements), then ``optimizer.load_state_dict``. Works on an optimizer that has not stepped yet."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, s in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: _like(v, p) if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.dim() > 0 else v
            for k, v in s.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _like(local: torch.Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(
        local.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def loop_position(trainer: Any) -> dict[str, int]:
    """The sender's position at the start of the step it is running: optimizer steps committed, batches completed
    (in total and in this epoch), the epoch, and the training sampler's epoch (ints only)."""
    loop = trainer.fit_loop.epoch_loop
    batches = loop.batch_progress
    sampler = train_sampler(trainer)
    return {
        "global_step": int(loop.automatic_optimization.optim_progress.optimizer.step.total.completed),
        "batches_total": int(batches.total.completed),
        "batches_epoch": int(batches.current.completed),
        "batches_that_stepped": int(loop._batches_that_stepped),
        "epoch": int(trainer.fit_loop.epoch_progress.current.completed),
        "sampler_epoch": int(sampler.epoch),
    }


def load_loop_position(trainer: Any, pos: dict[str, int], micro_batch_size: int) -> None:
    """Set this group's loop counters to the sender's and its sampler to the same position in this group's own shard,
    before the training loader starts (a loader state Lightning restored from a checkpoint is dropped: the peer's
    position is newer). Each counter is set as Lightning's own restore leaves it (ready = started = completed)."""
    loop = trainer.fit_loop.epoch_loop
    step = loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        tracker.ready = tracker.completed = pos["global_step"]
    for tracker, value in (
        (loop.batch_progress.total, pos["batches_total"]),
        (loop.batch_progress.current, pos["batches_epoch"]),
    ):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = value
    loop._batches_that_stepped = pos["batches_that_stepped"]
    for tracker in (trainer.fit_loop.epoch_progress.total, trainer.fit_loop.epoch_progress.current):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = pos["epoch"]
    loader = train_loader(trainer)
    loader.next_iter_state = None
    loader.sampler.load_state_dict({"yielded": pos["batches_epoch"] * micro_batch_size, "epoch": pos["sampler_epoch"]})


def load_step_mid_step(trainer: Any, pos: dict[str, int]) -> None:
    """A heal applied at ``should_commit`` (a live group whose last vote failed while the others committed): only the
    optimizer-step counter moves to the sender's (the data and batch counters are already the others': the group ran
    every step with them). Set as Lightning's loop expects inside the optimizer-step hook (this step counted ready,
    not yet completed)."""
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        tracker.completed = pos["global_step"]
        tracker.ready = pos["global_step"] + 1


def train_loader(trainer: Any) -> Any:
    """The fit loop's one training loader.

    Raises:
        ValueError: several training loaders (fault tolerance hands over one sampler position).
    """
    loaders = trainer.fit_loop._combined_loader.flattened
    if len(loaders) != 1:
        raise ValueError(f"fault_tolerance needs exactly one training loader, got {len(loaders)}.")
    return loaders[0]


def train_sampler(trainer: Any) -> Any:
    """The training loader's :class:`~kempnerforge.data.datamodule.ResumableDistributedSampler`.

    Raises:
        ValueError: the loader has another sampler.
    """
    from kempnerforge.data.datamodule import ResumableDistributedSampler

    sampler = getattr(train_loader(trainer), "sampler", None)
    if not isinstance(sampler, ResumableDistributedSampler):
        raise ValueError(f"fault_tolerance needs a ResumableDistributedSampler, got {type(sampler).__name__}.")
    return sampler
