"""Training runs of an imported DeepSeek-V3 checkpoint (MLA + group-limited sigmoid MoE), several per launch.

``--runs`` lists runs as ``name:key=value,...``; keys: ``ckpt`` (the weights-only checkpoint ``kforge convert
hf-to-dcp`` wrote; every run starts from it), ``tp``, ``pp`` (pipeline stages), ``ep`` (expert parallel), ``sp`` (sequence parallel), ``micro_batch`` (per rank;
default 8), ``ac`` (activation checkpointing mode). Each run is one ``Trainer.fit`` of 5 steps on a global batch
of 8 x 32 tokens, fp32 on gloo; rank 0 writes ``{name: {"losses", "grad_norms", "first_batch", "numel"}}`` to
``--out`` (``numel``: this rank's and the global element count of every layer-1 attention parameter).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor

from kempnerforge.checkpoint.load import model_config_from_meta, resolve_and_verify
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from tests.distributed import multi_run  # noqa: E402
from tests.distributed.train_script import Recorder  # noqa: E402

INT_KEYS = ("tp", "pp", "ep", "sp", "micro_batch")


class FirstBatch(Callback):
    """This rank's first batch (input_ids, labels), for the HF loss oracle."""

    def __init__(self) -> None:
        self.batch: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.batch is None:
            self.batch = {k: batch[k].tolist() for k in ("input_ids", "labels")}


def _numel(model: torch.nn.Module) -> dict[str, list[int]]:
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        if name.startswith("layers.1.attention."):
            local = p.to_local() if isinstance(p, DTensor) else p
            out[name.removeprefix("layers.1.attention.")] = [local.numel(), p.numel()]
    return out


def run(opts: dict, data: str) -> dict:
    """One 5-step fit from ``opts['ckpt']`` (see the module docstring); returns its record."""
    seed_everything(0, workers=True)
    resolved, meta = resolve_and_verify(opts["ckpt"])
    module = CausalLM(
        config=model_config_from_meta(meta, resolved),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=2, total_steps=40),
        grad_clip=1.0,
    )
    datamodule = TokenDataModule(
        data_dir=data, seq_len=32, micro_batch_size=opts.get("micro_batch", 8), val_fraction=0.1, data_seed=0
    )
    recorder, first = Recorder(), FirstBatch()
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(
            tp=opts.get("tp", 1),
            pp=opts.get("pp", 1),
            ep=opts.get("ep", 1),
            sequence_parallel=opts.get("sp", 0) == 1,
            activation_checkpointing=opts.get("ac", "none"),
        ),
        max_steps=5,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, first],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=opts["ckpt"])
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "first_batch": first.batch,
        "numel": _numel(module.model),
    }


def main() -> None:
    """The shared multi-run command line (:func:`tests.distributed.multi_run.main`)."""
    multi_run.main(lambda name, opts, args: run(opts, args.data), INT_KEYS)


if __name__ == "__main__":
    main()
