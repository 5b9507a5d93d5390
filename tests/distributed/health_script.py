"""Two-rank runs for the HealthCheck and MFUMonitor callbacks under KempnerStrategy (launched by torchrun).

--mode sick:    rank 1's device check fails at step 2: both ranks must save one DCP checkpoint and stop.
--mode stalled: rank 1 stalls in its check at step 2: rank 0 must raise CollectiveTimeoutError, not hang.
Writes rank 0's record as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

from kempnerforge.callbacks import HealthCheck, MFUMonitor
from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.metrics.health import DeviceHealth
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig


class InjectedHealthCheck(HealthCheck):
    """Rank 1 fails (``sick``) or stalls (``stalled``) at step ``at``."""

    def __init__(self, mode: str, at: int, **kw) -> None:
        super().__init__(**kw)
        self.mode, self.at, self.trainer = mode, at, None

    def on_train_start(self, trainer, pl_module):
        self.trainer = trainer
        super().on_train_start(trainer, pl_module)

    def check_device(self, device):
        if self.trainer.global_rank == 1 and self.trainer.global_step == self.at:
            if self.mode == "stalled":
                time.sleep(30)
            return DeviceHealth(False, "injected failure")
        return super().check_device(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["sick", "stalled"], required=True)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    seed_everything(0)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=50257, max_seq_len=32, multiple_of=16)
    module = CausalLM(cfg, scheduler=SchedulerConfig(warmup_steps=1, total_steps=8))
    data = TokenDataModule(args.data, seq_len=32, micro_batch_size=2)
    health = InjectedHealthCheck(
        args.mode, 2, every_n_steps=1, collective_timeout_s=2.0, dirpath=str(args.out) + ".ckpts", memory_mb=1
    )
    mfu = MFUMonitor(window=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=KempnerStrategy(tp=args.tp),
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[health, mfu],
    )
    trainer.fit(module, datamodule=data)
    if dist.get_rank() == 0:
        record = {
            "global_step": trainer.global_step,
            "failure": health.failure,
            "checkpoint": str(health.stop_checkpoint),
            "checks": health.checks,
            "dp": mfu._dp,
            "non_dp": mfu._non_dp,
            "last": mfu.last,
        }
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
