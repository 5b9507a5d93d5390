"""Which exceptions ``kforge`` prints as one line, and the field it names (kempnerforge/cli_errors.py)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.cli_errors import (
    HeldLogs,
    argparse_error_line,
    error_line,
    infer_field,
    is_user_error,
    said_by_another_rank,
)
from kempnerforge.errors import PathError, UserError
from kempnerforge.parallel.mesh import MeshConfigError


@pytest.mark.parametrize(
    ("exc", "during_setup", "expected"),
    [
        (UserError("data.tokenizer", "x"), False, True),  # typed: wherever it is raised
        (MeshConfigError("tp=3 ..."), False, True),
        (CheckpointError("not complete"), False, True),
        (ValueError("ModelConfig.dim=1 ..."), True, True),  # a class's own validation while the config is built
        (FileNotFoundError("no such file"), True, True),
        (ValueError("an internal error during training"), False, False),  # keeps its traceback
        (RuntimeError("a bug at start"), True, False),
        (KeyError("k"), True, False),
    ],
)
def test_user_errors_are_typed_or_raised_while_the_config_is_built(exc, during_setup, expected):
    assert is_user_error(exc, during_setup) is expected


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("ModelConfig.dim=128 must be divisible by n_heads=3", "model.config.dim"),
        ("data.seq_len=512 exceeds model.config.max_seq_len=256", "data.seq_len"),
        ("encoder.pretrained_path='/x' has no config.json", "model.encoder.pretrained_path"),
        ("ep=2 must divide dp_shard=1", "trainer.strategy.init_args.ep"),
        ("configs/debug.yaml is bad", "config"),  # a file name is not a field
        ("something went wrong", "config"),
    ],
)
def test_the_field_is_read_from_the_message(message, field):
    assert infer_field(message) == field


def test_lines_are_one_line_with_the_field_first():
    assert error_line(PathError("data.tokenizer", "/x does not exist\n(no folder)")) == (
        "kforge: error: data.tokenizer: /x does not exist (no folder)"
    )
    assert error_line(CheckpointError("Checkpoint path /c does not exist.")).startswith("kforge: error: ckpt_path: ")
    assert argparse_error_line("Parser key \"model.config.n_heads\":\n  Expected a <class 'int'>. Got value: abc") == (
        "kforge: error: model.config.n_heads: Expected a <class 'int'>. Got value: abc"
    )
    assert argparse_error_line("unrecognized arguments: --model.config.n_layer=2").startswith(
        "kforge: error: --model.config.n_layer: unknown option"
    )
    # a misspelled key in a --config YAML file: the key is the field
    assert argparse_error_line("Subcommand 'fit' does not accept option 'model.optimizer.learning_rate'") == (
        "kforge: error: model.optimizer.learning_rate: not a field of kforge fit (in a --config file?); "
        "kforge fit --help lists every field"
    )


@pytest.fixture
def lightning_lines():
    """``(seen, logger)``: the messages Lightning's own logger handled, in order, and a child logger to emit on."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    lightning, collect = logging.getLogger("lightning.pytorch"), Collect()
    level = lightning.level
    lightning.addHandler(collect)
    lightning.setLevel(logging.INFO)
    yield seen, logging.getLogger("lightning.pytorch.kforge_test")
    lightning.removeHandler(collect)
    lightning.setLevel(level)


def test_held_logs_are_shown_in_order_or_dropped(lightning_lines):
    seen, logger = lightning_lines
    held = HeldLogs().hold()
    logger.info("one")
    logger.warning("two")
    assert seen == [] and [r.getMessage() for r in held.records] == ["one", "two"]
    held.show()
    assert seen == ["one", "two"]  # through Lightning's own handlers, in order
    held = HeldLogs().hold()
    logger.info("three")
    held.drop()
    logger.info("four")  # the handlers are back
    assert seen == ["one", "two", "four"]


