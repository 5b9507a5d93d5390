"""Issue 8 check 7: one recipe overlay per optimizer and LR-schedule family, instantiated on the debug recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kempnerforge.cli import KForgeCLI
from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.model import Transformer
from kempnerforge.module import CausalLM
from kempnerforge.training.lr import build_scheduler
from kempnerforge.training.optimizers import build_optimizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted((CONFIGS / "recipes").glob("*.yaml"))
EXPECTED = {  # recipe -> (optimizer class name, schedule family)
    "adamw_cosine": ("AdamW", "cosine"),
    "adamw_linear": ("AdamW", "linear"),
    "adamw_none": ("AdamW", "none"),
    "lion_rex": ("Lion", "rex"),
    "muon_wsd": ("MuonWithAdamW", "wsd"),
    "schedule_free_constant": ("AdamWScheduleFree", "constant"),
}


def test_every_optimizer_and_schedule_family_has_a_recipe():
    assert {p.stem for p in RECIPES} == set(EXPECTED)
    assert {o for o, _ in EXPECTED.values()} >= {"AdamW", "MuonWithAdamW", "Lion", "AdamWScheduleFree"}


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_overlay_instantiates_its_optimizer_and_schedule(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(CONFIGS / "debug.yaml"), "--config", str(path)]
    cli = KForgeCLI(CausalLM, TokenDataModule, args=args, run=False, auto_configure_optimizers=False)
    opt_name, family = EXPECTED[path.stem]
    assert cli.model.scheduler_config.decay == family
    layout = {k: getattr(cli.model.config, k) for k in ("fuse_qkv", "fuse_w13")}  # muon_wsd sets both False
    tiny = Transformer(
        ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8, multiple_of=16, **layout)
    )
    optimizer = build_optimizer(tiny, cli.model.optimizer_config)
    assert type(optimizer).__name__ == opt_name
    scheduler = build_scheduler(optimizer, cli.model.scheduler_config, 100)
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert min(lrs[:99]) > 0  # no step runs at lr 0 (the last may reach min_lr_ratio = 0)
    assert max(lrs) == pytest.approx(cli.model.optimizer_config.lr)
    assert torch.isfinite(torch.tensor(lrs)).all()
