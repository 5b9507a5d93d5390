"""The CPU sync count (tests/unit/test_host_syncs.py) cross-checked on CUDA with torch's own detector.

``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronizing CUDA call (device-to-host
copies, blocking host-to-device copies, ``nonzero`` and friends), including those inside kernels the
CPU count cannot see. A steady-state dense step with NaNGuard makes one (its agreed flags); MoE and a
MoT step over padded clips make the same one (flex attention for the padded frames, the collator's
frame count). Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from kempnerforge.callbacks import NaNGuard, Preemption, ProgressBar
from kempnerforge.module import VisionLanguage
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.optimizers import OptimizerConfig
from tests.unit.test_host_syncs import MOE, _causal_lm, _text_batches, _vlm_loader
from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

pytestmark = pytest.mark.gpu

WARMUP, STEPS = 3, 8  # counted steps 3..6; no logging step among them (log_every_n_steps=50)


class _CudaSyncs(Callback):
    """Turns the CUDA sync detector on from ``WARMUP`` on and files its warnings by loop iteration."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[str]] = {}
        self._step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step
        if self._step >= WARMUP:
            torch.cuda.synchronize()  # nothing pending from the previous step's own work
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def record(self, message) -> None:
        if "synchronizing CUDA operation" in str(message) and WARMUP <= self._step < STEPS - 1:
            self.by_step.setdefault(self._step, []).append(str(message).splitlines()[0])


def _fit(module, loader) -> dict[int, list[str]]:
    probe = _CudaSyncs()
    trainer = Trainer(accelerator="gpu", devices=1, strategy=KempnerStrategy(), max_steps=STEPS,
                      limit_val_batches=0, log_every_n_steps=50, logger=False, enable_checkpointing=False,
                      enable_model_summary=False,
                      callbacks=[probe, ProgressBar(), NaNGuard(), Preemption(check_every_s=1e6)])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        original = warnings.showwarning
        warnings.showwarning = lambda message, *a, **k: probe.record(message)
        try:
            trainer.fit(module, train_dataloaders=loader)
        finally:
            warnings.showwarning = original
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        probe.record(w.message)
    return probe.by_step


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_step_synchronizes_once_on_cuda(kind):
    module = _causal_lm(**(MOE if kind == "moe" else {}))
    by_step = _fit(module, DataLoader(_text_batches(4 * STEPS), batch_size=4))
    counts = {s: len(by_step.get(s, [])) for s in range(WARMUP, STEPS - 1)}
    assert counts == dict.fromkeys(counts, 1), by_step


def test_vlm_video_step_synchronizes_once_on_cuda():
    module = VisionLanguage(tiny_text(), tiny_vlm("mot"), tiny_encoder(), tiny_connector(),
                            optimizer=OptimizerConfig(fused=True))  # fmt: skip
    by_step = _fit(module, _vlm_loader(STEPS, video=True))
    counts = {s: len(by_step.get(s, [])) for s in range(WARMUP, STEPS - 1)}
    assert counts == dict.fromkeys(counts, 1), by_step
