"""Issue 28, check 7, on the debug recipe through ``kforge fit``: ``trainer.precision=bf16-mixed`` trains with the same
losses as ``mixed_precision_param=bfloat16`` (one mechanism), and ``bf16-true`` writes a checkpoint whose weights
and optimizer moments are bf16 (fp32 under the mixed policy)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.e2e.inprocess import kforge_in_process

STEPS = 3


def _fit(tmp: Path, data: Path, *extra: str) -> tuple[dict[int, float], Path]:
    proc = kforge_in_process(
        "fit",
        "--config",
        "configs/debug.yaml",
        f"--data.data_dir={data}",
        "--data.seq_len=64",
        "--data.micro_batch_size=2",
        f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp / 'runs'}",
        f"--trainer.callbacks.init_args.dirpath={tmp / 'ckpt'}",
        f"--trainer.callbacks.init_args.every_n_train_steps={STEPS}",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = (tmp / "runs").rglob("metrics.csv")
    losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")}
    assert sorted(losses) == list(range(STEPS)), losses
    return losses, tmp / "ckpt" / f"step={STEPS:06d}.ckpt"


def _dtypes(ckpt: Path) -> dict[str, torch.dtype]:
    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in meta.items() if hasattr(v, "properties") and v.size and len(v.size) > 1}


@pytest.mark.slow
def test_bf16_mixed_equals_the_bf16_policy_and_bf16_true_holds_bf16_weights(tmp_path, shakespeare_tokens):
    mixed, mixed_ckpt = _fit(tmp_path / "mixed", shakespeare_tokens, "--trainer.precision=bf16-mixed")
    policy, _ = _fit(
        tmp_path / "policy", shakespeare_tokens, "--trainer.strategy.init_args.mixed_precision_param=bfloat16"
    )
    true, true_ckpt = _fit(tmp_path / "true", shakespeare_tokens, "--trainer.precision=bf16-true")
    assert mixed == pytest.approx(policy, rel=1e-6, abs=0)
    assert true[0] == pytest.approx(mixed[0], rel=1e-2)  # the same model and batch, another rounding
    weights = _dtypes(true_ckpt)
    assert weights and set(weights.values()) == {torch.bfloat16}, weights  # weights and Adam moments
    assert set(_dtypes(mixed_ckpt).values()) == {torch.float32}  # fp32 master weights under the mixed policy
    assert any(k.endswith("exp_avg_sq") for k in weights)
