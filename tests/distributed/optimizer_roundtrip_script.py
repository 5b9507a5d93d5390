"""Each optimizer under FSDP2 (torchrun, 2 gloo ranks): train on real text, checkpoint, resume in a fresh module.

For every optimizer name given: run A trains ``--steps`` steps with a DCP checkpoint at ``--ckpt-step``
and snapshots the optimizer state (this rank's shards) right after that step; run B builds a fresh
module and Trainer, resumes from the checkpoint and snapshots the state it restored before its first
step. Rank r writes ``{out}/rank{r}.json``: per optimizer the losses of A and B and whether every state
tensor (moments, step counts, Schedule-Free's ``z`` and its group scalars) and every weight came back
bit-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from train_script import tiny_config  # same folder: torchrun puts it on sys.path

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

LR = {"adamw": 3e-3, "muon": 3e-3, "lion": 1e-3, "schedule_free_adamw": 3e-3}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def snapshot(module: CausalLM, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """This rank's optimizer state and weights as flat ``name -> tensor or python value`` (cloned)."""
    flat: dict[str, object] = {}
    osd = get_optimizer_state_dict(module.model, optimizer)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            flat[f"state/{fqn}/{k}"] = _local(v).detach().clone() if torch.is_tensor(v) else v
    for i, group in enumerate(osd["param_groups"]):
        for k, v in group.items():
            if k != "params":
                flat[f"group{i}/{k}"] = v
    for name, p in module.model.named_parameters():
        flat[f"param/{name}"] = _local(p).detach().clone()
    return flat


def same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors compared bit-exactly)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        eq = torch.equal(x, y) if torch.is_tensor(x) else x == y
        if not eq:
            bad.append(k)
    return bad


class Snap(Callback):
    def __init__(self, at_step: int | None) -> None:
        self.at_step, self.state, self.losses = at_step, None, []

    def on_train_start(self, trainer, pl_module) -> None:
        if self.at_step is None:
            self.state = snapshot(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if trainer.global_step == self.at_step:
            self.state = snapshot(pl_module, trainer.optimizers[0])


def fit(name: str, args, ckpt_dir: Path, snap: Snap, resume: str | None) -> None:
    seed_everything(0, workers=True)
    decay = "constant" if name == "schedule_free_adamw" else "cosine"
    config = tiny_config()
    if name == "muon":  # Muon orthogonalizes each matrix: the separate projections (fused is the default)
        config = dataclasses.replace(config, fuse_qkv=False, fuse_w13=False)
    module = CausalLM(
        config=config,
        optimizer=OptimizerConfig(name=name, lr=LR[name], beta2=0.95),
        scheduler=SchedulerConfig(warmup_steps=2, decay=decay, total_steps=40),
        grad_clip=1.0,
    )
    data = TokenDataModule(data_dir=args.data, seq_len=32, micro_batch_size=4, val_fraction=0.1, data_seed=0)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, filename="step={step:04d}", auto_insert_metric_name=False,
                           every_n_train_steps=args.ckpt_step, save_top_k=-1)  # fmt: skip
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(dp_shard=-1),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[snap, ckpt],
    )
    trainer.fit(module, datamodule=data, ckpt_path=resume)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--optimizers", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ckpt-step", type=int, default=4)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    result = {}
    for name in args.optimizers:
        ckpt_dir = out / name
        a, b = Snap(args.ckpt_step), Snap(None)
        fit(name, args, ckpt_dir, a, None)
        fit(name, args, ckpt_dir, b, str(ckpt_dir / f"step={args.ckpt_step:04d}.ckpt"))
        result[name] = {
            "losses_a": a.losses,
            "losses_b": b.losses,
            "mismatched": same(a.state, b.state),
            "n_state": len(a.state),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
