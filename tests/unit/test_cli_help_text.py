"""``kforge`` reads the config classes' per-field docstrings only when it prints help text (they cost 5-10 s of
CPU per process to parse); the help itself is checked in tests/e2e/test_cli.py."""

from __future__ import annotations

import pytest

from kempnerforge.cli import shows_help_text


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["fit", "--config", "configs/debug.yaml", "--help"], True),
        (["fit", "-h"], True),
        (["--help"], True),
        (["fit", "--config", "configs/vlm_jd.yaml", "--model.help", "VisionLanguage"], True),
        (["fit", "--data.help=ImageTextDataModule"], True),
        (["fit", "--config", "configs/debug.yaml"], False),
        (["fit", "--config", "configs/debug.yaml", "--print_config"], False),
        (["validate", "--config", "help.yaml", "--trainer.max_steps=5"], False),
        ([], False),
    ],
)
def test_attribute_docstrings_parsed_only_for_help(args, expected):
    assert shows_help_text(args) is expected
