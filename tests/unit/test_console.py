"""kforge's warning filters: the known-harmless third-party messages go, by exact message; everything else,
and every warning of global rank 0, stays; ranks > 0 drop code-level warnings rank 0 prints too."""

from __future__ import annotations

import logging
import warnings

import pytest

from kempnerforge import console

LITLOGGER_TIP = (
    "💡 Tip: For seamless cloud logging and experiment tracking, try installing "
    "[litlogger](https://pypi.org/project/litlogger/) to enable LitLogger, which logs metrics and artifacts "
    "automatically to the Lightning Experiments platform."
)


@pytest.fixture
def clean_filters():
    """Warning filters and the loggers' filters as they were before the test."""
    names = [*console.HARMLESS_LOGS, *console.HARMLESS_LOGS_CPU_TORCH]
    before = {name: list(logging.getLogger(name).filters) for name in names}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield
    for name, filters in before.items():
        logging.getLogger(name).filters[:] = filters


def _shown(message: str, category: type[Warning]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(message, category, stacklevel=1)
    return [str(w.message) for w in caught]


def _logged(name: str, message: str, caplog) -> bool:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=name):
        logging.getLogger(name).warning(message)
    return any(r.getMessage() == message for r in caplog.records)


def test_known_warnings_go_by_exact_message_only(clean_filters):
    console.filter_harmless_warnings(rank=0)
    console.filter_harmless_warnings(rank=0)  # idempotent
    for category, message in console.HARMLESS_WARNINGS:
        assert _shown(message, category) == []
        assert _shown(message + " (and more)", category) == [message + " (and more)"]  # not the exact text
        assert _shown("Something else: " + message, category)
    # rank 0 keeps every other warning, code-level ones included
    assert _shown("x is deprecated", FutureWarning) and _shown("x is deprecated", DeprecationWarning)


def test_ranks_above_zero_drop_code_warnings_but_keep_their_own(clean_filters):
    console.filter_harmless_warnings(rank=3)
    assert _shown("`foo` is deprecated", FutureWarning) == []
    assert _shown("`foo` is deprecated", DeprecationWarning) == []
    # a rank's own data or state: still printed by that rank
    assert _shown("skipping unreadable clip 7", UserWarning) == ["skipping unreadable clip 7"]
    assert _shown("overflow in exp", RuntimeWarning) == ["overflow in exp"]


def test_rank_comes_from_the_environment_as_lightning_reads_it(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert console.env_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert console.env_rank() == 5
    monkeypatch.setenv("RANK", "2")  # torchrun's RANK first, as Lightning's rank_zero_only
    assert console.env_rank() == 2


def test_known_log_records_go_and_others_stay(clean_filters, caplog, monkeypatch):
    import torch

    console.filter_harmless_warnings(rank=0)
    rank_zero = "lightning.pytorch.utilities.rank_zero"
    assert not _logged(rank_zero, LITLOGGER_TIP, caplog)
    assert _logged(rank_zero, "Restored all states from the checkpoint at x", caplog)
    so = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    torchao = f"Failed to load {so}: Could not load this library: {so}"
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not _logged("torchao", torchao, caplog)
    assert _logged("torchao", "Failed to load something else", caplog)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build: a kernel library that fails matters
    assert _logged("torchao", torchao, caplog)
    enum = (
        "<enum 'ScaleCalculationMode'> is an Enum subclass and is now natively supported by torch.compile as an "
        "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error in a "
        "future release."
    )
    assert not _logged("torch.utils._pytree", enum, caplog)
    assert _logged("torch.utils._pytree", enum.replace("Enum subclass", "Enum"), caplog)


def test_lightnings_restore_lines_go_only_for_ckpt_path_auto(clean_filters, caplog):
    """Lightning prints the ckpt_path it was given: for `--ckpt_path auto` the word "auto" (even when the run
    starts fresh); kforge's own "Auto-resume: ..." line names the checkpoint. A real path keeps its lines."""
    import inspect

    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    source = inspect.getsource(_CheckpointConnector)  # the texts filtered are Lightning's own
    assert 'f"Restoring states from the checkpoint path at {checkpoint_path}"' in source
    assert '"Restored all states"' in source and 'f"{message} from the checkpoint at {self._ckpt_path}"' in source
    console.filter_harmless_warnings(rank=0)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        assert not _logged(name, "Restoring states from the checkpoint path at auto", caplog)
        assert not _logged(name, "Restored all states from the checkpoint at auto", caplog)
        assert _logged(name, "Restoring states from the checkpoint path at checkpoints/debug", caplog)
        assert _logged(name, "Restored all states from the checkpoint at checkpoints/auto", caplog)


def test_tools_drop_dcps_single_process_notice_and_keep_other_warnings(clean_filters, tmp_path):
    """generate / convert / eval load and save DCP without a process group by design (``no_dist``); torch warns
    about that on every call. The tools' filter drops exactly torch's two messages."""
    import torch
    import torch.distributed.checkpoint as dcp

    def dcp_round_trip() -> list[str]:
        path = tmp_path / str(len(list(tmp_path.iterdir())))  # a new folder: no "overwriting" warning
        with warnings.catch_warnings(record=True) as caught:
            dcp.save({"w": torch.ones(2)}, checkpoint_id=path, no_dist=True)
            dcp.load({"w": torch.zeros(2)}, checkpoint_id=path, no_dist=True)
        return [str(w.message) for w in caught]

    assert len([m for m in dcp_round_trip() if "torch.distributed is disabled" in m]) == 2  # what torch says
    console.filter_harmless_warnings(rank=0)
    assert any("torch.distributed is disabled" in m for m in dcp_round_trip())  # kforge fit keeps them
    console.filter_tool_warnings()
    assert dcp_round_trip() == []
    assert _shown("torch.distributed is disabled, and more", UserWarning)


def test_every_tool_runs_with_the_tool_filters(clean_filters, monkeypatch):
    import sys
    import types

    from kempnerforge import commands

    seen = []
    module = types.ModuleType("kforge_fake_tool")
    module.main = lambda argv: seen.append(_shown(console.TOOL_WARNINGS[0][1], UserWarning))
    monkeypatch.setitem(sys.modules, "kforge_fake_tool", module)
    monkeypatch.setitem(commands.TOOLS, "fake", ("a fake tool", "kforge_fake_tool:main"))
    commands.run_tool("fake", [])
    assert seen == [[]]


def test_resume_warning_is_filtered_only_when_asked(clean_filters):
    message = "Checkpoint directory /scratch/run/ckpt exists and is not empty."
    assert _shown(message, UserWarning)
    console.filter_resume_warning()
    assert _shown(message, UserWarning) == []
    assert _shown("Checkpoint directory /x exists and is read-only.", UserWarning)


def test_fsdp2_view_warning_goes_for_kempnerforge_modules_only(clean_filters):
    console.filter_harmless_warnings(rank=0)
    tail = (
        " returned a view tensor. An in-place op on this view (e.g., `x += y`) will silently drop the pre-backward "
        "hook and skip the all-gather, which can cause backward to fail or produce wrong gradients."
    )
    for ours in ("(FSDPEmbedding, FSDPRMSNorm, FSDPLinear)", "(FSDPGroupedExperts)", "(FSDPMoE)"):
        assert _shown("FSDP2-wrapped module " + ours + tail, UserWarning) == []
    theirs = "FSDP2-wrapped module (FSDPMyBlock)" + tail
    assert _shown(theirs, UserWarning) == [theirs]
