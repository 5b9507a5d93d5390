"""Issue 21: ``model.loss_impl=liger`` (Liger-Kernel's fused linear cross-entropy, Triton) against ``F.cross_entropy``
and against our chunked path, on one GPU (skipped without CUDA by tests/conftest.py; needs liger-kernel, the ``gpu``
extra). fp32 and bf16 inputs, ignore_index rows, the z-loss; then a KempnerStrategy run with it (bf16 policy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum
from kempnerforge.training.loss import IGNORE_INDEX
from kempnerforge.training.loss_impl import liger_linear_cross_entropy_sum

pytestmark = pytest.mark.gpu
pytest.importorskip("liger_kernel")


def _inputs(dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 64, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(5003, 64, device="cuda", generator=g) * 0.2).to(dtype).requires_grad_()
    y = torch.randint(0, 5003, (300,), device="cuda", generator=g)
    y[:17] = IGNORE_INDEX
    return h, w, y


@pytest.mark.parametrize("dtype,z", [(torch.float32, 0.0), (torch.float32, 1e-3), (torch.bfloat16, 0.0)])
def test_liger_equals_f_cross_entropy(dtype, z):
    h, w, y = _inputs(dtype)
    logits = (h @ w.t()).float()
    ref = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
    z_ref = (torch.logsumexp(logits, -1).square() * (y != IGNORE_INDEX)).sum()
    ((ref + z * z_ref) * 0.5).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out, z_sum = liger_linear_cross_entropy_sum(h, w, y, z)
    (out * 0.5).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # TF32-free fp32 GEMMs in both; bf16 rounding otherwise
    torch.testing.assert_close(out, ref + z * z_ref, rtol=tol, atol=0)
    if z:
        torch.testing.assert_close(z_sum, z_ref.detach(), rtol=tol, atol=0)
    torch.testing.assert_close(h.grad, gh, rtol=tol, atol=tol * gh.abs().max().item())
    torch.testing.assert_close(w.grad, gw, rtol=tol, atol=tol * gw.abs().max().item())
    h.grad = w.grad = None
    ours, _ = chunked_linear_cross_entropy_sum(h, w, y, 64, z)
    torch.testing.assert_close(ours, out.detach(), rtol=tol, atol=0)


def test_liger_trains_like_the_chunked_default_under_the_bf16_policy():
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, max_seq_len=64, multiple_of=32)
    ids = torch.randint(0, cfg.vocab_size, (8, 65), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r[:-1], "labels": r[1:]} for r in ids]
    losses = {}
    for impl in ("auto", "liger"):
        module = CausalLM(cfg, init_seed=1, loss_impl=impl)
        trainer = Trainer(accelerator="cuda", devices=1, strategy=KempnerStrategy(), max_steps=3, logger=False,
                          limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
        trainer.fit(module, DataLoader(rows, batch_size=4))
        losses[impl] = float(trainer.callback_metrics["train/loss"])
        assert module.resolved_loss_impl == ("chunked" if impl == "auto" else "liger")
    assert losses["liger"] == pytest.approx(losses["auto"], rel=2e-2)
