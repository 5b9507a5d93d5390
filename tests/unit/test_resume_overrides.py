"""kempnerforge.training.resume_overrides: a changed optimizer hyperparameter is applied over restored param groups
(norm / bias groups without decay keep 0; the lr keeps each group's position on the schedule); nothing changes when
the values match or the optimizer itself changed."""

from __future__ import annotations

import torch

from kempnerforge.training.resume_overrides import apply_optimizer_overrides

SAVED = {"name": "adamw", "lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8}


def _optimizer() -> torch.optim.AdamW:
    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    for g in opt.param_groups:
        g["initial_lr"] = 3e-3
        g["lr"] = 1.5e-3  # half way up the warmup
    return opt


def test_every_field_is_applied_where_it_exists():
    opt = _optimizer()
    sched = [{"base_lrs": [3e-3, 3e-3], "_last_lr": [1.5e-3, 1.5e-3]}]
    now = {**SAVED, "lr": 1e-4, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.05, "eps": 1e-6}
    lines = apply_optimizer_overrides(SAVED, now, [opt], sched)
    assert lines == [
        "model.optimizer.lr: checkpoint 0.003, now 0.0001 (applied)",
        "model.optimizer.beta1: checkpoint 0.9, now 0.8 (applied)",
        "model.optimizer.beta2: checkpoint 0.95, now 0.99 (applied)",
        "model.optimizer.weight_decay: checkpoint 0.1, now 0.05 (applied)",
        "model.optimizer.eps: checkpoint 1e-08, now 1e-06 (applied)",
    ]
    for g in opt.param_groups:
        assert g["lr"] == 1.5e-3 * (1e-4 / 3e-3) and g["initial_lr"] == 1e-4 * (3e-3 / 3e-3)
        assert g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]  # the no-decay group keeps 0
    assert sched[0]["base_lrs"] == [3e-3 * (1e-4 / 3e-3)] * 2


def test_nothing_changes_when_the_values_match_or_the_optimizer_changed():
    opt = _optimizer()
    assert apply_optimizer_overrides(SAVED, dict(SAVED), [opt], []) == []
    assert apply_optimizer_overrides(SAVED, {**SAVED, "name": "lion", "lr": 1e-4}, [opt], []) == []
    assert apply_optimizer_overrides(None, {**SAVED, "lr": 1e-4}, [opt], []) == []
    assert [g["lr"] for g in opt.param_groups] == [1.5e-3, 1.5e-3]
