"""Check 5: each resilience callback runs in a plain Lightning project (demo BoringModel, no KempnerStrategy)."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from kempnerforge.callbacks import CheckpointRetention, NaNGuard, Preemption, ProgressBar
from kempnerforge.callbacks.progress import read_scalars
from kempnerforge.resilience.nonfinite import NonFiniteError


def _trainer(tmp_path, *callbacks) -> Trainer:
    return Trainer(
        default_root_dir=tmp_path, fast_dev_run=True, accelerator="cpu", callbacks=list(callbacks), logger=False
    )


class _SignalAtFirstBatch(Callback):
    def on_train_batch_start(self, *args) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)


def test_preemption_saves_and_stops_in_plain_lightning(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption(signals=["SIGUSR1"])
    trainer = _trainer(tmp_path, _SignalAtFirstBatch(), preemption)
    trainer.fit(BoringModel())
    assert trainer.should_stop
    assert preemption.saved_path == tmp_path / "checkpoints" / "epoch=0-step=1.ckpt"  # ModelCheckpoint naming
    ckpt = torch.load(preemption.saved_path, weights_only=False)
    assert ckpt["global_step"] == 1
    assert signal.getsignal(signal.SIGUSR1) == before  # handlers restored at teardown


class _NaNModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"] * float("nan")}


def test_nan_guard_raise_names_the_step(tmp_path):
    with pytest.raises(NonFiniteError, match="at step 0"):
        _trainer(tmp_path, NaNGuard(action="raise")).fit(_NaNModel())


def test_nan_guard_skip_leaves_weights_untouched(tmp_path):
    model = _NaNModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard = NaNGuard(action="skip", check_grads=True)
    _trainer(tmp_path, guard).fit(model)
    assert guard.skipped_steps == [0]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_nan_guard_rejects_unknown_action():
    with pytest.raises(ValueError, match=r"action='retry' is not allowed; use one of \['raise', 'skip', 'rollback'\]"):
        NaNGuard(action="retry")


def test_checkpoint_retention_prunes_plain_ckpt_files(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    for step in range(4):
        path = folder / f"step={step}.ckpt"
        path.write_bytes(b"x")
        os.utime(path, (step, step))
    _trainer(tmp_path, CheckpointRetention(keep_last=2, dirpath=str(folder))).fit(BoringModel())
    assert sorted(p.name for p in folder.iterdir()) == ["step=2.ckpt", "step=3.ckpt"]
    with pytest.raises(ValueError, match="keep_last=0 must be an integer >= 1"):
        CheckpointRetention(keep_last=0)


def test_preemption_waits_for_the_optimizer_step_with_gradient_accumulation(tmp_path):
    preemption = Preemption(signals=["SIGUSR1"])
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accumulate_grad_batches=2,
        accelerator="cpu",
        callbacks=[_SignalAtFirstBatch(), preemption],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel())
    assert trainer.global_step == 1  # signalled at micro-batch 0, saved after micro-batch 1 (the step)
    assert preemption.saved_path == tmp_path / "checkpoints" / "step=000001.ckpt"
    assert torch.load(preemption.saved_path, weights_only=False)["global_step"] == 1


def test_preemption_save_is_not_repeated_by_model_checkpoint(tmp_path):
    # ModelCheckpoint runs after Preemption and saves at epoch end; Preemption marks the step as saved
    # (Lightning has no public API for that) so the same step is not written again as "...-v1.ckpt".
    preemption = Preemption(signals=["SIGUSR1"])
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        limit_val_batches=0,
        accelerator="cpu",
        callbacks=[_SignalAtFirstBatch(), preemption],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert trainer.global_step == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch=0-step=1.ckpt"]


class _Clock(Callback):
    """A fake ``time.monotonic`` advancing one second per training batch; signals at batch ``signal_at``."""

    def __init__(self, signal_at: int | None = None) -> None:
        self.now, self.signal_at = 0.0, signal_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.now += 1.0
        if batch_idx == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)


def _fit_with_agreements(tmp_path, monkeypatch, *callbacks, steps: int = 9) -> tuple[Trainer, list[int]]:
    """Fit BoringModel; return the trainer and the global steps at which Preemption reduced on its own."""
    import kempnerforge.callbacks.preemption as preemption_mod

    clock = next(cb for cb in callbacks if isinstance(cb, _Clock))
    monkeypatch.setattr(preemption_mod.time, "monotonic", lambda: clock.now)
    agreed_at: list[int] = []
    trainer = Trainer(default_root_dir=tmp_path, max_steps=steps, accelerator="cpu", callbacks=list(callbacks),
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    real = preemption_mod.agree_max

    def spy(values, device="cpu", group=None):
        agreed_at.append(trainer.global_step)
        return real(values, device, group)

    monkeypatch.setattr(preemption_mod, "agree_max", spy)
    trainer.fit(BoringModel())
    return trainer, agreed_at


def test_preemption_agrees_every_check_every_s_seconds_and_stops_at_the_next_agreement(tmp_path, monkeypatch):
    """1 s per step, check_every_s=3: the first agreement (step 1) measures the step time, then every 3rd
    step agrees (1, 4, 7); a signal during step 5 stops the run at step 7, with its checkpoint."""
    preemption = Preemption(signals=["SIGUSR1"], check_every_s=3.0)
    trainer, agreed_at = _fit_with_agreements(tmp_path, monkeypatch, _Clock(), preemption, steps=9)
    assert agreed_at == [1, 4, 7] and trainer.global_step == 9 and preemption.saved_path is None
    preemption = Preemption(signals=["SIGUSR1"], check_every_s=3.0)
    trainer, agreed_at = _fit_with_agreements(tmp_path, monkeypatch, _Clock(signal_at=4), preemption, steps=9)
    assert agreed_at == [1, 4, 7]  # batch 4 is step 5: agreed at the end of step 7
    assert trainer.global_step == 7 and preemption.saved_path == tmp_path / "checkpoints" / "step=000007.ckpt"
    with pytest.raises(ValueError, match=r"check_every_s=-1 must be >= 0 seconds \(0: every step\)"):
        Preemption(check_every_s=-1)


def test_preemption_rides_on_nan_guard_reduction_every_step(tmp_path, monkeypatch):
    """With a NaNGuard, the signal flag travels in its per-step reduction: no reduction of Preemption's
    own, and a signal during step 3 stops the run right after it even with check_every_s huge."""
    preemption = Preemption(signals=["SIGUSR1"], check_every_s=1e6)
    trainer, agreed_at = _fit_with_agreements(tmp_path, monkeypatch, _Clock(signal_at=2), NaNGuard(), preemption)
    assert agreed_at == []
    assert trainer.global_step == 3 and preemption.saved_path == tmp_path / "checkpoints" / "step=000003.ckpt"


class _LoggedLoss(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"].detach())  # a device tensor, not a prog_bar metric
        return out


@pytest.mark.parametrize("style", ["bar", "lines"])
def test_progress_bar_reads_metrics_only_at_the_log_interval(tmp_path, monkeypatch, capsys, style):
    """kempnerforge's ProgressBar in plain Lightning, both renderings: the metrics (a host read-back) are read
    at steps 3 and 6 of 7 with log_every_n_steps=3, plus once at the epoch's end; the bar counts optimizer
    steps (``step 7/7``), the lines are one per read, with the step, the loss and the times."""
    bar = ProgressBar(style=style)
    reads: list[int] = []
    real = ProgressBar.get_metrics

    def spy(self, trainer, pl_module):
        reads.append(trainer.global_step)
        return real(self, trainer, pl_module)

    monkeypatch.setattr(ProgressBar, "get_metrics", spy)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=7, log_every_n_steps=3, accelerator="cpu", logger=False,
                      limit_val_batches=0,
                      enable_checkpointing=False, enable_model_summary=False, callbacks=[bar])  # fmt: skip
    trainer.fit(_LoggedLoss())
    assert reads == [3, 6, 7]
    out = capsys.readouterr().out
    if style == "bar":
        assert bar.train_progress_bar.n == 7 and bar.train_progress_bar.total == 7
        assert "step 7/7" in out and "loss=" in out and "v_num" not in out
        assert not re.search(r"^step \d+/7 \|", out, re.M)
    else:
        lines = re.findall(r"^step (\d)/7 \| loss (\d+\.\d{4}) \| elapsed \d:\d\d:\d\d \| ETA \d:\d\d:\d\d$", out, re.M)
        assert [int(step) for step, _ in lines] == [3, 6, 7], out
        logged = float(trainer.callback_metrics["train/loss"])
        assert float(lines[-1][1]) == pytest.approx(logged, abs=1e-4)
        assert re.search(r"^step 7/7 \| done in \d:\d\d:\d\d$", out, re.M) and "%|" not in out
    with pytest.raises(ValueError, match="metrics_every_n_steps=0 must be an integer >= 1 or None"):
        ProgressBar(metrics_every_n_steps=0)
    with pytest.raises(ValueError, match="style='fancy' must be one of"):
        ProgressBar(style="fancy")


def test_progress_bar_auto_style_follows_stdout(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert ProgressBar().lines is False
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert ProgressBar().lines is True
    assert ProgressBar(style="bar").lines is False


def test_read_scalars_reads_each_device_once_and_keeps_order():
    metrics = {"b": torch.tensor(2.5), "a": torch.tensor([1.25]), "n": 3, "skip": torch.ones(2), "flag": True}
    assert read_scalars(metrics, ["a", "missing", "b", "n", "skip", "flag"]) == {"a": 1.25, "b": 2.5, "n": 3.0}


def test_model_summary_has_no_flops():
    import io
    import logging

    from kempnerforge.callbacks import ModelSummary

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    stream, lightning_log = io.StringIO(), logging.getLogger("lightning.pytorch")  # where Lightning's summary goes
    handler = logging.StreamHandler(stream)
    lightning_log.addHandler(handler)
    try:
        ModelSummary().on_fit_start(trainer, BoringModel())
    finally:
        lightning_log.removeHandler(handler)
    out = stream.getvalue()
    assert "FLOPs" not in out and "Flops" not in out
    assert re.search(r"^0 \| layer \| Linear \| 66 ", out, re.M), out  # BoringModel: Linear(32, 2)
    assert re.search(r"^66 +Total params$", out, re.M)


def test_kforge_adds_its_progress_bar_and_summary_unless_configured():
    from lightning.pytorch.callbacks import RichModelSummary, TQDMProgressBar

    from kempnerforge.callbacks import ModelSummary
    from kempnerforge.console import add_default_callbacks

    config = {"callbacks": [NaNGuard()]}
    add_default_callbacks(config)
    assert [type(c) for c in config["callbacks"]] == [NaNGuard, ProgressBar, ModelSummary]
    own = {"callbacks": [TQDMProgressBar(), RichModelSummary(), NaNGuard(action="raise")]}
    add_default_callbacks(own)
    assert [type(c) for c in own["callbacks"]] == [TQDMProgressBar, RichModelSummary, NaNGuard]
    assert own["callbacks"][2].action == "raise"  # a configured NaNGuard is kept, not doubled
    off = {"callbacks": None, "enable_progress_bar": False, "enable_model_summary": False}
    add_default_callbacks(off)
    assert [type(c) for c in off["callbacks"]] == [NaNGuard]  # the NaN guard is on even with no bar or summary
    single = {"callbacks": [TQDMProgressBar(), NaNGuard()], "enable_model_summary": False}
    add_default_callbacks(single)
    assert [type(c) for c in single["callbacks"]] == [TQDMProgressBar, NaNGuard]  # nothing to add


class _RecordBias(Callback):
    def __init__(self) -> None:
        self.bias: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        self.bias.append(pl_module.layer.bias.detach().clone())


def test_freeze_schedule_on_a_plain_module_freezes_by_parameter_name(tmp_path):
    """Issue 18: patterns over the module's named_parameters(); before steps[0] everything trains as the module set it."""
    from kempnerforge.callbacks import FreezeSchedule

    model, record = BoringModel(), _RecordBias()
    schedule = FreezeSchedule(steps=[2], specs=[{"frozen_patterns": ["layer.bias"]}])
    trainer = Trainer(default_root_dir=tmp_path, max_steps=5, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[schedule, record])  # fmt: skip
    trainer.fit(model)
    b = record.bias  # at the start of steps 0..4; the bias trains in steps 0 and 1, then is frozen
    assert not torch.equal(b[0], b[1]) and not torch.equal(b[1], b[2])
    assert torch.equal(b[2], b[3]) and torch.equal(b[3], b[4]) and torch.equal(b[4], model.layer.bias)
    assert model.layer.weight.requires_grad and not model.layer.bias.requires_grad


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"backbone": True}, r"specs\[0\] freezes \['backbone'\], but BoringModel has no such submodule"),
        ({"frozen_patterns": ["encoder.*"]}, r"specs\[0\]: freeze pattern 'encoder.\*' matches no parameter"),
    ],
)
def test_freeze_schedule_refuses_what_the_module_does_not_have(tmp_path, spec, match):
    from kempnerforge.callbacks import FreezeSchedule

    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, accelerator="cpu", logger=False,
                      enable_checkpointing=False, callbacks=[FreezeSchedule(steps=[1], specs=[spec])])  # fmt: skip
    with pytest.raises(ValueError, match=match):
        trainer.fit(BoringModel())
