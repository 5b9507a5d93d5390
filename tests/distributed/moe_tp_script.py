"""MoE training runs under tensor (and expert) parallelism, several per launch (each launch costs ~10 s).

``--runs`` lists runs as ``name:key=value,...``; keys: ``router`` (sigmoid: the tiny MoE of ``train_script``,
DeepSeek-V3 style with bias balancing and one shared expert; softmax: Qwen-MoE style, a gated shared expert, only
layer 1 MoE so a dense and an MoE block share the plan; chain: the all-on model of issue 19 check 4, see
:data:`CHAIN`), ``tp``, ``ep``, ``sp`` (sequence parallel), ``lp`` (loss parallel, default 1), ``micro_batch``,
``f8`` (a float8 recipe), ``ac`` (activation checkpointing mode), ``compile`` (1: per-block compile) with
``backend`` (default ``aot_eager``), ``device`` (``cpu`` or ``cuda``) and ``param`` (``mixed_precision_param``).
Each run is one ``Trainer.fit`` of 5 steps on a global batch of 8 x 32 tokens, fp32 on gloo unless set; rank 0
writes ``{name: {"losses", "grad_norms", "expert_bytes", "placements", "float8", "compiled"}}`` to ``--out``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.tensor import DTensor

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from kempnerforge.training.optimizers import OptimizerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.* under torchrun
from tests.distributed import multi_run  # noqa: E402
from tests.distributed.train_script import Recorder, _expert_bytes, tiny_config  # noqa: E402

INT_KEYS = ("tp", "ep", "sp", "lp", "micro_batch", "compile")


def chain_config():
    """Issue 19 check 4's model: dim 32, 2 heads of 16, SwiGLU and expert width 32 (every dense Linear's TP shard
    is 16 x 32 or 32 x 16: torchao converts only dims that are multiples of 16), block 0 dense and block 1 MoE
    (4 experts, top-2, sigmoid router with bias balancing, one shared expert, sequence aux and z losses)."""
    return dataclasses.replace(
        tiny_config(moe=True, num_experts=4), dim=32, n_heads=2, n_kv_heads=2, ffn_hidden_dim=32, moe_frequency=2
    )


def model_config(router: str):
    """The sigmoid (every block MoE, shared expert) or softmax (block 1 MoE, gated shared expert) tiny MoE."""
    if router == "chain":
        return chain_config()
    if router == "dense":
        return dataclasses.replace(chain_config(), num_experts=0, n_shared_experts=0)
    cfg = tiny_config(moe=True)
    if router == "softmax":
        cfg = dataclasses.replace(cfg, router="softmax", bias_update_rate=0.0, shared_expert_gate=True, moe_frequency=2)
    return cfg


def _placements(model: torch.nn.Module) -> dict[str, str]:
    """Placements of the MoE block's parameters (``layers.1.moe.*``, AC wrapper dropped): what the TP / EP plan
    really did."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("._checkpoint_wrapped_module", "")
        if name.startswith("layers.1.moe."):
            out[name] = str(tuple(p.placements)) if isinstance(p, DTensor) else "plain"
    return out


def run(opts: dict, data: str) -> dict:
    seed_everything(0, workers=True)
    module = CausalLM(
        config=model_config(opts.get("router", "sigmoid")),
        optimizer=OptimizerConfig(lr=3e-3),
        scheduler=SchedulerConfig(warmup_steps=5, total_steps=40),
        grad_clip=1.0,
    )
    datamodule = TokenDataModule(
        data_dir=data, seq_len=32, micro_batch_size=opts.get("micro_batch", 8), val_fraction=0.1, data_seed=0
    )
    recorder = Recorder()
    trainer = Trainer(
        accelerator=opts.get("device", "cpu"),
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=KempnerStrategy(
            tp=opts.get("tp", 1),
            ep=opts.get("ep", 1),
            sequence_parallel=opts.get("sp", 0) == 1,
            loss_parallel=opts.get("lp", 1) == 1,
            float8_recipe=opts.get("f8"),
            activation_checkpointing=opts.get("ac", "none"),
            compile=opts.get("compile", 0) == 1,
            compile_backend=opts.get("backend", "aot_eager"),
            mixed_precision_param=opts.get("param", "auto"),
        ),
        max_steps=5,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module, datamodule=datamodule)
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "expert_bytes": _expert_bytes(module.model),
        "placements": _placements(module.model),
        "float8": _float8_linears(module.model),
        "compiled": _compiled(module.model),
    }


def _float8_linears(model: torch.nn.Module) -> list[str]:
    """FQNs (activation-checkpoint wrapper dropped) of the Linears FP8 converted."""
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    return [n.replace("._checkpoint_wrapped_module", "") for n in names]


def _compiled(model: torch.nn.Module) -> list[str]:
    """FQNs (wrapper dropped) of the modules compiled in place (``nn.Module.compile``)."""
    names = [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    return [n.replace("._checkpoint_wrapped_module", "") for n in names]


def main() -> None:
    """The shared multi-run command line (:func:`tests.distributed.multi_run.main`)."""
    multi_run.main(lambda name, opts, args: run(opts, args.data), INT_KEYS)


if __name__ == "__main__":
    main()
