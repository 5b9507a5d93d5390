"""Issue 17 check 5: validation runs the training loss path, in one process on CPU.

- ``val/loss`` is the token-weighted cross-entropy of an independent full-logits computation, through the
  chunked head too (``loss_chunk_size > 0``), and ``val/ppl == exp(val/loss)`` (no second softmax); VLMs too.
- Peak memory, measured by ``torch.distributed._tools.mem_tracker.MemTracker`` (real tensors on CPU): with
  ``loss_chunk_size > 0`` a validation batch stays below a training step, and below the full-logits
  validation that torchmetrics' ``Perplexity`` path used to run.
- ``kforge eval`` takes the run's ``loss_chunk_size`` (same perplexity as the full-logits path).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM, VisionLanguage
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.tools.evaluate import perplexity
from kempnerforge.training.loss import IGNORE_INDEX
from tests.vlm_tiny import tiny_encoder, tiny_text, tiny_vlm

# A large vocabulary next to a small model: the (tokens, vocab) fp32 logits dominate memory, as they do for
# small and mid-size LLMs at 128k-256k vocabularies.
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=64, multiple_of=16)
BATCH, SEQ, CHUNK = 8, 64, 64


def _text_batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (n * BATCH, SEQ + 1), generator=gen)
    rows = [{"input_ids": r[:-1], "labels": r[1:].clone()} for r in ids]
    rows[1]["labels"][:10] = IGNORE_INDEX  # uneven target counts: the token weighting matters
    return rows


def _trainer(**kw) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, **kw)  # fmt: skip


def _reference_loss(module: CausalLM, rows) -> float:
    """Token-weighted CE of the full fp32 logits, computed here from the module's weights."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = module.model(row["input_ids"][None]).float()
            total += float(F.cross_entropy(logits[0], row["labels"], ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int((row["labels"] != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize(
    "impl,chunk", [("torch", 0), ("auto", CHUNK), ("auto", 0)], ids=["full_logits", "chunked", "default"]
)
def test_val_loss_is_the_token_weighted_ce_and_ppl_its_exp(impl, chunk):
    rows = _text_batches(2)
    module = CausalLM(CFG, init_seed=1, loss_chunk_size=chunk, loss_impl=impl)
    metrics = _trainer().validate(module, DataLoader(rows, batch_size=BATCH), verbose=False)[0]
    assert metrics["val/loss"] == pytest.approx(_reference_loss(module, rows), rel=1e-6)
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-6)


def test_vlm_val_ppl_is_exp_val_loss():
    module = VisionLanguage(config=tiny_text(), vlm=tiny_vlm("joint_decoder"), encoder=tiny_encoder())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 10), generator=gen)
    text_mask = torch.ones(4, 10, dtype=torch.bool)
    text_mask[1, 6:] = False
    batch = {"input_ids": ids, "labels": torch.where(text_mask, ids.roll(-1, 1), IGNORE_INDEX),
             "text_mask": text_mask, "pixel_values": torch.randn(4, 3, 32, 32, generator=gen)}  # fmt: skip
    metrics = _trainer().validate(module, DataLoader([batch], batch_size=None), verbose=False)[0]
    with torch.no_grad():
        logits = module(ids, batch["pixel_values"], text_mask=text_mask).float()
    ref = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    assert metrics["val/loss"] == pytest.approx(float(ref), rel=1e-5)
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-6)


class _PeakMemory(Callback):
    """Peak tracked bytes (parameters, gradients, optimizer state, activations, temporaries) of each training
    step and each validation batch, from a ``MemTracker`` entered around the batch, and the rise of that peak
    above what was resident when the batch started (weights, gradients, AdamW state)."""

    def __init__(self) -> None:
        self.train: list[int] = []
        self.val: list[int] = []
        self.val_rise: list[int] = []
        self._tracker: MemTracker | None = None
        self._start_bytes = 0

    def _start(self, trainer, pl_module) -> None:
        self._tracker = MemTracker()
        self._tracker.track_external(pl_module.model, *trainer.optimizers)
        self._tracker.__enter__()
        self._start_bytes = _total(self._tracker.get_tracker_snapshot())

    def _stop(self) -> int:
        self._tracker.__exit__(None, None, None)
        peak = _total(self._tracker.get_tracker_snapshot("peak"))
        self._tracker = None
        return peak

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(self._stop())

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._start(trainer, pl_module)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.val.append(self._stop())
        self.val_rise.append(self.val[-1] - self._start_bytes)


def _total(snapshot: dict) -> int:
    return sum(per_device["Total"] for per_device in snapshot.values())


def _peaks(chunk: int, impl: str = "auto") -> _PeakMemory:
    probe = _PeakMemory()
    trainer = _trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0,
                       callbacks=[probe])  # fmt: skip
    trainer.fit(
        CausalLM(CFG, init_seed=1, loss_chunk_size=chunk, loss_impl=impl),
        DataLoader(_text_batches(2), batch_size=BATCH),
        DataLoader(_text_batches(1, seed=1), batch_size=BATCH),
    )
    assert len(probe.train) == 2 and len(probe.val) == 1
    return probe


def test_chunked_validation_peak_is_below_the_training_step_peak():
    """With loss_chunk_size > 0 a validation batch adds one (chunk, vocab) block to what is resident, never the
    (batch, seq, vocab) logits, and its peak stays below the training step's. Measured (8 x 64 tokens at vocab
    4,096: 8 MiB of fp32 logits): chunked, training step 9.8 MiB peak, validation 5.4 MiB peak of which 2.1 MiB (two chunk-sized blocks)
    above the resident weights, gradients and AdamW state; with full logits validation rises 16 MiB (the
    validation before this change ran the full-logits path whatever loss_chunk_size said, plus a second softmax)."""
    chunked, full = _peaks(CHUNK), _peaks(0, "torch")
    mib = 2**20
    print(f"peak MiB: chunked train {chunked.train[-1] / mib:.2f} val {chunked.val[0] / mib:.2f} "
          f"(+{chunked.val_rise[0] / mib:.2f}); full-logits train {full.train[-1] / mib:.2f} "
          f"val {full.val[0] / mib:.2f} (+{full.val_rise[0] / mib:.2f})")  # fmt: skip
    assert chunked.val[0] < chunked.train[-1]
    logits_bytes = BATCH * SEQ * CFG.vocab_size * 4
    assert chunked.val_rise[0] < logits_bytes / 2  # the oracle: full fp32 logits cannot fit in this rise
    assert full.val_rise[0] > logits_bytes  # the measurement sees the full-logits path


def test_eval_tool_uses_the_chunked_head_and_agrees_with_full_logits():
    module = CausalLM(CFG, init_seed=1)
    module.configure_model()
    rows = _text_batches(1)
    loader = DataLoader(rows, batch_size=4)
    full, chunked = perplexity(module.model, loader), perplexity(module.model, loader, loss_chunk_size=CHUNK)
    assert chunked.tokens == full.tokens == sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in rows)
    assert chunked.loss == pytest.approx(full.loss, rel=1e-6)
    assert full.loss == pytest.approx(_reference_loss(module, rows), rel=1e-6)
    assert chunked.perplexity == pytest.approx(math.exp(chunked.loss), rel=1e-12)
