"""Pipeline-parallel training runs for the distributed tests, several per launch (each launch costs ~10 s).

``--runs`` lists runs as ``name:key=value,...`` (keys: pp, schedule, v, mb, steps, ckpt_every, resume,
micro_batch, dp_shard, val_batches, ac, tp, sp, acc = accumulate_grad_batches, opt = optimizer name, fused /
foreach = 1 for those AdamW kernels, spy = 1 to record the largest DTensor gathered during validation, moe = 1 for
the MoE decoder (:func:`moe_config`), tie = 1 for tied embeddings). Each run is one ``Trainer.fit`` of the 4-layer tiny decoder under ``torchrun``; rank 0
writes ``{name: {"losses": [...], "grad_norms": [...], "steps": [...]}}`` to ``--out``. Checkpoints go
to ``<--ckpt-root>/<name>``; ``resume=<other name>/<checkpoint dir>`` resumes from another run's save.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor, Replicate

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from tests.distributed import multi_run  # noqa: E402
from tests.distributed.train_script import Recorder, tiny_config  # noqa: E402

INT_KEYS = ("pp", "v", "mb", "steps", "ckpt_every", "micro_batch", "dp_shard", "val_batches", "tp", "sp", "acc",
            "fused", "foreach", "spy", "moe", "tie")  # fmt: skip
LR = {"adamw": 3e-3, "muon": 3e-3, "lion": 1e-3, "schedule_free_adamw": 3e-3}


class GatherSpy(Callback):
    """The largest DTensor (global elements) made whole (``full_tensor`` / ``redistribute`` to all-Replicate)
    while validation runs: loss parallel must never gather the ``(batch, seq, vocab)`` logits."""

    def __init__(self) -> None:
        self.largest = 0
        self._saved = None

    def on_validation_start(self, trainer, pl_module) -> None:
        full, redistribute = DTensor.full_tensor, DTensor.redistribute
        spy = self

        def full_tensor(t, *args, **kwargs):
            spy.largest = max(spy.largest, t.numel())
            return full(t, *args, **kwargs)

        def redistribute_(t, device_mesh=None, placements=None, **kwargs):
            if placements is not None and all(isinstance(p, Replicate) for p in placements):
                spy.largest = max(spy.largest, t.numel())
            return redistribute(t, device_mesh, placements, **kwargs)

        self._saved = (full, redistribute)
        DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute_

    def on_validation_end(self, trainer, pl_module) -> None:
        DTensor.full_tensor, DTensor.redistribute = self._saved


class StepRecorder(Recorder):
    """:class:`Recorder` at optimizer-step ends only (with gradient accumulation)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def moe_config(tie: bool = False):
    """The 4-layer MoE decoder of the pipeline tests: ``tiny_config(moe=True)`` (sigmoid router with bias
    balancing, a shared expert, sequence-wise aux and z losses) with every other block dense
    (``moe_frequency=2``: each stage holds one MoE and one dense block), and aux weights large enough that
    an aux loss missing from a stage's backward moves the gradient norm far beyond the 1e-5 tolerance."""
    cfg = tiny_config(moe=True, num_experts=4, tie=tie)
    return dataclasses.replace(cfg, n_layers=4, moe_frequency=2, seq_aux_loss_weight=0.5, z_loss_weight=0.05)


def run(name: str, opts: dict, data: str, ckpt_root: Path) -> dict:
    """One fit; returns the recorded losses, grad norms and global steps (all ranks see the same)."""
    seed_everything(0, workers=True)
    pp = opts.get("pp", 1)
    opt_name = opts.get("opt", "adamw")
    kernels = {k: True for k in ("fused", "foreach") if opts.get(k)}
    decay = "constant" if opt_name == "schedule_free_adamw" else "cosine"
    tie = opts.get("tie", 0) == 1
    config = moe_config(tie) if opts.get("moe") else dataclasses.replace(tiny_config(tie=tie), n_layers=4)
    if opt_name == "muon":  # Muon orthogonalizes each matrix: the separate projections (fused is the default)
        config = dataclasses.replace(config, fuse_qkv=False, fuse_w13=False)
    module = CausalLM(
        config=config,
        optimizer=OptimizerConfig(name=opt_name, lr=LR[opt_name], **kernels),
        scheduler=SchedulerConfig(warmup_steps=2, decay=decay, total_steps=20),
        grad_clip=float(opts.get("clip", 1.0)),
    )
    datamodule = TokenDataModule(
        data_dir=data, seq_len=32, micro_batch_size=opts.get("micro_batch", 8), val_fraction=0.1, data_seed=0
    )
    pp_kwargs = {}
    if pp > 1:
        pp_kwargs = {"pp_schedule": opts.get("schedule", "1f1b"), "pp_virtual_stages": opts.get("v", 1)}
        pp_kwargs["pp_microbatches"] = opts.get("mb")
    recorder, spy = StepRecorder(), GatherSpy()
    callbacks = [recorder, spy] if opts.get("spy") else [recorder]
    if opts.get("ckpt_every"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_root / name,
                filename="step={step:04d}",
                auto_insert_metric_name=False,
                every_n_train_steps=opts["ckpt_every"],
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(
            pp=pp,
            dp_shard=opts.get("dp_shard", -1),
            tp=opts.get("tp", 1),
            sequence_parallel=opts.get("sp", 0) == 1,
            activation_checkpointing=opts.get("ac", "none"),
            **pp_kwargs,
        ),
        max_steps=opts.get("steps", 5),
        accumulate_grad_batches=opts.get("acc", 1),
        limit_val_batches=opts.get("val_batches", 0),
        val_check_interval=opts.get("steps", 5),
        logger=False,
        enable_checkpointing="ckpt_every" in opts,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    resume = ckpt_root / opts["resume"] if "resume" in opts else None
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    record = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "steps": recorder.steps}
    if "val/loss" in trainer.callback_metrics:
        record["val_loss"] = float(trainer.callback_metrics["val/loss"])
        record["val_ppl"] = float(trainer.callback_metrics["val/ppl"])
    if opts.get("spy"):
        record["largest_val_gather"] = spy.largest
    return record


def main() -> None:
    """The shared multi-run command line (:func:`tests.distributed.multi_run.main`) with ``--ckpt-root``."""
    multi_run.main(lambda name, opts, args: run(name, opts, args.data, Path(args.ckpt_root)), INT_KEYS, ckpt_root=True)


if __name__ == "__main__":
    main()
