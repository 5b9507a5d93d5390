"""Per-step world collectives and host synchronizations of a 2-rank dense run, under four signal setups.

``--mode``: ``default`` (no signal callback: the strategy's own flag-only handling), ``user`` (a SIGTERM handler the
user installed before ``fit``), ``preemption`` (an explicit ``Preemption``), ``lightning`` (the strategy's take-over
turned off, so Lightning's own per-step SIGTERM broadcast runs: the control that proves the counter sees it).
Each rank writes ``--out``-rank<r>.json: for every counted step, the collectives as ``"op@group size"`` (a
``TorchDispatchMode`` over torch's c10d and functional-collective ops, the ones CommDebugMode tracks) and the host
synchronizations as ``"op@file"`` (:class:`tests.host_syncs.HostSyncCounter`).
"""

from __future__ import annotations

import argparse
import json
import signal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode
from train_script import tiny_config

from kempnerforge.callbacks import NaNGuard, Preemption
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.optimizers import OptimizerConfig
from tests.host_syncs import HostSyncCounter

WARMUP, STEPS = 2, 7


def _group_size(args: tuple, kwargs: dict) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, str) and a:  # functional collectives name their group
            try:
                return dist.distributed_c10d._resolve_process_group(a).size()
            except Exception:  # noqa: S112 - another string argument (a reduce op name)
                continue
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a).size()
    return -1


class Collectives(TorchDispatchMode):
    """Records every collective op dispatched, as ``"op@group size"``, into the current step's list."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, list[str]] = {}
        self.step = -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in c10d_collective_ops or packet in NATIVE_TO_PY_MAPPING:
            self.steps.setdefault(self.step, []).append(f"{packet.__name__}@{_group_size(args, kwargs)}")
        return func(*args, **kwargs)


class StepMarker(Callback):
    def __init__(self, mode: Collectives) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.mode.step = trainer.global_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["default", "user", "preemption", "lightning"], required=True)
    args = p.parse_args()
    seed_everything(0, workers=True)
    if args.mode == "lightning":
        import kempnerforge.strategies.kempner as kempner

        kempner.take_over_signals = lambda trainer: None  # Lightning's own handlers and per-step broadcast
    if args.mode == "user":
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    module = CausalLM(config=tiny_config(), optimizer=OptimizerConfig(fused=True))
    data = TokenDataModule(data_dir=args.data, seq_len=16, micro_batch_size=2, val_fraction=0.1, data_seed=0)
    collectives, syncs = Collectives(), HostSyncCounter()
    callbacks = [StepMarker(collectives), syncs.callback(warmup=WARMUP), NaNGuard()]
    callbacks.append(ModelCheckpoint(dirpath=args.out + "-ckpt", every_n_train_steps=1000))
    if args.mode == "preemption":
        callbacks.append(Preemption(check_every_s=1e6))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=KempnerStrategy(), max_steps=STEPS, limit_val_batches=0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    with syncs, collectives:
        trainer.fit(module, datamodule=data)
    counted = range(WARMUP, STEPS - 1)
    per_sync = syncs.per_iteration(WARMUP, STEPS - 2)
    record = {
        str(s): {
            "collectives": collectives.steps.get(s, []),
            "syncs": [f"{e.op}@{e.where.split(':')[0]}" for e in per_sync.get(s, [])],
        }
        for s in counted
    }
    with open(f"{args.out}-rank{trainer.global_rank}.json", "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
