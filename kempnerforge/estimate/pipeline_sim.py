"""One pipeline rank's schedule, run in one process: the real stages and action order, simulated transfers.

``torch.distributed.pipelining`` schedules exchange activations, gradients and (at their first step) shape
metadata with their neighbours; on a fake process group nothing arrives, and its warm-up vote reads a
received value back to the host. :class:`SimulatedSchedule` replaces only that exchange: it runs the real
schedule's per-rank action list (``pipeline_order``: F, B, I, W, REDUCE_GRAD, in the order the real
schedule would; for the one-stage-per-rank schedules, their executed order: :func:`single_stage_actions`)
through torch's own ``PipelineStage`` methods (``backward_maybe_with_nosync``, which sets
FSDP2's no-sync flags, and ``perform_reduce_grad``, which runs the reduce-scatter after the last micro-batch),
with a fresh fake tensor standing in for each received activation or gradient. The rank therefore holds
exactly the activations the real schedule keeps in flight. Sent and received bytes are counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    REDUCE_GRAD,
    _Action,
)

from kempnerforge.parallel.pipeline import SINGLE_STAGE, build_schedule


def single_stage_actions(schedule: str, stage: int, n_stages: int, n_micro: int) -> list[_Action]:
    """The compute order of a one-stage-per-rank schedule, as torch 2.13's ``ScheduleGPipe`` /
    ``Schedule1F1B._step_microbatches`` run it (their ``pipeline_order`` tables are descriptive only and do not
    match the executed order): GPipe runs every forward, then every backward; 1F1B runs
    ``min(n_micro, n_stages - stage)`` warm-up forwards, then alternates backward / forward, then the
    remaining backwards; both reduce gradients at the end."""
    if schedule == "gpipe":
        order = [(FORWARD, i) for i in range(n_micro)] + [(FULL_BACKWARD, i) for i in range(n_micro)]
    else:
        warmup = min(n_micro, n_stages - stage)
        order = [(FORWARD, i) for i in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < n_micro:
            order.append((FULL_BACKWARD, bwd))
            bwd += 1
            if fwd < n_micro:
                order.append((FORWARD, fwd))
                fwd += 1
    return [_Action(stage, kind, i) for kind, i in order] + [_Action(stage, REDUCE_GRAD, None)]


class _StageCall(nn.Module):
    """Calls a stage module from inside a parent module: torch's FSDP memory tracker refuses a second
    forward of a root called at top level (it takes it for a second iteration), and every micro-batch is one."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        return self.stage(*args)


