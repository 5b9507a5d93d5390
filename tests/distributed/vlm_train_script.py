"""Tiny VLM training runs on the bundled photos, launched by tests/distributed/test_vlm_parity.py on forked ranks.

Writes the per-step global losses and gradient norms (rank 0) and the freeze state seen at each step as JSON to
``--out``. With ``--runs name:"--flag value ..."`` one launch runs several fits (each spec's flags on top of the
command line's), and the JSON is ``{name: record}``: one rendezvous and one set of imports serve many runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kempnerforge.callbacks import FreezeSchedule  # noqa: E402
from kempnerforge.config import ModelConfig  # noqa: E402
from kempnerforge.data.vlm_datamodule import ImageTextDataModule  # noqa: E402
from kempnerforge.module import VisionLanguage  # noqa: E402
from kempnerforge.strategies import KempnerStrategy  # noqa: E402
from kempnerforge.training.freeze import FreezeSpec  # noqa: E402
from kempnerforge.training.lr import SchedulerConfig  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig  # noqa: E402
from tests.distributed.train_script import Recorder, _expert_bytes  # noqa: E402
from tests.vlm_tiny import GPT2, IMAGES, MLA, tiny_connector, tiny_encoder, tiny_text, tiny_vlm  # noqa: E402


class FreezeRecorder(Recorder):
    """Also records, per step, how many parameters were trainable when the batch ran."""

    def __init__(self) -> None:
        super().__init__()
        self.trainable: list[int] = []
        self.bias: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.trainable.append(sum(p.requires_grad for p in pl_module.model.parameters()))
        # MoE: every layer's router selection bias after the step's aux-loss-free update (global loads).
        for layer in pl_module.model.moe_layers().values():
            bias = layer.router.expert_bias
            self.bias.append((bias.full_tensor() if isinstance(bias, DTensor) else bias).tolist())


#: The text path's distributed MoE (tests/distributed/train_script.py ``tiny_config(moe=True)``) with 4 experts: every
#: block MoE, top-2 sigmoid router with bias balancing, one shared expert, sequence-wise aux and z losses (means over
#: sequences / tokens: with unpadded text every rank holds the same count, so they do not depend on the split).
MOE = dict(num_experts=4, top_k=2, n_shared_experts=1, router="sigmoid", bias_update_rate=0.01,
           seq_aux_loss_weight=0.01, z_loss_weight=0.001)  # fmt: skip


def text_config(args: argparse.Namespace) -> ModelConfig:
    """The tiny text backbone, with ``--mla`` / ``--moe`` (fields above)."""
    cfg = tiny_text(vocab_size=50257, max_seq_len=48, tie=args.tie)
    extra = (MLA if args.mla else {}) | (MOE if args.moe else {})
    return ModelConfig(**{**cfg.__dict__, **extra}) if extra else cfg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--schedule", action="store_true", help="start with the backbone frozen, unfreeze at step 3")
    p.add_argument("--ac", default="none")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tie", action="store_true", help="tie the head to the embedding")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--loss-impl", default="auto")
    p.add_argument("--max-text-len", type=int, default=24)
    p.add_argument("--float8", default=None, help="the strategy's float8_recipe (tensorwise, rowwise)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--mla", action="store_true", help="multi-head latent attention (tests/vlm_tiny.py MLA)")
    p.add_argument("--moe", action="store_true", help="MoE feed-forwards in every block (MOE above)")
    p.add_argument("--runs", nargs="+", default=None, help='several fits: name:"--flag value ..." each')
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.runs is None:
        record = run(args)
    else:
        record = {}
        for spec in args.runs:
            name, _, flags = spec.partition(":")
            record[name] = run(p.parse_args([*sys.argv[1:], *shlex.split(flags)]))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


def run(args: argparse.Namespace) -> dict:
    """One ``Trainer.fit``; rank 0's record (every rank returns one)."""
    seed_everything(0, workers=True)
    torch.use_deterministic_algorithms(True)
    spec = FreezeSpec(encoder=True)
    callbacks = [FreezeRecorder()]
    if args.schedule:
        # Stage 1 of LLaVA-style training: backbone frozen except its new parts (cross-attention
        # blocks; MoT's image-modality weights), unfrozen at step 3.
        new_parts = ["backbone.layers.*.cross_*"] if args.arch == "cross_attention" else ["backbone.layers.*.image.*"]
        spec = FreezeSpec(encoder=True, backbone=True, trainable_patterns=new_parts)
        callbacks.append(FreezeSchedule(steps=[3], specs=[FreezeSpec(encoder=True)]))
    module = VisionLanguage(
        config=text_config(args),
        vlm=tiny_vlm(args.arch),
        encoder=tiny_encoder(),
        connector=tiny_connector("mlp2"),
        freeze=spec,
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=2, total_steps=20),
        loss_impl=args.loss_impl,
    )
    data = ImageTextDataModule(
        source=str(IMAGES / "captions.jsonl"),
        tokenizer=str(GPT2),
        max_text_len=args.max_text_len,
        micro_batch_size=args.micro_batch,
    )
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, filename="step={step:04d}", auto_insert_metric_name=False,
                            every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(
            dp_shard=-1,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            activation_checkpointing=args.ac,
            sequence_parallel=args.sequence_parallel,
            float8_recipe=args.float8,
        ),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    rec = callbacks[0]
    sp_degree = module.model.backbone.sequence_parallel_degree if args.arch == "joint_decoder" else 1
    from torchao.float8.float8_linear import Float8Linear

    float8 = [n for n, m in module.model.named_modules() if isinstance(m, Float8Linear)]
    record = {"losses": rec.losses, "grad_norms": rec.grad_norms, "steps": rec.steps, "trainable": rec.trainable}
    return {**record, "sp_degree": sp_degree, "float8": float8, **moe_record(module, trainer, rec)}


def moe_record(module: VisionLanguage, trainer: Trainer, rec: FreezeRecorder) -> dict:
    """With MoE: the placements of block 0's routed experts and router (what expert-TP / EP did), this rank's and the
    global bytes of routed-expert weights, whether the aux loss was logged, and every layer's router bias per step."""
    layers = module.model.moe_layers()
    if not layers:
        return {}
    moe = layers[min(layers)]  # block 0's (a later pipeline stage: its first MoE layer)
    names = {"experts.w1": moe.experts.w1, "router": moe.router.gate.weight}
    placements = {k: str(tuple(p.placements)) if isinstance(p, DTensor) else "plain" for k, p in names.items()}
    return {
        "moe_layers": sorted(layers),
        "placements": placements,
        "expert_bytes": _expert_bytes(module.model),
        "aux_logged": "train/moe_aux_loss" in trainer.callback_metrics,
        "bias": rec.bias,
    }


if __name__ == "__main__":
    main()
