"""A rank that raises inside ``training_step`` while an async save is pending, and the auto-resume after it.

Run 1 (``--fail-rank R --fail-step S``): async saves every step (``ModelCheckpoint`` with Lightning's default
``save_top_k=1``), each upload slowed down so the previous step's save is still being written at step S;
rank R raises there. Run 2 (``--blind-rank R``): ``ckpt_path=AutoResume(folder)`` while rank R's own look at
the folder would find nothing (a lagging shared-filesystem view); every rank must resume what rank 0 picked.
Each rank writes ``--out``-rank<r>.json: its error (traceback with notes), the time of the raise, whether a
save was pending then, and the step it started from.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from datetime import timedelta

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from train_script import tiny_config

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.resilience.auto_resume import AutoResume
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig

RECORD: dict = {}


class FailingLM(CausalLM):
    """Raises ``ValueError`` on one rank at one step, after noting whether a save is still in flight."""

    def __init__(self, *args, fail_rank: int = -1, fail_step: int = -1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_rank, self.fail_step = fail_rank, fail_step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.trainer.global_step == self.fail_step:
            RECORD["pending_at_raise"] = any(not t.done() for t in self.trainer.strategy.checkpoint_io._tasks)
            RECORD["raised_at"] = time.time()
            raise ValueError(f"boom: rank {self.global_rank} at step {self.fail_step}")
        return super().training_step(batch, batch_idx)


class StartStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        RECORD["start_step"] = trainer.global_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--blind-rank", type=int, default=-1)
    p.add_argument("--upload-delay", type=float, default=0.0, help="seconds added to every DCP write")
    args = p.parse_args()
    rank = int(os.environ["RANK"])

    if args.upload_delay:
        write = FileSystemWriter.write_data

        def slow(self, *a, **k):
            time.sleep(args.upload_delay)
            return write(self, *a, **k)

        FileSystemWriter.write_data = slow
    if rank == args.blind_rank:
        AutoResume.choose = lambda self: None  # this rank's listing lags: it would see no checkpoint

    seed_everything(0)
    module = FailingLM(
        tiny_config(), scheduler=SchedulerConfig(warmup_steps=1, total_steps=20),
        fail_rank=args.fail_rank, fail_step=args.fail_step,
    )  # fmt: skip
    data = TokenDataModule(args.data, seq_len=32, micro_batch_size=2, val_fraction=0.1, data_seed=0)
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=KempnerStrategy(async_checkpoint=True, timeout=timedelta(seconds=600)),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            StartStep(),
            ModelCheckpoint(
                dirpath=args.ckpt_dir, filename="step={step:04d}", auto_insert_metric_name=False, every_n_train_steps=1
            ),  # fmt: skip
        ],
    )
    out = f"{args.out}-rank{rank}.json"
    try:
        trainer.fit(module, datamodule=data, ckpt_path=AutoResume(args.ckpt_dir))
    except BaseException as err:
        RECORD.update(error="".join(traceback.format_exception(err)), failed_at=time.time())
        raise
    finally:
        with open(out, "w") as f:
            json.dump(RECORD, f)


if __name__ == "__main__":
    main()
