"""A tiny training run launched by the distributed tests under ``torchrun`` (one or several processes).

Writes the per-step global losses and gradient norms (rank 0) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.data.streaming import StreamingTokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.parallel.dtensor import shard_indices
from kempnerforge.parallel.grad_clip import total_grad_norm
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig


class Recorder(Callback):
    """Collects the logged global loss and gradient norm of every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.clipped_norms: list[float] = []
        self.callback_norms: list[float] = []  # the gradient norm a callback's on_before_optimizer_step sees
        self.steps: list[int] = []
        self.batches: list[list[list[int]]] = []  # this rank's input_ids per step (with --record-batches)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # What a Lightning user's callback computes (before the module's hook clips), as Lightning's grad_norm
        # does: the norm of each parameter's gradient, combined; DTensor norms made whole per parameter (so
        # any mix of meshes works), in fp64 (one fp32 norm over the 3.2M-element embedding drifts by 2e-4 on
        # CPU). Under pp each rank sees its own stages only.
        norms = [p.grad.double().norm() for p in pl_module.parameters() if p.grad is not None]
        squares = sum(float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2 for n in norms)
        self.callback_norms.append(squares**0.5)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.losses.append(float(m["train/loss"]))
        self.grad_norms.append(float(m["train/grad_norm"]))
        self.steps.append(trainer.global_step)
        # Gradients after clipping are still there (zeroed at the next step): their global norm.
        self.clipped_norms.append(float(total_grad_norm(pl_module.model.parameters())))
        self.batches.append(batch["input_ids"].tolist())


def tiny_config(
    vocab_size: int = 50257, tie: bool = False, moe: bool = False, num_experts: int = 8, top_k: int = 2
) -> ModelConfig:
    """The model every distributed test trains: dim 64, 2 layers, GQA; with ``moe`` every block has
    ``num_experts`` experts (top-``top_k``, sigmoid router with bias balancing, one shared expert, sequence-wise
    aux and z losses: both are means over sequences / tokens, so they do not depend on how the batch is split
    over ranks)."""
    moe_fields = dict(num_experts=num_experts, top_k=top_k, n_shared_experts=1, router="sigmoid",
                      bias_update_rate=0.01, seq_aux_loss_weight=0.01, z_loss_weight=0.001)  # fmt: skip
    return ModelConfig(
        **(moe_fields if moe else {}),
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=vocab_size,
        max_seq_len=64,
        multiple_of=32,
        rope_theta=10000.0,
        tie_embeddings=tie,
    )


def _expert_bytes(model: torch.nn.Module) -> dict:
    """Every rank's bytes of routed-expert weights (``experts.w1/w2/w3``) and the global total. A rank's bytes
    are its shards' storage: FSDP2's padded buffer, so a rank holding only padding counts what it holds."""
    experts = [p for n, p in model.named_parameters() if ".experts.w" in n]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in experts)
    per_rank = [local]
    if torch.distributed.is_initialized():
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, local)
    return {"local": per_rank, "global": sum(p.numel() * p.element_size() for p in experts)}


def _expert_layout(model: torch.nn.Module) -> list[dict]:
    """Every rank's layout of the first MoE layer's ``experts.w1``: the DTensor mesh axes and placements, and the
    global expert ids and ``hidden`` rows this rank stores (:func:`~kempnerforge.parallel.dtensor.shard_indices`)."""
    w1 = next(p for n, p in model.named_parameters() if n.endswith(".experts.w1"))
    experts, rows, _ = shard_indices(w1)
    mine = {
        "mesh": list(w1.device_mesh.mesh_dim_names) if isinstance(w1, DTensor) else None,
        "placements": [str(p) for p in w1.placements] if isinstance(w1, DTensor) else None,
        "experts": experts.tolist(),
        "rows": rows.tolist(),
    }
    if not torch.distributed.is_initialized():
        return [mine]
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


