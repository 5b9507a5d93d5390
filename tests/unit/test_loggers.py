"""Loggers selected in YAML (TensorBoard, W&B offline, MLflow sqlite) receive train/loss; values are read
back from each store and compared with what the trainer logged; the W&B run id survives a resume."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback

from kempnerforge.cli import WANDB_RUN_ID_FILE, KForgeCLI
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

RECORDED: list[float] = []


class RecordLoss(Callback):
    """The oracle: train/loss as the trainer logged it, one value per optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        RECORDED.append(float(trainer.callback_metrics["train/loss"]))


def _config(tmp_path: Path, tokens: Path, max_steps: int) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": max_steps,
            "log_every_n_steps": 1,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {"class_path": "kempnerforge.strategies.KempnerStrategy"},
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": str(tmp_path / "tb"), "name": "run"},
                },
                {
                    "class_path": "lightning.pytorch.loggers.WandbLogger",
                    "init_args": {"save_dir": str(tmp_path / "wb"), "offline": True, "project": "kforge-test"},
                },
                {
                    "class_path": "lightning.pytorch.loggers.MLFlowLogger",
                    "init_args": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment_name": "kforge"},
                },
            ],
            "callbacks": [
                {"class_path": "kempnerforge.callbacks.MFUMonitor", "init_args": {"window": 1}},
                {"class_path": "kempnerforge.callbacks.MemoryMonitor", "init_args": {"every_n_steps": 1}},
                {"class_path": "tests.unit.test_loggers.RecordLoss"},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(tmp_path / "ckpt"),
                        "filename": "step={step:06d}",
                        "auto_insert_metric_name": False,
                        "every_n_train_steps": 2,
                        "save_top_k": -1,
                    },
                },
            ],
        },
        "model": {
            "config": {
                "dim": 32,
                "n_layers": 1,
                "n_heads": 2,
                "vocab_size": 50257,
                "max_seq_len": 32,
                "multiple_of": 16,
            },
            "scheduler": {"warmup_steps": 1, "total_steps": 6},
        },
        "data": {"data_dir": str(tokens), "seq_len": 32, "micro_batch_size": 2, "num_workers": 0},
    }
    path = tmp_path / f"run{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wandb_records(path: Path) -> list:
    """Records of an offline ``run-<id>.wandb`` file (LevelDB log format: 32 KiB blocks of
    [crc32, length, type] + payload chunks, after a 7-byte ':W&B' header), parsed as W&B protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def _wandb_history(run_file: Path) -> tuple[set[str], list[dict]]:
    ids, rows = set(), []
    for r in _wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            ids.add(r.run.run_id)
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return ids, rows


def test_tensorboard_wandb_mlflow_from_yaml_and_wandb_resume(tmp_path, shakespeare_tokens, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    RECORDED.clear()
    KForgeCLI(CausalLM, TokenDataModule, args=["fit", "--config", str(_config(tmp_path, shakespeare_tokens, 4))])
    first = list(RECORDED)
    import wandb

    wandb.finish()  # as a new process would: WandbLogger otherwise reuses the live wandb.run
    KForgeCLI(
        CausalLM,
        TokenDataModule,
        args=["fit", "--config", str(_config(tmp_path, shakespeare_tokens, 6)), "--ckpt_path", str(tmp_path / "ckpt")],
    )
    wandb.finish()  # flush the offline run file before reading it
    assert len(first) == 4 and len(RECORDED) == 6

    # TensorBoard: one version per run; scalars in step order.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = []
    for version in sorted((tmp_path / "tb" / "run").iterdir()):
        acc = EventAccumulator(str(version))
        acc.Reload()
        tb += [e.value for e in acc.Scalars("train/loss")]
        mfu = [e.value for e in acc.Scalars("train/mfu")]
        assert mfu and all(0 < v < 1 for v in mfu)  # MFUMonitor's values reach every logger too
    assert tb == pytest.approx(RECORDED, rel=1e-6)  # TensorBoard stores float32

    # W&B offline: both runs append to the same run id, the one kept in save_dir.
    run_id = (tmp_path / "wb" / WANDB_RUN_ID_FILE).read_text().strip()
    run_files = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2
    wb, steps = [], []
    for f in run_files:
        ids, rows = _wandb_history(f)
        assert ids == {run_id}
        wb += [r["train/loss"] for r in rows if "train/loss" in r]
        steps += [r["trainer/global_step"] for r in rows if "train/loss" in r]
    assert wb == pytest.approx(RECORDED, rel=1e-12)
    assert steps == sorted(steps) and steps[4] > steps[3]  # the resumed run continues the step axis

    # MLflow (sqlite store): one run per fit, values by step.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "kforge"]
    runs = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    ml = []
    for run in runs:
        ml += [m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert ml == pytest.approx(RECORDED, rel=1e-12)
