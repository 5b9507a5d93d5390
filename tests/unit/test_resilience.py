"""Resilience pieces on their own: signal flag, requeue, watchdog, auto-resume, retention, SLURM detection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer

from kempnerforge.checkpoint.dcp_io import COMPLETE_FILE, LATEST_FILE
from kempnerforge.checkpoint.retention import PROTECTED_FILE, protect, prune_checkpoints
from kempnerforge.resilience.auto_resume import find_resume_checkpoint
from kempnerforge.resilience.requeue import requeue_slurm_job, slurm_job_id
from kempnerforge.resilience.signals import SignalFlag, agree_any, parse_signal
from kempnerforge.resilience.watchdog import Watchdog
from tests.slurm_env import slurm_task_env


def _ckpt(folder, step, complete=True):
    path = folder / f"step={step:06d}.ckpt"
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE_FILE).write_text("")
    os.utime(path, (step, step))  # mtime orders checkpoints
    return path


def test_signal_flag_only_records_and_restores_previous_handler():
    before = signal.getsignal(signal.SIGUSR1)
    flag = SignalFlag(["usr1"])
    flag.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert flag.received == signal.SIGUSR1
    assert agree_any(flag.received is not None) is True and agree_any(False) is False
    flag.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_bad_signal_name_is_refused():
    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal"):
        parse_signal("SIGNOPE")


def test_requeue_calls_scontrol_with_the_job_id(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert requeue_slurm_job() is True
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "70_3"
    assert requeue_slurm_job() is True
    assert calls.read_text().splitlines() == ["requeue 77", "requeue 70_3"]
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    assert requeue_slurm_job() is False


def test_watchdog_cancel_and_validation():
    dog = Watchdog(0.05)
    dog.start()
    dog.cancel()
    time.sleep(0.1)  # a cancelled watchdog does not end the process
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        Watchdog(0)


def test_auto_resume_takes_latest_skips_incomplete_and_starts_fresh(tmp_path):
    assert find_resume_checkpoint(tmp_path / "none") is None
    assert find_resume_checkpoint(None) is None
    a = _ckpt(tmp_path, 4)
    _ckpt(tmp_path, 8, complete=False)  # killed after the rename but without marker: never chosen
    (tmp_path / "step=000012.ckpt.partial").mkdir()
    assert find_resume_checkpoint(tmp_path) == a
    (tmp_path / LATEST_FILE).write_text("step=000008.ckpt\n")  # names an incomplete one: ignored
    assert find_resume_checkpoint(tmp_path) == a
    b = _ckpt(tmp_path, 16)
    (tmp_path / LATEST_FILE).write_text(b.name + "\n")
    assert find_resume_checkpoint(tmp_path) == b


def test_retention_keeps_last_n_latest_and_protected(tmp_path):
    paths = [_ckpt(tmp_path, s) for s in (1, 2, 3, 4, 5)]
    partial = tmp_path / "step=000006.ckpt.partial"
    partial.mkdir()
    (tmp_path / LATEST_FILE).write_text(paths[0].name)  # e.g. pointer not yet moved: never deleted
    protect(tmp_path, paths[1].name)  # last healthy before a NaN
    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert deleted == [paths[2]]
    assert (tmp_path / PROTECTED_FILE).read_text() == paths[1].name + "\n"
    assert partial.is_dir()
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        prune_checkpoints(tmp_path, 0)


def test_lightning_picks_slurm_environment_with_right_ranks(monkeypatch):
    env = slurm_task_env(rank=1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    assert isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)
    assert (trainer.global_rank, trainer.local_rank, trainer.world_size) == (1, 1, 2)


def test_watchdog_ends_a_stalled_process():
    code = "from kempnerforge.resilience.watchdog import Watchdog; import time; Watchdog(0.2, exit_code=3).start(); time.sleep(30)"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 3 and time.monotonic() - start < 25
