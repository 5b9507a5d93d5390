"""Resuming a checkpoint into a different model (e.g. auto-resume after switching ``vlm.arch`` in a recipe that
shares its checkpoint folder) is refused in config terms, not as a missing tensor key."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.checkpoint.compat import layout_resume_flags, model_config_diff
from kempnerforge.checkpoint.dcp_io import CheckpointError
from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig


def _fit(module, data, tmp_path, ckpt_path=None) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="s{step}", auto_insert_metric_name=False, every_n_train_steps=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=KempnerStrategy(), max_steps=1, logger=False,
                      limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


def test_a_checkpoint_of_another_model_is_refused_naming_the_settings(tmp_path, shakespeare_tokens):
    data = TokenDataModule(str(shakespeare_tokens), seq_len=32, micro_batch_size=2)
    sched = SchedulerConfig(warmup_steps=1, total_steps=1)
    shape = dict(n_layers=2, n_heads=4, vocab_size=50257, max_seq_len=64, multiple_of=16)
    unfused = dict(fuse_qkv=False, fuse_w13=False)  # the layout of a checkpoint from before fusing was the default
    small = ModelConfig(dim=32, **shape, **unfused)
    _fit(CausalLM(small, scheduler=sched), data, tmp_path)
    wide = ModelConfig(dim=64, **shape, **unfused)
    # head_dim follows dim (None = dim / n_heads, compared resolved), so both are named.
    with pytest.raises(CheckpointError, match=r"was written by another model \(model.config.dim: saved 32, now 64; "
                       r"model.config.head_dim: saved 8, now 16\).*--ckpt_path null"):  # fmt: skip
        _fit(CausalLM(wide, scheduler=sched), data, tmp_path / "again", ckpt_path=str(tmp_path / "s1.ckpt"))
    # The same model with the default fused projections: the refusal says which flags resume it.
    with pytest.raises(CheckpointError, match=r"holds the same model with its projections laid out differently "
                       r"\(model.config.fuse_qkv: saved False, now True .*Resume it with "
                       r"--model.config.fuse_qkv=False --model.config.fuse_w13=False\.$"):  # fmt: skip
        _fit(CausalLM(ModelConfig(dim=32, **shape), scheduler=sched), data, tmp_path / "fused",
             ckpt_path=str(tmp_path / "s1.ckpt"))  # fmt: skip


def test_model_config_diff_lists_vlm_settings():
    saved = {"config": {"dim": 64}, "vlm": {"arch": "joint_decoder", "cross_attn_every": 4}, "optimizer": {"lr": 1}}
    now = {"config": {"dim": 64}, "vlm": {"arch": "cross_attention", "cross_attn_every": 4}, "optimizer": {"lr": 2}}
    assert model_config_diff(saved, now) == ["model.vlm.arch: saved 'joint_decoder', now 'cross_attention'"]
    assert model_config_diff(saved, {"config": {"dim": 64}}) == ["model.vlm: only in the checkpoint"]
    assert model_config_diff(None, now) == [] and model_config_diff(saved, saved) == []
    assert layout_resume_flags(saved, now) == []  # another model: no flag resumes it