class SimulatedSchedule:
    """Stands in for the runner's schedule (``runner.schedule``): same ``step`` signature, simulated transfers.

    Args:
        runner: the strategy's :class:`~kempnerforge.parallel.pipeline_runner.PipelineRunner` (stages made).
        device: the simulated device.
        hidden_shape: ``(micro-batch, seq, dim)`` of the activations between stages.
        hidden_dtype: their dtype (the blocks' compute dtype).
        counter: receives the send / recv bytes (``add_comm``), or None.
    """

    def __init__(
        self, runner: Any, device: torch.device, hidden_shape: tuple[int, ...], hidden_dtype: torch.dtype, counter=None
    ) -> None:
        self.runner = runner
        self.device = device
        self.hidden_shape, self.hidden_dtype = hidden_shape, hidden_dtype
        self.counter = counter
        group = runner.pp_mesh.get_group()
        self.stages = {
            s: PipelineStage(mod, s, runner.n_stages, device, group=group)
            for mod, s in zip(runner.stage_modules, runner.ids, strict=True)
        }
        if runner.schedule_name in SINGLE_STAGE:
            (stage,) = runner.ids
            self.actions = single_stage_actions(runner.schedule_name, stage, runner.n_stages, runner.microbatches)
        else:  # the real schedule, built for its action table (the runtime executes it; its step would exchange data)
            stages = list(self.stages.values())
            real = build_schedule(runner.schedule_name, stages, runner.microbatches, runner._loss_fn)
            self.actions = real.pipeline_order[runner.pp_mesh.get_local_rank()]
        self._callers = {s: _StageCall(stage.submod) for s, stage in self.stages.items()}
        #: Called as ``mark(label, phase)`` before each action (the memory tracker's timeline marks).
        self.mark: Callable[[str, str], None] = lambda label, phase: None
        # A steady-state step: no metadata-inference forward, which the MoE aux bookkeeping would otherwise expect.
        runner._shape_inference = False

    def _count(self, nbytes: int) -> None:
        if self.counter is not None:
            self.counter.add_comm("send_recv", "pp", nbytes)

    def _received(self, like: torch.Tensor | None = None) -> torch.Tensor:
        if like is not None:
            return torch.empty_like(like)
        return torch.empty(self.hidden_shape, dtype=self.hidden_dtype, device=self.device, requires_grad=True)

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None, return_outputs: bool = False) -> None:
        """Run this rank's actions for one step over ``runner.microbatches`` micro-batches of ``args`` (the first
        stage's inputs) and ``target`` (last stage), split along the batch as the real schedule splits them."""
        n = self.runner.microbatches
        inputs = list(zip(*(torch.tensor_split(a, n) for a in args), strict=True)) if args else None
        targets = torch.tensor_split(target, n) if target is not None else None
        self._fwd: dict[tuple[int, int], tuple[Any, list[torch.Tensor], Any]] = {}
        self._param_groups: dict[tuple[int, int], Any] = {}
        self._handoff: dict[tuple[str, int, int], torch.Tensor] = {}
        reduced: set[int] = set()
        for action in self.actions:
            if action is None:
                continue
            subs = action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)
            for sub in subs:
                self._run(sub, inputs, targets, reduced)
        for s, stage in self.stages.items():  # schedules without REDUCE_GRAD actions reduce at the end
            if s not in reduced:
                self.mark(f"stage {s} reduce-scatter of gradients", "backward")
                stage.perform_reduce_grad(1)

    def _run(self, action: Any, inputs, targets, reduced: set[int]) -> None:
        kind, s, i = action.computation_type, action.stage_index, action.microbatch_index
        stage = self.stages.get(s)
        if stage is None:
            return
        if kind == FORWARD:
            self.mark(f"stage {s} forward, micro-batch {i}", "forward")
            self._forward(stage, s, i, inputs, targets)
        elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
            self.mark(f"stage {s} backward{'' if kind == FULL_BACKWARD else ' (input)'}, micro-batch {i}", "backward")
            self._backward(stage, s, i, "full" if kind == FULL_BACKWARD else "input")
        elif kind == BACKWARD_WEIGHT:
            self.mark(f"stage {s} backward (weight), micro-batch {i}", "backward")
            stage.backward_maybe_with_nosync("weight", {"param_groups": self._param_groups.pop((s, i))})
        elif kind == REDUCE_GRAD:
            self.mark(f"stage {s} reduce-scatter of gradients", "backward")
            stage.perform_reduce_grad(1)
            reduced.add(s)
        # UNSHARD / RESHARD / SEND / RECV actions carry no compute: the transfers are simulated below.

    def _forward(self, stage: PipelineStage, s: int, i: int, inputs, targets) -> None:
        if stage.is_first:
            x = inputs[i]  # every input of the first stage (token ids; a VLM's pixels too)
        elif (s - 1) in self.stages:  # previous stage on this rank (V schedules): its output, detached
            x = (self._handoff.pop(("act", s, i)),)
        else:
            x = (self._received(),)
            self._count(x[0].numel() * x[0].element_size())
        out = self._callers[s](*x)
        stage_output = out  # the real stage caches its output (the logits, on the last stage) until backward
        if stage.is_last:
            out = self.runner._loss_fn(out, targets[i])
        elif (s + 1) in self.stages:
            self._handoff[("act", s + 1, i)] = out.detach().requires_grad_(True)
        else:
            self._count(out.numel() * out.element_size())
        self._fwd[(s, i)] = (out, list(x), stage_output)

    def _backward(self, stage: PipelineStage, s: int, i: int, kind: str) -> None:
        out, inputs, _ = self._fwd.pop((s, i))
        if stage.is_last:
            grads = None
        elif ("grad", s, i) in self._handoff:
            grads = (self._handoff.pop(("grad", s, i)),)
        else:
            grads = (self._received(out),)
            self._count(out.numel() * out.element_size())
        bwd = {"stage_output": out if stage.is_last else (out,), "output_grads": grads, "input_values": inputs}
        input_grads, param_groups = stage.backward_maybe_with_nosync(kind, bwd)
        if kind == "input":
            self._param_groups[(s, i)] = param_groups
        if stage.is_first:
            return
        grad = input_grads[0] if input_grads else None
        if (s - 1) in self.stages and grad is not None:
            self._handoff[("grad", s - 1, i)] = grad
        elif grad is not None:
            self._count(grad.numel() * grad.element_size())
