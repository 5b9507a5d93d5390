"""CausalLM with KempnerStrategy: fast_dev_run, fit-then-validate, logged metrics, seq_len checks."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig

TINY = {
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 50257,
    "max_seq_len": 64,
    "multiple_of": 16,
}


def _trainer(**kw):
    base = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return Trainer(**{**base, **kw})


def test_fast_dev_run_with_strategy(shakespeare_tokens):
    module = CausalLM(ModelConfig(**TINY), scheduler=SchedulerConfig(warmup_steps=1, total_steps=4))
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    trainer = _trainer(strategy=KempnerStrategy(), fast_dev_run=True)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 1
    assert metrics["train/loss"].item() == pytest.approx(torch.log(torch.tensor(50257.0)).item(), abs=0.5)
    assert metrics["train/tokens_seen"].item() == 64
    assert metrics["train/grad_norm"].item() > 0
    assert "val/loss" in metrics and "val/ppl" in metrics
    assert metrics["val/ppl"].item() == pytest.approx(torch.exp(metrics["val/loss"]).item(), rel=1e-4)


def test_fit_then_validate_reuses_the_model(shakespeare_tokens):
    module = CausalLM(ModelConfig(**TINY), scheduler=SchedulerConfig(warmup_steps=1, total_steps=3))
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    trainer = _trainer(strategy=KempnerStrategy(), max_steps=3, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data)
    weights = to_full(module.model.layers["0"].attention.wqkv.weight).clone()
    (result,) = trainer.validate(module, datamodule=data)
    assert torch.equal(to_full(module.model.layers["0"].attention.wqkv.weight), weights)  # not re-initialized
    assert result["val/loss"] < 10.9


def test_runs_under_a_stock_strategy(shakespeare_tokens):
    """Without KempnerStrategy, configure_model initializes the weights itself (same seed, same weights)."""
    from kempnerforge.model import Transformer

    module = CausalLM(ModelConfig(**TINY), scheduler=SchedulerConfig(warmup_steps=1, total_steps=2), init_seed=3)
    module.configure_model()
    reference = Transformer(ModelConfig(**TINY))
    reference.init_weights(seed=3)
    for (name, p), (_, q) in zip(module.model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    trainer = _trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    assert 10.0 < trainer.callback_metrics["train/loss"].item() < 11.5


def test_negative_grad_clip_refused():
    with pytest.raises(ValueError, match=r"grad_clip=-1.0 must be >= 0"):
        CausalLM(grad_clip=-1.0)


def test_seq_len_longer_than_max_seq_len_refused_before_allocation(shakespeare_tokens):
    module = CausalLM(ModelConfig(**{**TINY, "max_seq_len": 16}))
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"data.seq_len=32 exceeds model.config.max_seq_len=16"):
        _trainer(strategy=KempnerStrategy(), fast_dev_run=True).fit(module, datamodule=data)
    assert module.model is None
