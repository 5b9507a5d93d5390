"""Which exceptions ``kforge`` prints as one line, and the field it names (kempnerforge/cli_errors.py)."""

from __future__ import annotations

import logging

import pytest

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.cli_errors import HeldLogs, argparse_error_line, error_line, infer_field, is_user_error
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


def test_held_logs_are_shown_in_order_or_dropped():
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    lightning, collect = logging.getLogger("lightning.pytorch"), Collect()
    level = lightning.level
    lightning.addHandler(collect)
    lightning.setLevel(logging.INFO)
    logger = logging.getLogger("lightning.pytorch.kforge_test")
    try:
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
    finally:
        lightning.removeHandler(collect)
        lightning.setLevel(level)


def test_user_errors_pickle_with_their_field():
    import pickle

    from kempnerforge.errors import RendezvousTimeoutError

    err = pickle.loads(pickle.dumps(RendezvousTimeoutError("trainer.num_nodes", "1 of 2 joined", 1, 2)))
    assert (type(err), err.field, err.joined, err.expected, str(err)) == (
        RendezvousTimeoutError, "trainer.num_nodes", 1, 2, "1 of 2 joined"
    )  # fmt: skip
