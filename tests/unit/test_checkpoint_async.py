"""Async DCP saves inside a real (1-rank) fit: a complete checkpoint exists at every step after the first save
with Lightning's default save_top_k=1, and retention prunes once per completed save, never per step."""

from __future__ import annotations

import time

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import kempnerforge.checkpoint.retention as retention
from kempnerforge.callbacks import CheckpointRetention
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.resilience.auto_resume import find_resume_checkpoint
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from tests.ops_helpers import tiny_config

STEPS, EVERY = 8, 2


@pytest.fixture
def slow_upload(monkeypatch):
    """Each DCP write takes 0.3 s longer (on DCP's upload thread): saves are still pending a step later."""
    write = FileSystemWriter.write_data

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow)


class ResumableAtEveryStep(Callback):
    """Records, at every step boundary, the checkpoint an auto-resume would pick right then."""

    def __init__(self, folder) -> None:
        self.folder, self.seen = folder, []

    def on_train_batch_end(self, trainer, *args) -> None:
        found = find_resume_checkpoint(self.folder)
        self.seen.append((trainer.global_step, found.name if found else None))


def _fit(tmp_path, data_dir, *callbacks) -> None:
    seed_everything(0)
    module = CausalLM(tiny_config("dense"), scheduler=SchedulerConfig(warmup_steps=1, total_steps=STEPS))
    data = TokenDataModule(str(data_dir), seq_len=32, micro_batch_size=2, val_fraction=0.05)
    Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(async_checkpoint=True),
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    ).fit(module, datamodule=data)


def test_async_save_top_k_1_always_leaves_a_complete_checkpoint(tmp_path, shakespeare_tokens, slow_upload):
    folder = tmp_path / "ckpt"
    watch = ResumableAtEveryStep(folder)
    ckpt = ModelCheckpoint(
        dirpath=folder, filename="step={step:04d}", auto_insert_metric_name=False, every_n_train_steps=EVERY
    )  # fmt: skip  (save_top_k=1, Lightning's default)
    _fit(tmp_path, shakespeare_tokens, watch, ckpt)
    names = [name for _, name in watch.seen]
    first = next((i for i, name in enumerate(names) if name is not None), len(names))
    # Once a save has completed there is always one to resume from. Before, ModelCheckpoint's removal of the
    # previous checkpoint ran at once, leaving only a .partial (and `latest` naming a deleted folder).
    assert None not in names[first:] and len(names) - first >= 3, watch.seen
    assert sorted(p.name for p in folder.iterdir()) == ["latest", f"step={STEPS:04d}.ckpt"]


def test_retention_prunes_after_each_completed_save_not_every_step(
    tmp_path, shakespeare_tokens, slow_upload, monkeypatch
):
    listings = []
    listed = retention.complete_checkpoints
    monkeypatch.setattr(retention, "complete_checkpoints", lambda d: listings.append(d) or listed(d))
    folder = tmp_path / "ckpt"
    ckpt = ModelCheckpoint(dirpath=folder, filename="step={step:04d}", auto_insert_metric_name=False,
                           every_n_train_steps=EVERY, save_top_k=-1)  # fmt: skip
    _fit(tmp_path, shakespeare_tokens, CheckpointRetention(keep_last=2), ckpt)
    assert len(listings) == STEPS // EVERY  # one folder listing per completed save
    assert sorted(p.name for p in folder.glob("*.ckpt")) == [f"step={STEPS - EVERY:04d}.ckpt", f"step={STEPS:04d}.ckpt"]


def test_staging_buffers_are_allocated_in_the_background_after_the_first_step(
    tmp_path, shakespeare_tokens, monkeypatch
):
    """Issue 30, item 4: every host staging buffer is allocated once, on the checkpoint worker after the first
    optimizer step, so the training thread's stall at every save (the first included) is the copy alone; the
    saves still write the step's values (the last checkpoint restores the final weights)."""
    import threading

    import torch
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    from kempnerforge.checkpoint.load import load_checkpoint_model

    allocations: list[str] = []  # the thread of every new staging storage
    stages: list[str] = []
    stage_storage = StateDictStager._stage_untyped_storage
    stage = StateDictStager.stage

    def counted_storage(self, storage, *args, **kwargs):
        if storage not in self._cached_storage_mapping:
            allocations.append(threading.current_thread().name)
        return stage_storage(self, storage, *args, **kwargs)

    def counted_stage(self, *args, **kwargs):
        stages.append(threading.current_thread().name)
        return stage(self, *args, **kwargs)

    monkeypatch.setattr(StateDictStager, "_stage_untyped_storage", counted_storage)
    monkeypatch.setattr(StateDictStager, "stage", counted_stage)
    finals = {}

    class Final(Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            finals.update({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()})

    folder = tmp_path / "ckpt"
    ckpt = ModelCheckpoint(dirpath=folder, filename="step={step:04d}", auto_insert_metric_name=False,
                           every_n_train_steps=EVERY, save_top_k=-1)  # fmt: skip
    _fit(tmp_path, shakespeare_tokens, ckpt, Final())
    main = threading.main_thread().name
    assert stages[0].startswith("kforge-checkpoint") and stages[1:] == [main] * (STEPS // EVERY), stages
    assert allocations and set(allocations) == {stages[0]}, allocations  # none on the training thread
    loaded = load_checkpoint_model(folder / f"step={STEPS:04d}.ckpt").model.state_dict()
    assert all(torch.equal(loaded[k], finals[k]) for k in finals if not k.startswith("rope")), "saved values"
