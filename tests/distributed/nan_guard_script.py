"""NaN-guard runs under ``torchrun``: a NaN injected into rank 0's loss at one step, or a reference run
that never sees some batches. Each rank writes its full (unsharded) final weights to ``--out``-rank<r>.pt."""

from __future__ import annotations

import argparse
import os
import signal

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from train_script import tiny_config

from kempnerforge.callbacks import NaNGuard, Preemption
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig


class DropBatches:
    """The loader without the batches at ``drop`` (the oracle of a run that skipped them)."""

    def __init__(self, loader, drop: set[int]) -> None:
        self.loader, self.drop = loader, drop

    def __iter__(self):
        return (b for i, b in enumerate(self.loader) if i not in self.drop)

    def __len__(self) -> int:
        return len(self.loader) - len(self.drop)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--action", default=None, help="NaNGuard action (None: no guard)")
    p.add_argument("--nan-step", type=int, default=-1, help="global step whose loss is NaN on rank 0")
    p.add_argument("--drop", default="", help="comma-separated batch indices the loader leaves out")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--signal-step", type=int, default=-1, help="global step at which rank 1 gets SIGUSR1")
    p.add_argument("--preempt-dir", default=None, help="add Preemption(check_every_s=1e6) saving here")
    args = p.parse_args()

    seed_everything(0, workers=True)
    torch.use_deterministic_algorithms(True)
    # Constant LR: a skipped step still advances Lightning's scheduler, so only then is the oracle exact.
    module = CausalLM(
        config=tiny_config(),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=0, decay="constant"),
        grad_clip=1.0,
    )
    data = TokenDataModule(data_dir=args.data, seq_len=32, micro_batch_size=4, val_fraction=0.1, data_seed=0)
    if args.drop:
        drop = {int(i) for i in args.drop.split(",")}
        orig = data.train_dataloader
        data.train_dataloader = lambda: DropBatches(orig(), drop)
    step_fn = module.training_step

    def training_step(batch, batch_idx):
        loss = step_fn(batch, batch_idx)
        if module.trainer.global_step == args.nan_step and module.trainer.global_rank == 0:
            loss = loss * float("nan")  # rank 0 only: the other rank's loss is finite
        if module.trainer.global_step == args.signal_step and module.trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # rank 1 only: the ranks must agree to stop together
        return loss

    module.training_step = training_step
    callbacks = [NaNGuard(action=args.action)] if args.action else []
    preemption = None
    if args.preempt_dir:
        # Its own agreement would come only after 1e6 s: a stop can only come from NaNGuard's reduction.
        preemption = Preemption(dirpath=args.preempt_dir, check_every_s=1e6)
        callbacks.append(preemption)
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="step={step:04d}",
                auto_insert_metric_name=False,
                every_n_train_steps=2,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.model.state_dict().items()}
    guard = callbacks[0] if args.action else None
    record = {
        "weights": weights,
        "skipped": getattr(guard, "skipped_steps", []),
        "rollbacks": getattr(guard, "rollbacks", 0),
        "preempted": str(preemption.saved_path) if preemption and preemption.saved_path else None,
        "global_step": trainer.global_step,
    }
    torch.save(record, f"{args.out}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
