"""torch.profiler over a window of training steps: Chrome/TensorBoard traces and a top-ops summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from typing_extensions import override


class StepProfiler(Callback):
    """Profiles ``active`` training steps after ``start_step`` skipped and ``warmup`` warm-up steps.

    Steps are counted from the start of this ``fit`` (a resumed run counts from its first step).
    Each rank writes ``dirpath/rank{R}.<time>.pt.trace.json`` (Chrome trace format; opens in
    chrome://tracing, Perfetto and TensorBoard's profiler plugin) and ``dirpath/top_ops_rank{R}.txt``
    (the ``top_ops`` operators with the most self time, from ``key_averages()``). The trace paths
    written so far are in :attr:`traces`.

    Args:
        dirpath: output folder (created).
        start_step: steps to skip before profiling (compile / warm-up steps are not representative).
        warmup: steps profiled but discarded (profiler start-up overhead).
        active: steps recorded.
        record_shapes: record operator input shapes.
        profile_memory: record tensor allocations.
        with_stack: record Python stacks (large traces).
        top_ops: rows of the summary table.

    Raises:
        ValueError: ``start_step`` or ``warmup`` < 0, ``active`` or ``top_ops`` < 1.
    """

    def __init__(
        self,
        dirpath: str = "profiler",
        start_step: int = 5,
        warmup: int = 1,
        active: int = 3,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        top_ops: int = 25,
    ) -> None:
        for name, value, low in (("start_step", start_step, 0), ("warmup", warmup, 0), ("active", active, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StepProfiler.{name}={value!r} must be an integer >= {low}")
        if not isinstance(top_ops, int) or top_ops < 1:
            raise ValueError(f"StepProfiler.top_ops={top_ops!r} must be an integer >= 1")
        self.dirpath = Path(dirpath)
        self.start_step, self.warmup, self.active = start_step, warmup, active
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.top_ops = top_ops
        self.traces: list[Path] = []
        self._prof: profile | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start the profiler with its step schedule."""
        self.dirpath.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        rank = trainer.global_rank
        trace_handler = tensorboard_trace_handler(str(self.dirpath), worker_name=f"rank{rank}")

        def on_ready(prof: profile) -> None:
            before = set(self.dirpath.glob(f"rank{rank}.*.pt.trace.json"))
            trace_handler(prof)
            self.traces += sorted(set(self.dirpath.glob(f"rank{rank}.*.pt.trace.json")) - before)
            sort = "self_cuda_time_total" if ProfilerActivity.CUDA in activities else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=self.top_ops)
            (self.dirpath / f"top_ops_rank{rank}.txt").write_text(table)

        self._prof = profile(
            activities=activities,
            schedule=schedule(skip_first=self.start_step, wait=0, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=on_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._prof.start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Advance the profiler's schedule by one step."""
        if self._prof is not None:
            self._prof.step()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Stop the profiler (writes the trace if the window was cut short by the end of training)."""
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Stop the profiler on a failed run too."""
        self._stop()

    def _stop(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
