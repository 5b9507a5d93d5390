"""Start-up (issue 21): the tools' ``--help`` and a model import do not pull in Lightning or torchmetrics (and with
it scipy / matplotlib / transformers where installed), and ``kforge fit`` builds the parser of ``fit`` only. What
this saves is measured by ``benchmarks/startup.py``; nothing here is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kempnerforge.cli import KForgeCLI, make_cli, requested_subcommand

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("lightning", "torchmetrics", "scipy", "matplotlib")

# One interpreter for every check (each import of torch costs seconds): the modules loaded after each step.
_PROBE = """
import json, sys
from kempnerforge.entry import main
seen = {}
def mark(step):
    seen[step] = sorted(m for m in ("torch", "transformers", *HEAVY) if m in sys.modules)
for tool in ("convert", "generate", "eval", "estimate", "prepare-data"):
    try:
        main([tool, "--help"])
    except SystemExit:
        pass
    mark(tool)
import kempnerforge.config, kempnerforge.metrics.flops, kempnerforge.model.transformer, kempnerforge.data.memmap
mark("model")
print(json.dumps(seen))
""".replace("HEAVY", repr(HEAVY))


@pytest.fixture(scope="module")
def loaded_after() -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_convert_help_imports_neither_torch_nor_lightning(loaded_after):
    assert loaded_after["convert"] == []


@pytest.mark.parametrize("step", ["generate", "eval", "estimate", "prepare-data", "model"])
def test_no_lightning_or_torchmetrics_without_training(loaded_after, step):
    assert not set(loaded_after[step]) & set(HEAVY), loaded_after[step]


def test_convert_dtype_names_match_the_converter():
    from kempnerforge.checkpoint.convert import DTYPES
    from kempnerforge.tools.convert import DTYPE_NAMES

    assert list(DTYPE_NAMES) == sorted(DTYPES)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["fit", "--config", "configs/debug.yaml"], "fit"),
        (["validate", "--ckpt_path", "x"], "validate"),
        (["--config", "fit.yaml", "fit"], None),  # a main-level option first: every parser, as Lightning
        (["--print_config"], None),
        ([], None),
        ({"fit": {}}, None),
    ],
)
def test_requested_subcommand(args, expected):
    assert requested_subcommand(args) == expected


def test_fit_builds_only_the_fit_parser(monkeypatch, capsys):
    built = []
    prepare = KForgeCLI._prepare_subcommand_parser

    def record(self, klass, subcommand, **kwargs):
        built.append(subcommand)
        return prepare(self, klass, subcommand, **kwargs)

    monkeypatch.setattr(KForgeCLI, "_prepare_subcommand_parser", record)
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        make_cli(["fit", "--config", "configs/debug.yaml", "--trainer.max_steps=1", "--print_config"])
    assert exit_.value.code in (0, None)
    assert built == ["fit"]
    assert "max_steps: 1" in capsys.readouterr().out  # the one parser still reads the whole recipe


def test_the_console_script_freezes_the_heap_after_a_command_unless_triton_is_loaded(monkeypatch):
    import gc
    import sys

    import kempnerforge.entry as entry

    ran = []
    monkeypatch.setattr(entry, "main", lambda argv=None: ran.append(argv))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    try:
        entry.console_main()
        assert ran == [None] and gc.get_freeze_count() > 0  # shutdown collections skip the frozen heap
        gc.unfreeze()
        monkeypatch.setitem(sys.modules, "triton", object())
        entry.console_main()
        assert gc.get_freeze_count() == 0  # with Triton loaded its nanobind objects must be freed normally
    finally:
        gc.unfreeze()
