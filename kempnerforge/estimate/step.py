"""One simulated training step of one rank: the module's own forward / loss / backward, clipping, optimizer.

The step is what Lightning's automatic optimization runs for one micro-batch of a steady-state step:
``training_step`` (the module's loss path; with ``pp > 1`` the strategy's pipeline schedule, simulated by
:class:`~kempnerforge.estimate.pipeline_sim.SimulatedSchedule`), the module's ``backward`` (under loss
parallel for vocab-sharded logits), gradient clipping by the global norm and the MoE once-per-step update
(what ``on_before_optimizer_step`` does, without its host read of the token count: fake tensors have no
value, and the scale it computes does not change any tensor's size), then ``optimizer.step`` and
``zero_grad``. The optimizer state exists before the step (:func:`~kempnerforge.estimate.build.warm_optimizer`).
Logging is switched off for the step (``self.log`` needs Lightning's loop; the values are fake).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kempnerforge.estimate.batch import synthetic_batch
from kempnerforge.estimate.build import RankBuild
from kempnerforge.estimate.counters import StepCounter, axis_of_group
from kempnerforge.estimate.fake_ops import (
    FAKE_TENSOR_ERRORS,
    AnalyticFallback,
    FakeTensorLimitError,
    FallbackRecord,
    balanced_routing,
    describe_failure,
    separate_sharding_propagation,
)
from kempnerforge.estimate.pipeline_sim import SimulatedSchedule
from kempnerforge.estimate.tracker import make_tracker, memory_summary, track_inputs
from kempnerforge.parallel.grad_clip import clip_grad_norm_


@dataclass
class StepResult:
    """What one rank's simulated step measured (bytes, FLOPs, seconds).

    Attributes:
        params_bytes, grads_bytes, optimizer_bytes: this rank's local (sharded) parameters, gradients at the
            end of backward and optimizer states.
        params_global_bytes: the same parameters unsharded (this rank's stages for ``pp > 1``).
        memory: :func:`~kempnerforge.estimate.tracker.memory_summary` of the step (peak by category, modules).
        flops: FLOPs this rank executed (recomputation included).
        comm: ``{"kind[axis]": bytes}``; comm_calls: the same keys, number of calls.
        tokens: tokens of this rank's data shard per step (micro_batch_size x seq_len).
        fallbacks: modules counted analytically.
        seconds: wall time of the simulated step.
    """

    params_bytes: int
    params_global_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    memory: dict[str, Any]
    flops: int
    comm: dict[str, int]
    comm_calls: dict[str, int]
    tokens: int
    fallbacks: list[FallbackRecord] = field(default_factory=list)
    seconds: float = 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (local shards)."""
    return _nbytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _hidden_dtype(build: RankBuild) -> torch.dtype:
    return build.strategy.param_dtype


def _stage_positions(module: Any, strategy: Any, batch: dict[str, Any]) -> int:
    """Positions of the hidden states one pipeline stage passes on: the sequence (a VLM's ``[visual; text]``, padded
    to a multiple of the sequence-parallel degree), this rank's share of it under sequence or context parallelism."""
    _, text = module.pipeline_inputs(batch)
    seq = batch["input_ids"].shape[1] if text is None else text.stop
    dims = strategy.parallel_mesh.dims
    sp = dims.tp if strategy.sequence_parallel else 1
    return -(-seq // sp) * sp // sp // dims.cp


def run_step(build: RankBuild, progress: Callable[[str], None] = lambda message: None) -> StepResult:
    """Run one training step of ``build`` (materialized, optimizer warm) under the memory tracker and counters.

    Call inside ``FakeTensorMode``.

    Raises:
        FakeTensorLimitError: the step cannot run on fake tensors outside what the analytic fallback covers.
    """
    module, strategy, model, optimizer = build.module, build.strategy, build.model, build.optimizer
    device = strategy.root_device
    batch = synthetic_batch(module, build.datamodule, device)
    pipeline = strategy.pipeline
    axes = axis_of_group(strategy.parallel_mesh)
    if pipeline is not None and pipeline.tied_group is not None:  # pp > 2: the first/last-stage pair of its own
        axes.setdefault(pipeline.tied_group.group_name, "pp_tied")
    counter = StepCounter(axes)
    if pipeline is not None:
        hidden = (batch["input_ids"].shape[0] // pipeline.microbatches, _stage_positions(module, strategy, batch))
        hidden += (module.config.dim,)
        pipeline.schedule = SimulatedSchedule(pipeline, device, hidden, _hidden_dtype(build), counter)
    tracker = make_tracker(build.roots, model, optimizer)
    track_inputs(tracker, batch)
    params = list(model.parameters())
    module.log = lambda *args, **kwargs: None  # see the module docstring
    start = time.perf_counter()
    try:
        with (
            balanced_routing(),
            separate_sharding_propagation(),
            AnalyticFallback(model, counter.add_flops) as fallback,
            tracker,
            counter,
        ):
            tracker.mark("step start", "forward")
            if pipeline is not None:
                progress(f"pipeline schedule: {pipeline.microbatches} micro-batches, forward and backward")
                pipeline.schedule.mark = tracker.mark
                loss = strategy.training_step(batch, 0)
                pipeline.restore_grads(model)
                pipeline.finish_step_gradients(model)  # a tied embedding: first + last stage's gradients summed
            else:
                progress("forward and loss")
                loss = module.training_step(batch, 0)
                tracker.mark("loss", "backward")
                progress("backward")
                module.backward(loss)
            tracker.mark("gradients ready", "optimizer")
            progress("clipping and optimizer step")
            grads_bytes = _nbytes(p.grad for p in params if p.grad is not None)
            del loss
            module._step_tokens._stats = None  # on_before_optimizer_step's finish(), minus the host read
            clip_grad_norm_(params, module.grad_clip, pp_group=strategy.pp_group)
            module._moe_step()
            tracker.mark("optimizer.step")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.mark("step end")
    except FAKE_TENSOR_ERRORS as err:
        raise FakeTensorLimitError(
            f"cannot simulate the step on fake tensors: {describe_failure(err)} needs tensor values or a kernel "
            "fake tensors do not have, outside the blocks the analytic fallback covers"
        ) from err
    finally:
        del module.log
    seconds = time.perf_counter() - start
    return StepResult(
        params_bytes=_nbytes(params),
        params_global_bytes=sum(p.numel() * p.element_size() for p in params),
        grads_bytes=grads_bytes,
        optimizer_bytes=optimizer_state_bytes(optimizer),
        memory=memory_summary(tracker),
        flops=counter.flops,
        comm={f"{kind}[{axis}]": b for (kind, axis), b in sorted(counter.comm.items())},
        comm_calls={f"{kind}[{axis}]": c for (kind, axis), c in sorted(counter.calls.items())},
        tokens=batch["input_ids"].numel(),
        fallbacks=list(fallback.records.values()),
        seconds=seconds,
    )
