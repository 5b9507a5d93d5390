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
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from kempnerforge.callbacks import NaNGuard, Preemption
from kempnerforge.cli import run_exit_status
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.exit_status import STOPPED_EARLY
from kempnerforge.module import CausalLM
from kempnerforge.parallel.mesh import MESH_AXES
from kempnerforge.resilience.signals import SignalFlag
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.strategies.stop_on_signal import _agreed_at_step_boundaries
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
            self.during = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
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
    # Lightning's flag says so after fit (set only then: during the loop it would raise SIGTERMException).
    assert trainer.received_sigterm and preemption.stop_status == STOPPED_EARLY


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_without_preemption_the_strategy_stops_on_a_signal_with_its_own_flag(
    tmp_path, shakespeare_tokens, restore_handlers, signum
):
    """No Preemption configured (NaNGuard, as kforge adds it): KempnerStrategy adds one, its flag (not Lightning's handler) takes every signal,
    Lightning's per-step SIGTERM broadcast is replaced, and the run saves through ModelCheckpoint's folder and
    stops with the "stopped early" status; Ctrl-C too (one SIGINT waits for the step boundary)."""
    before = signal.getsignal(signal.SIGINT)
    sender = SignalAt(signum, batch=1)
    trainer = _fit(tmp_path, shakespeare_tokens, NaNGuard(), sender)  # kforge's default NaNGuard carries the flag
    added = [cb for cb in trainer.callbacks if isinstance(cb, Preemption)]
    assert len(added) == 1 and added[0].save
    for handler in sender.during.values():
        assert getattr(handler, "__self__", None) is added[0].flag
    loop = trainer.fit_loop.epoch_loop
    assert loop._broadcast_sigterm_tensor is _agreed_at_step_boundaries  # Lightning's per-step broadcast is gone
    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")  # a Lightning rename must fail here
    assert run_exit_status(trainer) == STOPPED_EARLY
    assert trainer.global_step == 2 and (tmp_path / "ckpt" / "step=000002.ckpt" / "COMPLETE").is_file()
    assert trainer.received_sigterm == (signum == signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before


def test_setup_environment_without_a_module_as_lightnings_own_tests_do():
    """Lightning's ModelParallelStrategy tests set the environment up before any module is attached: the mesh is
    built from the degrees; the module's rules wait for setup."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = KempnerStrategy(dp_shard=1)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = CPUAccelerator()
    strategy.setup_environment()
    assert strategy.parallel_mesh is not None and strategy.device_mesh.mesh_dim_names == MESH_AXES
    assert strategy.lightning_module is None


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
