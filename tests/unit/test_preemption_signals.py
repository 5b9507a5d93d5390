"""Issue 18, check 6: with KempnerStrategy and the Preemption callback, the signal handlers from before ``fit`` are
back after it (Lightning's ``test_signal_handlers_restored_in_teardown``, tests/tests_pytorch/trainer/connectors/
test_signal_connector.py, on a whole ``fit`` and under SLURM, where Lightning adds its own SIGUSR1 handler), and a
user's SIGTERM handler installed before ``fit`` still runs while the run saves and stops.

Runs in-process at world size 1 (the flag's agreement across ranks is tests/e2e/test_preemption.py's).
"""

from __future__ import annotations

import os
import signal
import socket

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.callbacks import Preemption
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.resilience.signals import SignalFlag
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.lr import SchedulerConfig
from tests.ops_helpers import tiny_config
from tests.slurm_env import slurm_task_env

STEPS = 6


class SignalAt(Callback):
    """Sends ``signum`` to this process at the start of batch ``batch``; records the handlers seen during training."""

    def __init__(self, signum: int, batch: int) -> None:
        self.signum, self.batch, self.during = signum, batch, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.during = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _fit(tmp_path, data_dir, *callbacks, plugins=None) -> Trainer:
    seed_everything(0)
    module = CausalLM(tiny_config("dense"), scheduler=SchedulerConfig(warmup_steps=1, total_steps=STEPS))
    data = TokenDataModule(str(data_dir), seq_len=32, micro_batch_size=2, val_fraction=0.05)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="step={step:06d}", auto_insert_metric_name=False,
                           every_n_train_steps=100)  # fmt: skip
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(),
        plugins=plugins,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[*callbacks, ckpt],
    )
    trainer.fit(module, datamodule=data)
    return trainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_signal_handlers_restored_in_teardown_under_slurm(tmp_path, shakespeare_tokens, monkeypatch, restore_handlers):
    """Lightning's test, on a whole fit: before fit SIGTERM and SIGUSR1 have their default handlers; during training
    Preemption's flag handles both (not Lightning's SLURM handler, which saves inside the handler); SIGUSR1 saves
    one checkpoint through Preemption and no hpc checkpoint; after fit the defaults are back."""
    for key, value in {**slurm_task_env(rank=0, ntasks=1), "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    preemption, sender = Preemption(check_every_s=0), SignalAt(signal.SIGUSR1, batch=2)
    trainer = _fit(tmp_path, shakespeare_tokens, preemption, sender, plugins=[SLURMEnvironment(auto_requeue=True)])
    assert isinstance(trainer._accelerator_connector.cluster_environment, SLURMEnvironment)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        handler = sender.during[signum]
        assert getattr(handler, "__self__", None) is preemption.flag, (signum, handler)
    assert trainer.global_step == 3 and preemption.saved_path == tmp_path / "ckpt" / "step=000003.ckpt"
    assert (preemption.saved_path / "COMPLETE").is_file()
    assert not list(tmp_path.rglob("hpc_ckpt_*"))  # Lightning's SIGUSR1 handler never ran
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_user_sigterm_handler_still_runs_and_the_run_saves_and_stops(tmp_path, shakespeare_tokens, restore_handlers):
    calls = []

    def user_handler(signum, frame) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, user_handler)
    preemption = Preemption(signals=["SIGTERM"], check_every_s=0)
    trainer = _fit(tmp_path, shakespeare_tokens, preemption, SignalAt(signal.SIGTERM, batch=1))
    assert calls == [signal.SIGTERM]  # chained once, after the flag
    assert trainer.global_step == 2 and trainer.should_stop
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step=000002.ckpt"
    assert (tmp_path / "ckpt" / "step=000002.ckpt" / "COMPLETE").is_file()
    assert signal.getsignal(signal.SIGTERM) is user_handler  # what it was before fit
    assert not trainer.received_sigterm  # Lightning's SIGTERM path (kill the launcher's children) did not run


def test_the_flag_chains_a_handler_installed_before_and_skips_lightnings():
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    calls = []
    connector = _SignalConnector(Trainer(logger=False, enable_checkpointing=False))
    user = lambda signum, frame: calls.append(("user", signum))  # noqa: E731
    before = signal.signal(signal.SIGUSR1, _HandlersCompose([connector._sigterm_notifier_fn, user]))
    try:
        flag = SignalFlag(["SIGUSR1"])
        flag.install()  # installed after Lightning's composite handler: only the user's part is chained
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == signal.SIGUSR1 and calls == [("user", signal.SIGUSR1)]
        assert not connector.received_sigterm
        flag.restore()
        assert isinstance(signal.getsignal(signal.SIGUSR1), _HandlersCompose)
    finally:
        signal.signal(signal.SIGUSR1, before)
