"""Every recipe in configs/ parses and instantiates (model, data, trainer, strategy) without running."""

from __future__ import annotations

from pathlib import Path

import pytest

from kempnerforge.cli import KForgeCLI
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # loggers and checkpoint dirs land here, not in the repo
    cli = KForgeCLI(CausalLM, TokenDataModule, args=["--config", str(path)], run=False, auto_configure_optimizers=False)
    assert isinstance(cli.model, CausalLM)
    assert isinstance(cli.trainer.strategy, KempnerStrategy)
    assert cli.datamodule.vocab_size == cli.model.config.vocab_size
    assert cli.datamodule.seq_len <= cli.model.config.max_seq_len


def test_there_is_at_least_the_debug_recipe():
    assert "debug" in [p.stem for p in CONFIGS]