def test_held_logs_hold_python_warnings_in_order_with_the_log_lines(monkeypatch):
    import warnings

    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        held = HeldLogs().hold()
        warnings.warn("warmup clamped", UserWarning, stacklevel=1)
        assert shown == [] and len(held.records) == 1
        held.show()
        assert shown == ["warmup clamped"]
        warnings.warn("after", UserWarning, stacklevel=1)  # showwarning is back
        assert shown == ["warmup clamped", "after"]
        held = HeldLogs().hold()
        warnings.warn("refused run", UserWarning, stacklevel=1)
        held.drop()
        assert shown == ["warmup clamped", "after"]


def test_held_logs_show_by_themselves_after_a_slow_start(lightning_lines):
    seen, logger = lightning_lines
    held = HeldLogs().hold()
    logger.info("rendezvous")
    held.release_after(0.05)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["rendezvous"]  # a hang still shows its last lines
    logger.info("after")
    assert seen == ["rendezvous", "after"]
    held = HeldLogs().hold()
    held.release_after(0.05)
    held.drop()  # a user error before the timer: nothing is shown, then or later
    logger.info("x")
    time.sleep(0.2)
    assert seen == ["rendezvous", "after", "x"]


def test_a_message_that_starts_with_its_field_names_it_once():
    from kempnerforge.checkpoint.train_state import DataParallelMismatchError

    err = DataParallelMismatchError("data.micro_batch_size: resuming must keep the global batch (saved 4, now 8)")
    assert error_line(err) == (
        "kforge: error: data.micro_batch_size: resuming must keep the global batch (saved 4, now 8)"
    )


def test_the_ranks_of_one_run_say_an_identical_line_once(monkeypatch, tmp_path):
    from kempnerforge.cli_errors import LAUNCH_ID_ENV, name_this_launch

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for name in (
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_PROCID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "LOCAL_RANK",
        LAUNCH_ID_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    name_this_launch()
    assert not said_by_another_rank("kforge: error: a: b") and not said_by_another_rank("kforge: error: a: b")
    monkeypatch.setenv("MASTER_PORT", "29500")  # launched by Lightning: local rank 0 is the command itself
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not said_by_another_rank("kforge: error: a: b")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the rank it started, with the name inherited
    name_this_launch()
    assert said_by_another_rank("kforge: error: a: b")
    assert not said_by_another_rank("kforge: error: a: c")  # a line of its own is said
    monkeypatch.setenv("LOCAL_RANK", "0")
    first = os.environ[LAUNCH_ID_ENV]
    name_this_launch()  # the next command in this process (MASTER_PORT is still set): its own name
    assert os.environ[LAUNCH_ID_ENV] != first and not said_by_another_rank("kforge: error: a: b")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")  # torchrun: every rank's parent is the agent
    monkeypatch.setattr("os.getppid", lambda: 4242)
    name_this_launch()
    assert not said_by_another_rank("kforge: error: a: b")
    monkeypatch.setenv("LOCAL_RANK", "3")
    name_this_launch()
    assert said_by_another_rank("kforge: error: a: b")


def test_user_errors_pickle_with_their_field():
    import pickle

    from kempnerforge.errors import RendezvousTimeoutError

    err = pickle.loads(pickle.dumps(RendezvousTimeoutError("trainer.num_nodes", "1 of 2 joined", 1, 2)))
    assert (type(err), err.field, err.joined, err.expected, str(err)) == (
        RendezvousTimeoutError, "trainer.num_nodes", 1, 2, "1 of 2 joined"
    )  # fmt: skip


def test_a_value_of_the_wrong_type_for_an_init_arg_names_the_arg_not_the_union():
    message = (
        'Parser key "trainer.strategy":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
        "'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]\n  Errors:\n    - Expected a <class 'str'>\n"
        "    - Problem with given class_path 'kempnerforge.strategies.KempnerStrategy':\n        Parser key \"cp\":\n"
        "          Expected a <class 'int'>. Got value: abc\n  Given value type: <class 'jsonargparse._util.NestedArg'>\n"
        "  Given value: NestedArg(key='cp', val='abc')"
    )
    assert argparse_error_line(message) == "kforge: error: trainer.strategy.init_args.cp: expected int, got abc"
