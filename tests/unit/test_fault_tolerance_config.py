"""``fault_tolerance``: every setting that cannot work is refused with one line before any process starts;
``kforge lighthouse`` serves torchft's lighthouse; the normalizer's second reduction level."""

from __future__ import annotations

import importlib.util
import threading
import time
from argparse import Namespace

import pytest
import torch

from kempnerforge.cli_errors import error_line
from kempnerforge.errors import UserError
from kempnerforge.resilience.ft_config import (
    FaultTolerance,
    check_accumulation_ft,
    check_fault_tolerance,
    check_fault_tolerance_run,
)

LIGHTHOUSE = "http://localhost:29510"
FIELD = "trainer.strategy.init_args.fault_tolerance"
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft not installed")


def _ft(**kw) -> FaultTolerance:
    return FaultTolerance(**{"lighthouse": LIGHTHOUSE, **kw})


@needs_torchft
@pytest.mark.parametrize(
    ("ft", "degrees", "field", "allowed"),
    [
        (_ft(replica_group_id=2), {}, f"{FIELD}.replica_group_id", "in [0, 2)"),
        (_ft(replica_group_id=-1), {}, f"{FIELD}.replica_group_id", "in [0, 2)"),
        (_ft(num_replica_groups=0), {}, f"{FIELD}.num_replica_groups", ">= 1"),
        (_ft(min_replica_groups=3), {}, f"{FIELD}.min_replica_groups", "in [1, 2]"),
        (_ft(min_replica_groups=0), {}, f"{FIELD}.min_replica_groups", "in [1, 2]"),
        (_ft(timeout_s=0), {}, f"{FIELD}.timeout_s", "> 0"),
        (_ft(quorum_timeout_s=-1.0), {}, f"{FIELD}.quorum_timeout_s", "> 0"),
        (_ft(lighthouse="localhost:29510"), {}, f"{FIELD}.lighthouse", "http://host:port"),
        (_ft(), {"dp_replicate": 2}, "trainer.strategy.init_args.dp_replicate", "the replica groups are"),
        (_ft(), {"pp": 2}, "trainer.strategy.init_args.pp", "1 with fault_tolerance"),
    ],
)
def test_each_setting_that_cannot_work_is_one_line_naming_it(ft, degrees, field, allowed):
    with pytest.raises(UserError) as err:
        check_fault_tolerance(ft, degrees)
    assert err.value.field == field and allowed in str(err.value)
    line = error_line(err.value)
    assert line.startswith(f"kforge: error: {field}: ") and "\n" not in line


@needs_torchft
def test_the_lighthouse_comes_from_the_environment_when_not_set(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(UserError, match=r"TORCHFT_LIGHTHOUSE"):
        check_fault_tolerance(FaultTolerance(), {})
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LIGHTHOUSE)
    check_fault_tolerance(FaultTolerance(), {})  # no error
    assert FaultTolerance().lighthouse_address() == LIGHTHOUSE


def test_without_torchft_the_option_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install 'kempnerforge\[ft\]'") as err:
        check_fault_tolerance(_ft(), {})
    assert err.value.field == FIELD


@needs_torchft
def test_the_strategy_refuses_at_construction_before_any_process_group():
    from kempnerforge.strategies import KempnerStrategy

    with pytest.raises(UserError) as err:
        KempnerStrategy(dp_replicate=2, dp_shard=2, fault_tolerance=_ft())
    assert err.value.field == "trainer.strategy.init_args.dp_replicate"
    assert KempnerStrategy(fault_tolerance=_ft()).fault_tolerance == _ft()
    assert not torch.distributed.is_initialized()


def test_moe_accumulation_and_non_resumable_data_are_refused():
    moe = Namespace(config=Namespace(num_experts=8))
    with pytest.raises(UserError, match="MoE load statistics") as err:
        check_fault_tolerance_run(_ft(), moe, None)
    assert err.value.field == "model.config.num_experts"
    with pytest.raises(UserError, match="ResumableLoaders") as err:
        check_fault_tolerance_run(_ft(), Namespace(config=Namespace(num_experts=0)), object())
    assert err.value.field == "data"
    with pytest.raises(UserError) as err:
        check_accumulation_ft(_ft(), 2)
    assert err.value.field == "trainer.accumulate_grad_batches"
    check_accumulation_ft(None, 4)  # off: anything goes
    check_fault_tolerance_run(None, moe, object())


def test_the_step_token_count_gets_a_second_reduction_level():
    """With replica groups the step's (loss sum, target count) is summed across the groups after the group's own
    reduction, so the factor is dp_size over the count of every group (here: this group's 10 + another's 30)."""
    from kempnerforge.training.loss import StepTokenNormalizer

    norm = StepTokenNormalizer()
    norm.outer_reduce = lambda stats: stats.add_(torch.tensor([60.0, 30.0], dtype=stats.dtype))
    factor = norm.add(torch.tensor(20.0), torch.tensor(10), dp_size=2, new_step=True)
    assert float(factor) == pytest.approx(2 / 40)
    mean, count = norm.step_loss()
    assert float(mean) == pytest.approx(80 / 40) and float(count) == 40


@needs_torchft
def test_kforge_lighthouse_serves_until_stopped_and_refuses_bad_options(tmp_path, capsys):
    from kempnerforge.tools.lighthouse import build_parser, serve

    args = build_parser().parse_args(["--min_replicas", "1", "--address_file", str(tmp_path / "addr")])
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(args, stop))
    thread.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "addr").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    address = (tmp_path / "addr").read_text().strip()
    stop.set()
    thread.join(10)
    assert address.startswith("http://") and address in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        serve(build_parser().parse_args(["--min_replicas", "0"]), threading.Event())
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "kforge: error: --min_replicas: an int >= 1, got 0"
