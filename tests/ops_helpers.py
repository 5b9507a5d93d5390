"""Helpers of the operations tests (generate / convert / eval): tiny trained checkpoints made in-process."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig

#: dense untied, dense tied, softmax MoE (Mixtral-compatible): the three export families of issue 9.
TINY_CONFIGS = {
    "dense": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2),
    "tied": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=True),
    "moe": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2),
}


def tiny_config(kind: str) -> ModelConfig:
    """A ~3M-parameter GPT-2-vocabulary decoder of the given kind (see :data:`TINY_CONFIGS`)."""
    return ModelConfig(**TINY_CONFIGS[kind], vocab_size=50257, max_seq_len=64, multiple_of=16, rope_theta=10000.0)


def train_checkpoint(root: Path, data_dir: Path, kind: str, steps: int = 6) -> tuple[Path, float]:
    """Train ``steps`` steps at devices=1 under KempnerStrategy (lr 1e-2: the weights move far from init),
    save a checkpoint at the last step, validate on the held-out split.

    Returns:
        ``(checkpoint folder holding latest, val/loss of the final weights)``.
    """
    seed_everything(0)
    # The module's own default optimizer config at lr 1e-2 (whatever module defines OptimizerConfig).
    optimizer = dataclasses.replace(inspect.signature(CausalLM).parameters["optimizer"].default, lr=1e-2)
    module = CausalLM(tiny_config(kind), optimizer=optimizer,
                      scheduler=SchedulerConfig(warmup_steps=1, total_steps=steps))  # fmt: skip
    data = TokenDataModule(str(data_dir), seq_len=32, micro_batch_size=4, val_fraction=0.05, data_seed=0)
    ckpt = root / f"ckpt-{kind}"
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(),
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpt,
                filename="step={step:04d}",
                auto_insert_metric_name=False,
                every_n_train_steps=steps,
                save_top_k=-1,
            )
        ],  # fmt: skip
    )
    trainer.fit(module, datamodule=data)
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)
    if dist.is_initialized():  # the strategy's 1-rank group: the tools under test run without one
        dist.destroy_process_group()
    return ckpt, float(metrics["val/loss"])
