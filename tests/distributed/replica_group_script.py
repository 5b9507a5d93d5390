"""One replica group (or a plain HSDP run) of the tiny model, for the fault-tolerance tests.

Every rank writes ``<out>/g<group>_r<rank>.pt``: the per-step global losses and step counters, and at the end its
local parameter and optimizer shards (bitwise comparisons across groups). ``--die-at N`` SIGKILLs every rank of the
group in the middle of step N + 1, before its backward (``kill -9`` of the job step); ``--sleep`` paces the steps so a restarted group can catch up.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from train_script import tiny_config

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.resilience.auto_resume import AutoResume
from kempnerforge.resilience.ft_config import FaultTolerance
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class Record(Callback):
    """Per step: the global loss and Lightning's step counter; optional pacing and self-kill."""

    def __init__(self, sleep: float, die_at: int | None) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []  # before clipping: a wrong gradient scale shows here (Adam hides it)
        self.steps: list[int] = []
        self.sleep, self.die_at = sleep, die_at

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # Mid-step (the quorum formed, the token count summed, no gradient summed yet): the others' step fails.
        if self.die_at is not None and trainer.global_step >= self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)
        loss = trainer.callback_metrics.get("train/loss")
        self.losses.append(float(loss) if loss is not None else float("nan"))
        norm = trainer.callback_metrics.get("train/grad_norm")
        self.grad_norms.append(float(norm) if norm is not None else float("nan"))
        time.sleep(self.sleep)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group", type=int, default=None, help="replica group id (None: no fault tolerance)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="'auto' or a checkpoint path")
    args = p.parse_args()

    seed_everything(0, workers=True)
    torch.use_deterministic_algorithms(True)
    module = CausalLM(
        config=tiny_config(),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=3, total_steps=40),
        grad_clip=1.0,
    )
    data = TokenDataModule(data_dir=args.data, seq_len=32, micro_batch_size=2, val_fraction=0.1, data_seed=0)
    ft = None
    if args.group is not None:
        ft = FaultTolerance(
            replica_group_id=args.group,
            num_replica_groups=args.groups,
            min_replica_groups=args.min_groups,
            timeout_s=15,  # a collective waiting on a peer that stopped (not died) fails after this
            quorum_timeout_s=60,
        )
    record = Record(args.sleep, args.die_at)
    callbacks: list = [record]
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="step={step:04d}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(dp_replicate=args.dp_replicate, fault_tolerance=ft),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    ckpt_path = AutoResume(args.ckpt_dir) if args.resume == "auto" else args.resume
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    state = {
        "losses": record.losses,
        "grad_norms": record.grad_norms,
        "steps": record.steps,
        "global_step": trainer.global_step,
        "params": {n: _local(q) for n, q in module.model.named_parameters()},
        "optim": {n: {k: _local(v) for k, v in optimizer.state[q].items()} for n, q in module.model.named_parameters()},
        "lr": optimizer.param_groups[0]["lr"],
    }
    group = args.group if args.group is not None else 0
    torch.save(state, os.path.join(args.out, f"g{group}_r{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
