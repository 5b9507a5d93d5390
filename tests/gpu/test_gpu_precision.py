"""The CUDA defaults of issue 17 on one GPU (skipped without CUDA by tests/conftest.py), in this process:

- ``KempnerStrategy()`` trains in bf16 compute with fp32 sharded master weights (``mixed_precision_param=auto``),
  sets TF32 for fp32 matmuls (``float32_matmul_precision=high``) and logs the policy with the mesh;
  ``float32_matmul_precision=highest`` opts out.
- The RoPE tables reach attention in fp32 under that policy.
- AdamW is fused by default, and validation with ``loss_chunk_size > 0`` peaks below the training step
  (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.model.attention import Attention
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy

pytestmark = pytest.mark.gpu

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, max_seq_len=128, multiple_of=32)


def _rows(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, CFG.vocab_size, (n, 129), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r[:-1], "labels": r[1:]} for r in ids]


class _Probe(Callback):
    def __init__(self) -> None:
        self.tables, self.logits_dtype, self.train_peak, self.val_peak = [], None, 0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        for m in pl_module.model.modules():
            if isinstance(m, Attention):
                m.register_forward_pre_hook(lambda _m, args: self.tables.append(args[1].dtype))
        pl_module.model.output.register_forward_hook(lambda _m, _a, out: setattr(self, "logits_dtype", out.dtype))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_peak = max(self.train_peak, torch.cuda.max_memory_allocated())

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        torch.cuda.reset_peak_memory_stats()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_peak = max(self.val_peak, torch.cuda.max_memory_allocated())


def test_cuda_default_is_bf16_compute_fp32_master_weights_tf32_fused_adamw(caplog):
    before = torch.get_float32_matmul_precision()
    probe, module = _Probe(), CausalLM(CFG, loss_chunk_size=256)
    trainer = Trainer(accelerator="cuda", devices=1, strategy=KempnerStrategy(), max_steps=3, val_check_interval=3,
                      limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])  # fmt: skip
    try:
        with caplog.at_level("INFO"):
            trainer.fit(module, DataLoader(_rows(24), batch_size=8), DataLoader(_rows(8, 1), batch_size=8))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    assert any("precision: bf16 compute, fp32 master weights" in r.getMessage() for r in caplog.records)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in module.model.parameters())
    assert probe.tables and set(probe.tables) == {torch.float32}  # RoPE stays fp32 inside bf16 blocks
    assert trainer.optimizers[0].defaults["fused"] is True
    assert probe.val_peak < probe.train_peak
    metrics = trainer.callback_metrics
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(float(metrics["val/loss"])), rel=1e-6)


def test_float32_matmul_precision_highest_opts_out():
    before = torch.get_float32_matmul_precision()
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      strategy=KempnerStrategy(mixed_precision_param="float32", float32_matmul_precision="highest"),
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    try:
        trainer.fit(CausalLM(CFG), DataLoader(_rows(8), batch_size=8))
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
