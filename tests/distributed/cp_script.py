"""Context-parallel training runs (issue 26), several per launch (each launch costs a rendezvous and imports).

``--runs`` lists runs as ``name:key=value,...``; keys: ``cp``, ``tp``, ``pp`` (pipeline stages, their default
schedule), ``ep``, ``sp`` (sequence parallel), ``dp_shard``,
``micro_batch`` (per data shard; default 8 / data shards), ``steps`` (default 5), ``docs`` (1: packed documents,
``document_masking``), ``ac`` (activation checkpointing mode), ``compile`` (1: per-block compile, ``aot_eager``),
``moe`` (1: the tiny MoE, ep=1), ``mla`` (1: multi-head latent attention), ``seq`` (tokens per sequence, default 32),
``save`` (save a checkpoint every N steps under ``--ckpt-root/<name>``), ``resume`` (a run name: resume its
checkpoint ``step=<resume_step>``). The data folder is ``--data``, or ``--docs`` with ``docs=1``. Rank 0 writes
``{name: {"losses", "grad_norms", "steps", "tokens_seen"}}`` to ``--out``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from kempnerforge.data.datamodule import TokenDataModule  # noqa: E402
from kempnerforge.module import CausalLM  # noqa: E402
from kempnerforge.strategies import KempnerStrategy  # noqa: E402
from kempnerforge.training.lr import SchedulerConfig  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig  # noqa: E402
from tests.distributed import multi_run  # noqa: E402
from tests.distributed.train_script import Recorder, tiny_config  # noqa: E402

INT_KEYS = (
    "cp",
    "tp",
    "pp",
    "ep",
    "sp",
    "dp_shard",
    "dp_replicate",
    "micro_batch",
    "steps",
    "docs",
    "compile",
    "moe",
    "mla",
    "seq",
    "save",
)
GLOBAL_BATCH = 8


def model_config(opts: dict):
    """The tiny decoder of ``train_script`` (dense, MoE, or with MLA), max_seq_len 64 (or ``seq``)."""
    cfg = tiny_config(moe=bool(opts.get("moe")))
    if opts.get("moe"):  # the sequence-wise aux loss is a per-sequence statistic: not split by cp (refused)
        cfg = dataclasses.replace(cfg, seq_aux_loss_weight=0.0)
    if opts.get("mla"):
        cfg = dataclasses.replace(
            cfg,
            attention="mla",
            n_kv_heads=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
    return dataclasses.replace(cfg, max_seq_len=max(64, opts.get("seq", 32)))


def run(name: str, opts: dict, args) -> dict:
    seed_everything(0, workers=True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp, tp, pp = opts.get("cp", 1), opts.get("tp", 1), opts.get("pp", 1)
    shards = world // (cp * tp * pp)
    module = CausalLM(
        config=model_config(opts),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=5, total_steps=40),
        grad_clip=1.0,
    )
    data = TokenDataModule(
        data_dir=args.docs if opts.get("docs") else args.data,
        seq_len=opts.get("seq", 32),
        micro_batch_size=opts.get("micro_batch", GLOBAL_BATCH // shards),
        val_fraction=0.1,
        data_seed=0,
        document_masking=bool(opts.get("docs")),
    )
    recorder = Recorder()
    callbacks = [recorder]
    ckpt_dir = Path(args.ckpt_root) / name
    if opts.get("save"):
        every = opts["save"]
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="step={step}", every_n_train_steps=every,
                                         save_top_k=-1, auto_insert_metric_name=False))  # fmt: skip
    strategy = KempnerStrategy(
        cp=cp,
        tp=tp,
        pp=pp,
        dp_shard=opts.get("dp_shard", -1),
        dp_replicate=opts.get("dp_replicate", 1),
        ep=opts.get("ep", 1),
        sequence_parallel=bool(opts.get("sp")),
        activation_checkpointing=opts.get("ac", "none"),
        compile=bool(opts.get("compile")),
        compile_backend="aot_eager",
        mixed_precision_param="float32",
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=opts.get("steps", 5),
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(opts.get("save")),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    ckpt = None
    if "resume" in opts:
        ckpt = str(Path(args.ckpt_root) / opts["resume"] / f"step={opts['resume_step']}.ckpt")
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "steps": recorder.steps,
            "tokens_seen": module.tokens_seen}  # fmt: skip


def _main() -> None:
    # --docs: a second token folder (packed documents), read by runs with docs=1.
    docs = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--docs"), None)
    if docs is not None:
        i = sys.argv.index("--docs")
        del sys.argv[i : i + 2]

    def with_docs(name, opts, args):
        args.docs = docs
        return run(name, opts, args)

    multi_run.main(with_docs, INT_KEYS, ckpt_root=True)


if __name__ == "__main__":
    _main()
