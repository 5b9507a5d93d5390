"""Schedule-Free checkpoints hold the training point ``y``; the one-process tools (generate, convert, eval) must
see the averaged weights ``x`` that Schedule-Free evaluates (arXiv:2405.15682), as Lightning's validation does."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.checkpoint.load import load_checkpoint_model
from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig, set_schedule_free_mode

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=50257, max_seq_len=64, multiple_of=16)


def _fit(tmp_path, data, name: str) -> CausalLM:
    module = CausalLM(CFG, optimizer=OptimizerConfig(name=name, lr=1e-2),
                      scheduler=SchedulerConfig(warmup_steps=1, decay="constant"))  # fmt: skip
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=3)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=3, logger=False,
                      limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])  # fmt: skip
    trainer.fit(module, datamodule=data)
    return module


def test_tools_load_the_averaged_weights_x(tmp_path, shakespeare_tokens):
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    module = _fit(tmp_path, data, "schedule_free_adamw")
    y = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    set_schedule_free_mode(module.trainer.optimizers[0], train=False)  # what Schedule-Free evaluates
    x = module.model.state_dict()
    loaded = load_checkpoint_model(tmp_path).model.state_dict()
    moved = 0
    for name, value in x.items():
        assert torch.equal(loaded[name], value), name  # bitwise what validation evaluates
        moved += not torch.equal(value, y[name])
    assert moved >= len(x) - 2  # x really differs from the saved y (all but the RoPE buffers)


def test_other_optimizers_load_as_saved(tmp_path, shakespeare_tokens):
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    module = _fit(tmp_path, data, "adamw")
    loaded = load_checkpoint_model(tmp_path).model.state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(loaded[name], value), name
