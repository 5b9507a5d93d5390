"""Every LR schedule family at chosen steps vs hand-computed values; no step at LR 0; resume guard."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kempnerforge.errors import UserError
from kempnerforge.training.lr import DECAYS, WSD_SHAPES, SchedulerConfig, build_scheduler, lr_factor

# warmup 10, total 110: the decay spans steps 10..110 (progress p = (step - 10) / 100).
W, T = 10, 110


def _f(step: int, **kw) -> float:
    return lr_factor(step, SchedulerConfig(warmup_steps=W, min_lr_ratio=0.1, **kw), T)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "rex", "constant"])
def test_warmup_end_is_the_peak_and_the_first_step_is_not_zero(decay):
    assert _f(0, decay=decay) == pytest.approx(1 / W)
    assert _f(W - 1, decay=decay) == pytest.approx(1.0)
    assert _f(W, decay=decay) == pytest.approx(1.0)


def test_midpoints_and_ends_by_hand():
    lo = 0.1
    assert _f(60, decay="cosine") == pytest.approx(lo + (1 - lo) * 0.5)
    assert _f(60, decay="linear") == pytest.approx(lo + (1 - lo) * 0.5)
    # REX, alpha = 2, p = 0.5: (1 - 0.5) / (1 - 0.25) = 2/3
    assert _f(60, decay="rex", rex_alpha=2.0) == pytest.approx(lo + (1 - lo) * 2 / 3)
    assert _f(60, decay="rex", rex_alpha=4.0) == pytest.approx(lo + (1 - lo) * 0.5 / (1 - 0.125))
    assert _f(60, decay="constant") == 1.0
    for decay in ("cosine", "linear", "wsd", "rex"):
        assert _f(T, decay=decay) == pytest.approx(lo), decay
        assert _f(T + 50, decay=decay) == pytest.approx(lo), decay


@pytest.mark.parametrize("shape", WSD_SHAPES)
def test_wsd_holds_the_peak_then_decays_in_its_last_fraction(shape):
    kw = {"decay": "wsd", "decay_fraction": 0.2, "decay_shape": shape}
    # stable through p = 0.8 (step 90), then 20 decay steps: p_decay = (step - 90) / 20
    assert [_f(s, **kw) for s in (10, 50, 89, 90)] == [1.0, 1.0, 1.0, 1.0]
    expected = {"cosine": 0.5 * (1 + math.cos(math.pi * 0.25)), "linear": 0.75, "sqrt": 1 - math.sqrt(0.25)}
    assert _f(95, **kw) == pytest.approx(0.1 + 0.9 * expected[shape])
    assert _f(T, **kw) == pytest.approx(0.1)


def test_none_is_the_optimizer_lr_at_every_step():
    cfg = SchedulerConfig(warmup_steps=0, decay="none")
    assert {lr_factor(s, cfg, 10) for s in range(20)} == {1.0}


@pytest.mark.parametrize("decay", DECAYS)
def test_no_step_runs_at_lr_zero_even_with_min_lr_ratio_zero(decay):
    cfg = SchedulerConfig(warmup_steps=0 if decay == "none" else 5, decay=decay, min_lr_ratio=0.0)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg, total_steps=40)
    lrs = []
    for _ in range(40):  # the 40 steps of the run
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert min(lrs) > 0, lrs


def test_resume_under_another_total_is_refused_and_the_same_schedule_continues():
    def make(total):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, build_scheduler(opt, SchedulerConfig(warmup_steps=2), total)

    opt, sched = make(100)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2, same = make(100)
    same.load_state_dict(state)
    assert same.last_epoch == 7
    sched.step()
    same.step()  # the next step's LR follows the saved position, not a fresh warmup
    assert (
        opt2.param_groups[0]["lr"]
        == pytest.approx(opt.param_groups[0]["lr"])
        == pytest.approx(lr_factor(8, SchedulerConfig(warmup_steps=2), 100))
    )
    _, other = make(200)
    with pytest.raises(UserError, match=r"total_steps: saved 100, now 200.*pin model.scheduler.total_steps") as err:
        other.load_state_dict(state)
    # a user error naming the field: kforge prints it as one line, also when an auto-resume meets it mid-launch
    assert err.value.field == "model.scheduler.total_steps" and "--ckpt_path null" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decay_fraction": 0.0}, r"decay_fraction=0.0 must be in \(0, 1\]"),
        ({"decay_shape": "exp"}, "decay_shape='exp'; choose one of cosine, linear, sqrt"),
        ({"rex_alpha": 1.0}, "rex_alpha=1.0 must be > 1"),
        ({"decay": "none", "warmup_steps": 5}, "warmup_steps=5 would be ignored"),
    ],
)
def test_schedule_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_warmup_longer_than_the_run_is_clamped_with_a_warning():
    """Issue 18, check 7: as torchtitan, the warmup is clamped to the run (the LR reaches its peak at the last
    step) and the clamp is said; a warmup of exactly the run is kept and warned about; a shorter one is silent."""
    import warnings

    def factors(warmup: int, total: int) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = build_scheduler(opt, SchedulerConfig(warmup_steps=warmup), total)
        out = []
        for _ in range(total):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    with pytest.warns(UserWarning, match=r"warmup_steps=200 is longer than the run's 100 steps: warmup clamped to 100"):
        lrs = factors(200, 100)
    assert lrs[0] == pytest.approx(1 / 100) and lrs[-1] == pytest.approx(1.0)  # unclamped: 0.5 at the end
    with pytest.warns(UserWarning, match=r"warmup_steps=10 equals the run's 10 steps: the LR reaches its peak"):
        assert factors(10, 10)[-1] == pytest.approx(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert factors(5, 10)[4] == pytest.approx(1.0)
