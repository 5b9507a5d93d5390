"""Loss normalization, LR schedule, AdamW parameter groups, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.parallel.grad_clip import clip_grad_norm_, total_grad_norm
from kempnerforge.training.loss import IGNORE_INDEX, global_token_cross_entropy
from kempnerforge.training.lr import SchedulerConfig, build_scheduler, lr_factor
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw, param_groups


def test_loss_equals_token_mean_with_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 3:] = IGNORE_INDEX
    loss, mean, n = global_token_cross_entropy(logits, labels)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert n.item() == 8
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert mean.item() == pytest.approx(ref.item(), rel=1e-6)


def test_micro_batches_sum_to_the_big_batch_gradient():
    """Per-micro-batch token-normalized losses weight tokens, not micro-batches (uneven padding)."""
    torch.manual_seed(0)
    w = torch.randn(7, 13, requires_grad=True)
    x = torch.randn(4, 6, 7)
    labels = torch.randint(0, 13, (4, 6))
    labels[1, 2:] = IGNORE_INDEX
    ref = F.cross_entropy((x @ w).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    (g_ref,) = torch.autograd.grad(ref, w)
    n_total = (labels != IGNORE_INDEX).sum()
    total = sum(
        global_token_cross_entropy(x[i : i + 2] @ w, labels[i : i + 2])[0]
        * (labels[i : i + 2] != IGNORE_INDEX).sum()
        / n_total
        for i in (0, 2)
    )
    (g,) = torch.autograd.grad(total, w)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


def test_loss_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"logits \(2, 5, 11\) and labels \(2, 4\) disagree"):
        global_token_cross_entropy(torch.randn(2, 5, 11), torch.zeros(2, 4, dtype=torch.long))


def test_warmup_then_cosine_to_min():
    cfg = SchedulerConfig(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cfg, 110) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 110) == pytest.approx(1.0)
    assert lr_factor(60, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, cfg, 110) == pytest.approx(0.1)
    assert lr_factor(500, cfg, 110) == pytest.approx(0.1)
    lin = SchedulerConfig(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert lr_factor(25, lin, 100) == pytest.approx(0.75)


def test_scheduler_drives_the_optimizer_lr():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_scheduler(opt, SchedulerConfig(warmup_steps=4, min_lr_ratio=0.0), total_steps=8)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert lrs[6] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 2 / 4)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, "warmup_steps=-1 must be >= 0"),
        ({"min_lr_ratio": 1.5}, r"min_lr_ratio=1.5 must be in \[0, 1\]"),
        ({"decay": "step"}, "decay='step'; choose"),
        ({"total_steps": 0}, "total_steps=0 must be > 0"),
    ],
)
def test_scheduler_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_scheduler_needs_steps():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="needs a positive number of steps; got 0"):
        build_scheduler(opt, SchedulerConfig(), 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr=0.0 must be > 0"),
        ({"beta2": 1.0}, r"beta2=1.0 must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
        ({"eps": 0.0}, "eps=0.0 must be > 0"),
    ],
)
def test_optimizer_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_no_decay_on_norms_biases_embeddings_and_tied_head():
    from kempnerforge.config import ModelConfig
    from kempnerforge.model import Transformer

    model = Transformer(
        ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8, multiple_of=16, tie_embeddings=True)
    )
    groups = param_groups(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert id(model.tok_embeddings.weight) in no_decay and id(model.output.weight) in no_decay
    assert id(model.norm.weight) in no_decay
    assert (
        id(model.layers["0"].attention.wqkv.weight) in decay and id(model.layers["0"].feed_forward.w13.weight) in decay
    )
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    opt = build_adamw(model, OptimizerConfig(lr=1e-3))
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.95)


def test_grad_clip_returns_true_norm_and_clips():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    expected = math.sqrt(3 * 4 + 4)
    assert total_grad_norm([a, b]).item() == pytest.approx(expected)
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(expected)
    assert total_grad_norm([a, b]).item() == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match="only the L2 norm"):
        total_grad_norm([a], norm_type=1.0)


def test_grad_clip_folds_a_scale_into_one_multiply():
    a = nn.Parameter(torch.zeros(3))
    a.grad = torch.full((3,), 2.0)  # norm sqrt(12) ~ 3.46; scaled by 0.5 -> 1.73
    norm = clip_grad_norm_([a], max_norm=1.0, grad_scale=0.5)
    assert norm.item() == pytest.approx(0.5 * math.sqrt(12))
    assert total_grad_norm([a]).item() == pytest.approx(1.0, rel=1e-5)
    a.grad = torch.full((3,), 2.0)
    clip_grad_norm_([a], max_norm=10.0, grad_scale=0.25)  # below the threshold: scale only
    torch.testing.assert_close(a.grad, torch.full((3,), 0.5))
    a.grad = torch.full((3,), 2.0)
    clip_grad_norm_([a], max_norm=0.0, grad_scale=3.0)  # clipping off: scale only
    torch.testing.assert_close(a.grad, torch.full((3,), 6.0))


def test_cpu_grad_norm_of_a_large_tensor_matches_fp64():
    # A single fp32 reduction over millions of elements drifts ~5e-4 relative on CPU; the chunked norm must not.
    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(4_000_000))
    p.grad = torch.randn(4_000_000) * 1e-3
    exact = torch.linalg.vector_norm(p.grad, dtype=torch.float64).item()
    assert total_grad_norm([p]).item() == pytest.approx(exact, rel=1e-6)
