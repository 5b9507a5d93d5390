"""Issue 17 check 6: device-to-host synchronizations per training step, counted on CPU.

Real steps through Lightning (Trainer + KempnerStrategy, the debug recipe's callbacks, kempnerforge's
progress bar, a CSV logger), counted by :class:`tests.host_syncs.HostSyncCounter` after 2 warm-up
steps. A steady-state step of every kind makes exactly the synchronizations the README lists:

- dense, MoE (capacity, sigmoid bias balancing) and VLM (MoT over padded video, MoMa over images): one
  with NaNGuard, its agreed flags read back before the update (Preemption's flag rides along); none
  without it (Preemption alone agrees every ``check_every_s`` seconds, here never after warm-up);
- with gradient accumulation: the same per optimizer step, none in the other micro-batches;
- at a logging step (every ``log_every_n_steps``), in addition: one read-back per logged device metric
  (Lightning's logger: train/loss, train/grad_norm; MoE: also train/moe_aux_loss and one for all the
  expert-load statistics) and one for the progress bar;
- expert parallelism adds one per MoE layer forward (tests/distributed/ep_moe_check.py counts it).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from kempnerforge.callbacks import MemoryMonitor, MFUMonitor, NaNGuard, Preemption, ProgressBar
from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM, VisionLanguage
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.loss import IGNORE_INDEX
from kempnerforge.training.optimizers import OptimizerConfig
from tests.host_syncs import HostSyncCounter
from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_text, tiny_vlm

# Counted optimizer steps 2..6 (the last one, 7, also ends the fit); step 4 (the 5th) is a logging step.
WARMUP, STEPS, LOG_EVERY = 2, 8, 5
NAN_GUARD_SYNC = ("tolist", "kempnerforge/resilience/signals.py")  # the agreed flags, read back once
MOE = dict(num_experts=4, top_k=2, n_shared_experts=1, capacity_factor=1.0, router="sigmoid",
           bias_update_rate=0.01, aux_loss_weight=0.01)  # fmt: skip


def _text_batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (n, 13), generator=g)
    labels = ids[:, 1:].clone()
    labels[::3, -4:] = IGNORE_INDEX
    return [{"input_ids": r[:-1], "labels": lab} for r, lab in zip(ids, labels, strict=True)]


def _vlm_loader(n_batches: int, video: bool) -> DataLoader:
    """Image or video batches of 2 as the collators make them (right-padded text; clips of 3 and 1 frames)."""
    g = torch.Generator().manual_seed(0)

    def batch(_):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        text_mask = torch.arange(8)[None] < torch.tensor([8, 5])[:, None]
        out = {"input_ids": ids, "labels": ids.masked_fill(~text_mask, IGNORE_INDEX), "text_mask": text_mask}
        if not video:
            return {**out, "pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
        frame_mask = torch.tensor([[True, True, True], [True, False, False]])
        pixels = torch.randn(2, 3, 3, 32, 32, generator=g) * frame_mask[..., None, None, None]
        return {**out, "pixel_values": pixels, "frame_mask": frame_mask, "real_frames": 4}

    return DataLoader(range(n_batches), batch_size=None, collate_fn=batch)


def _count(tmp_path, module, loader, nan_guard: bool = True, accumulate: int = 1, style: str = "lines") -> dict:
    """Fit ``STEPS`` optimizer steps; the synchronizations of each counted step (warm-up and the last
    step excluded), as ``(op, file)`` pairs. ``style``: the progress rendering (a batch log's lines or the bar)."""
    counter = HostSyncCounter()
    callbacks = [counter.callback(warmup=WARMUP * accumulate), ProgressBar(style=style), MFUMonitor(), MemoryMonitor(),
                 Preemption(check_every_s=1e6), ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=100)]  # fmt: skip
    if nan_guard:
        callbacks.insert(1, NaNGuard())
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=STEPS,
                      accumulate_grad_batches=accumulate, limit_val_batches=0, log_every_n_steps=LOG_EVERY,
                      logger=CSVLogger(tmp_path), enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    with counter:
        trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == STEPS
    per_step: dict[int, list] = {}
    for iteration, events in counter.per_iteration(WARMUP * accumulate, (STEPS - 1) * accumulate - 1).items():
        per_step.setdefault(iteration // accumulate, []).extend((e.op, e.where.split(":")[0]) for e in events)
    return per_step


#: Read-backs a logging step adds: Lightning's logger reads each logged device metric (train/loss,
#: train/grad_norm), the progress bar reads both in one read-back (the same in its bar and lines renderings).
LOGGING = [("item", "lightning/fabric/utilities/apply_func.py")] * 2 + [("tolist", "callbacks/progress.py")]
#: MoE adds train/moe_aux_loss and one read-back for every layer's expert-load statistics together.
MOE_LOGGING = [*LOGGING, ("item", "lightning/fabric/utilities/apply_func.py"), ("cpu", "kempnerforge/module.py")]


def _assert_steady(per_step: dict[int, list], expected: list, logging: list = LOGGING) -> None:
    for step, events in per_step.items():
        if (step + 1) % LOG_EVERY:
            assert events == expected, (step, events)
        else:
            assert sorted(events) == sorted(expected + logging), (step, events)


def _causal_lm(**extra) -> CausalLM:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16,
                      **extra)  # fmt: skip
    return CausalLM(cfg, optimizer=OptimizerConfig(fused=True))  # fused: as on CUDA, the step count stays a tensor


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_text_step_makes_one_sync_with_nan_guard(tmp_path, kind):
    module = _causal_lm(**(MOE if kind == "moe" else {}))
    style = "bar" if kind == "dense" else "lines"  # both renderings read at the same steps
    per_step = _count(tmp_path, module, DataLoader(_text_batches(4 * STEPS), batch_size=4), style=style)
    _assert_steady(per_step, [NAN_GUARD_SYNC], MOE_LOGGING if kind == "moe" else LOGGING)


def test_dense_step_without_nan_guard_makes_none_also_with_accumulation(tmp_path):
    per_step = _count(tmp_path, _causal_lm(), DataLoader(_text_batches(4 * STEPS), batch_size=2), nan_guard=False,
                      accumulate=2)  # fmt: skip
    _assert_steady(per_step, [])


@pytest.mark.parametrize(("arch", "video"), [("mot", True), ("moma", False)])
def test_vlm_step_makes_one_sync_with_nan_guard(tmp_path, arch, video):
    """MoT over padded clips (the host layout dispatch, real frames gathered by the collator's count,
    the padded-frame attention mask) and MoMa over images (expert choice with fixed shapes, is_causal)."""
    module = VisionLanguage(tiny_text(), tiny_vlm(arch), tiny_encoder(), tiny_connector(),
                            optimizer=OptimizerConfig(fused=True))  # fmt: skip
    per_step = _count(tmp_path, module, _vlm_loader(STEPS, video))
    _assert_steady(per_step, [NAN_GUARD_SYNC])
