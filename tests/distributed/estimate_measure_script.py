"""The measured side of the estimate-vs-measurement check: a real gloo ``kforge fit`` run of a recipe, with torch's
``MemTracker`` (real tensors) around one steady-state training step.

Usage (one launch, every rank): ``estimate_measure_script.py --out DIR --step N -- <kforge fit arguments>``.
The Trainer, LightningModule and DataModule are what ``kforge fit`` builds from the arguments (the same
``make_cli``), trained by Lightning's own loop; a callback enters a ``MemTracker`` at the start of batch ``N``
(the optimizer state exists by then) and leaves it at the batch's end: forward, loss, backward, clipping,
optimizer step and Lightning's bookkeeping in between. Each rank writes ``DIR/rank{R}.json`` with the tracker's
peak of tracked tensor bytes (``peak_bytes``) and its breakdown.

The tracker is torch's plain ``MemTracker`` (every tensor allocated while active, plus the model's parameters,
gradients, buffers, the optimizer states and the batch registered as external; ``RepeatableMemTracker`` lets a
pipeline stage run once per micro-batch), not the estimate's FSDP2 tracker, and it follows Lightning's own loop
and the real pipeline schedule, not the estimate's simulated step and schedule.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from kempnerforge.cli import make_cli  # noqa: E402
from kempnerforge.estimate.tracker import RepeatableMemTracker  # noqa: E402


class StepMemoryProbe(Callback):
    """Tracks tensor memory over training batch ``step`` (0-based) and keeps the peak."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.tracker: RepeatableMemTracker | None = None
        self.record: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.step:
            return
        self.tracker = RepeatableMemTracker()
        tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
        self.tracker.track_external(pl_module.model, *trainer.optimizers, *tensors)
        self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.step or self.tracker is None:
            return
        self.tracker.__exit__(None, None, None)
        peak = self.tracker.get_tracker_snapshot("peak")
        snap = next(iter(peak.values())) if peak else {}
        self.record = {
            "peak_bytes": int(snap.get("Total", 0)),
            "breakdown": {str(getattr(k, "value", k)): int(v) for k, v in snap.items()},
        }
        self.tracker = None


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    own, fit_args = argv[:split], argv[split + 1 :]
    out = Path(own[own.index("--out") + 1])
    step = int(own[own.index("--step") + 1])
    cli = make_cli(fit_args, run=False)
    probe = StepMemoryProbe(step)
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(probe.record))


if __name__ == "__main__":
    main()