def _with_fuse(cfg: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """``cfg`` with both fused projections on (``--fuse``) or off (``--no-fuse``); neither: the config's default."""
    if args.fuse is None:
        return cfg
    return dataclasses.replace(cfg, fuse_qkv=args.fuse, fuse_w13=args.fuse)


def fit(args: argparse.Namespace, ckpt_dir: str | None, ckpt_path: str | None):
    """One ``Trainer.fit`` of the tiny model under the strategy the arguments describe; returns (trainer, module,
    recorder). Checkpoints go to ``ckpt_dir`` (None: none); ``ckpt_path`` resumes."""
    seed_everything(0, workers=True)
    # CUDA: some kernels (SDPA backward, embedding backward) have no deterministic variant; warn only.
    torch.use_deterministic_algorithms(True, warn_only=args.accelerator != "cpu")
    module = CausalLM(
        config=_with_fuse(
            tiny_config(tie=args.tie, moe=args.moe, num_experts=args.num_experts, top_k=args.top_k), args
        ),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=5, total_steps=40),
        grad_clip=1.0,
        loss_chunk_size=args.loss_chunk_size,
        loss_impl=args.loss_impl,
    )
    data = TokenDataModule(
        data_dir=args.data, seq_len=args.seq_len, micro_batch_size=args.micro_batch, val_fraction=0.1, data_seed=0
    )
    if args.stream_jsonl:
        tokenizer = os.path.join(os.path.dirname(__file__), "..", "..", "data", "tokenizers", "gpt2")
        spec = {"path": "json", "data_files": args.stream_jsonl}
        data = StreamingTokenDataModule(spec, tokenizer, seq_len=args.seq_len, micro_batch_size=args.micro_batch)
    recorder = Recorder()
    callbacks = [recorder]
    if ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="step={step:04d}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
            )
        )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(
            dp_shard=args.dp_shard,
            dp_replicate=args.dp_replicate,
            tp=args.tp,
            ep=args.ep,
            sequence_parallel=args.sequence_parallel,
            loss_parallel=not args.no_loss_parallel,
            activation_checkpointing=args.ac,
            ac_every_n=args.ac_every_n,
            compile=args.compile,
            compile_backend=args.compile_backend,
            float8_recipe=args.float8,
            float8_all_gather=args.float8_all_gather,
            mixed_precision_param=args.param_dtype,
        ),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, recorder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--then-resume", default=None, help="then resume this checkpoint in the same processes")
    p.add_argument("--tie", action="store_true")
    p.add_argument("--ac", default="none", help="activation_checkpointing mode")
    p.add_argument("--ac-every-n", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="per-block torch.compile")
    p.add_argument("--compile-backend", default="inductor", help="compile_backend (aot_eager: no code generation)")
    p.add_argument("--float8", default=None, help="float8_recipe (tests/gpu)")
    p.add_argument("--float8-all-gather", action="store_true")
    p.add_argument("--param-dtype", default="float32", help="mixed_precision_param")
    p.add_argument("--accelerator", default="cpu", help="cpu (gloo) or cuda (nccl, tests/gpu)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None, help="fuse_qkv and fuse_w13")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--moe", action="store_true", help="train the MoE variant of the tiny model")
    p.add_argument("--num-experts", type=int, default=8, help="with --moe")
    p.add_argument("--top-k", type=int, default=2, help="with --moe")
    p.add_argument("--loss-chunk-size", type=int, default=0, help="CausalLM.loss_chunk_size (0: the default size)")
    p.add_argument("--loss-impl", default="auto", help="CausalLM.loss_impl (auto: chunked at tp=1 and pp=1)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--no-loss-parallel", action="store_true")
    p.add_argument("--record-batches", default=None, help="folder: each rank writes its batches as JSON")
    p.add_argument(
        "--stream-jsonl", default=None, help="stream this jsonl (StreamingTokenDataModule) instead of --data"
    )
    args = p.parse_args()
    trainer, module, recorder = fit(args, args.ckpt_dir, args.resume)
    record = {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "steps": recorder.steps,
        "clipped_norms": recorder.clipped_norms,
        "expert_bytes": _expert_bytes(module.model) if args.moe else None,
        "expert_layout": _expert_layout(module.model) if args.moe else None,
        "callback_norms": recorder.callback_norms,
    }
    if args.then_resume:  # a fresh module and Trainer in the same processes (saves a launch)
        _, _, resumed = fit(args, None, args.then_resume)
        record["resumed"] = {"losses": resumed.losses, "grad_norms": resumed.grad_norms, "steps": resumed.steps}
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    if args.record_batches:
        coords = trainer.strategy.parallel_mesh.coordinates()
        with open(os.path.join(args.record_batches, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"coords": coords, "batches": recorder.batches}, f)


if __name__ == "__main__":
    main()
