"""Per-block compile of dense blocks through the real loop (Trainer + KempnerStrategy + FSDP2 + CausalLM).

A tiny dense decoder trained 5 AdamW steps eagerly and with ``compile=True`` from the same weights: the step
losses agree within 1e-5 (fp32, and bf16 parameters, with which FSDP2 wraps the blocks even at world size 1),
and after the first step nothing recompiles: one graph for all blocks (they share ``TransformerBlock.forward``
and dynamo's ``inline_inbuilt_nn_modules`` makes parameters graph inputs, so FSDP2's per-step unsharded
parameters, the per-call RoPE tensor and ``key_mask=None`` add no guard that fails), no graph breaks, no
recompilation. With full and op-level selective activation checkpointing too (the checkpoint wrapper is
compiled with the block). Backend ``aot_eager``: dynamo capture and AOT autograd without inductor's code
generation (minutes cold on 2 cores); inductor's numerics are checked by benchmarks/compile_parts.py and
benchmarks/cpu_throughput.py --compile (max|dL|).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy

STEPS = 5
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16)


class _Record(Callback):
    """Step losses, and dynamo's counters after the first step (its compilation) and at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.after_first: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if batch_idx == 0:
            self.after_first = _snapshot()


def _snapshot() -> dict[str, int]:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
    }


def _fit(compile: bool, ac: str, param_dtype: str = "auto") -> _Record:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (4 * STEPS, 17), generator=g)
    batches = [{"input_ids": r[:-1], "labels": r[1:]} for r in ids]
    record = _Record()
    strategy = KempnerStrategy(compile=compile, compile_backend="aot_eager", activation_checkpointing=ac,
                               mixed_precision_param=param_dtype)  # fmt: skip
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])  # fmt: skip
    counters.clear()
    trainer.fit(CausalLM(CFG, init_seed=0), train_dataloaders=DataLoader(batches, batch_size=4))
    return record


_EAGER: dict[str, _Record] = {}


@pytest.mark.parametrize(
    ("ac", "param_dtype"),
    [
        ("none", "auto"),
        ("full", "auto"),
        ("selective_op", "auto"),  # the cluster recipes' AC
        # bf16 parameters: FSDP2 wraps even at world size 1 (its MixedPrecisionPolicy casts), so its per-block
        # hooks run around the compiled blocks.
        ("none", "bfloat16"),
    ],
)
def test_compiled_blocks_equal_eager_and_compile_once(ac, param_dtype):
    if param_dtype not in _EAGER:
        _EAGER[param_dtype] = _fit(compile=False, ac="none", param_dtype=param_dtype)
    eager = _EAGER[param_dtype]
    compiled = _fit(compile=True, ac=ac, param_dtype=param_dtype)
    assert len(compiled.losses) == len(eager.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(compiled.losses, eager.losses, strict=True)) < 1e-5
    assert compiled.after_first == {"graphs": 1, "breaks": 0, "recompiles": 0}  # one graph serves both blocks
    assert _snapshot() == compiled.after_first  # steps 2..5 compiled nothing new
