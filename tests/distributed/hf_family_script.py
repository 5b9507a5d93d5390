"""Training runs of imported HF models (issue 20 check 2), several per launch.

``--ckpt-root`` holds ``<family>/`` folders written by ``kforge convert hf-to-dcp`` (weights-only checkpoint plus
``model.yaml``); ``--runs`` lists ``name:family=<family>[,tp=2][,micro_batch=2][,ac=full]`` (``ac``: activation checkpointing). Each run is the documented fine-tuning start,
``Trainer.fit(CausalLM(config from model.yaml), ckpt_path=<family>)``: 5 steps of AdamW on a global batch of
4 x 32 tokens (``micro_batch`` per data-parallel rank, default 4), fp32 on gloo, the data-parallel degree whatever
the world size leaves after ``tp``. Rank 0 writes
``{name: {"losses", "grad_norms", "placements", "checkpointed"}}`` (block 0's attention parameter placements; whether
activation checkpointing wrapped the blocks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from tests.distributed import multi_run  # noqa: E402
from tests.distributed.train_script import Recorder  # noqa: E402


def _placements(model: torch.nn.Module) -> dict[str, str]:
    """Placements of block 0's attention parameters (AC / FSDP wrappers dropped from the names)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        if name.startswith("layers.0.attention."):
            out[name] = str(tuple(p.placements)) if isinstance(p, DTensor) else "plain"
    return out


def run(opts: dict, args) -> dict:
    ckpt = Path(args.ckpt_root) / opts["family"]
    cfg = ModelConfig(**yaml.safe_load((ckpt / "model.yaml").read_text())["model"]["config"])
    seed_everything(0, workers=True)
    module = CausalLM(config=cfg, optimizer=OptimizerConfig(lr=3e-3),
                      scheduler=SchedulerConfig(warmup_steps=2, total_steps=40), grad_clip=1.0)  # fmt: skip
    datamodule = TokenDataModule(
        data_dir=args.data, seq_len=32, micro_batch_size=opts.get("micro_batch", 4), val_fraction=0.1, data_seed=0
    )
    recorder = Recorder()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")),
                      strategy=KempnerStrategy(tp=opts.get("tp", 1), activation_checkpointing=opts.get("ac", "none")), max_steps=5, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[recorder])  # fmt: skip
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt))
    wrapped = any("_checkpoint_wrapped_module" in n for n, _ in module.model.named_parameters())
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "placements": _placements(module.model),
            "checkpointed": wrapped}  # fmt: skip


def main() -> None:
    """The shared multi-run command line (:func:`tests.distributed.multi_run.main`)."""
    multi_run.main(lambda name, opts, args: run(opts, args), ("tp", "micro_batch"), ckpt_root=True)


if __name__ == "__main__":
    main()
