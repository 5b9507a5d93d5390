"""ExpMeanMetric (token-weighted mean loss, then exp) against torchmetrics' Perplexity on the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric
from torchmetrics.text import Perplexity

from kempnerforge.metrics import ExpMeanMetric
from kempnerforge.training.loss import IGNORE_INDEX


def test_equals_torchmetrics_perplexity_over_several_updates():
    g = torch.Generator().manual_seed(0)
    ours, loss, oracle = ExpMeanMetric(), MeanMetric(), Perplexity(ignore_index=IGNORE_INDEX)
    for rows in (2, 3, 1):
        logits = torch.randn(rows, 7, 11, generator=g) * 3
        labels = torch.randint(0, 11, (rows, 7), generator=g)
        labels[0, :3] = IGNORE_INDEX  # batches with different target counts: the mean is token-weighted
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        n = (labels != IGNORE_INDEX).sum().float()
        ours.update(nll / n, weight=n)
        loss.update(nll / n, weight=n)
        oracle.update(logits, labels)
    assert ours.update_count == 3
    assert ours.compute().item() == pytest.approx(oracle.compute().item(), rel=1e-6)
    assert ours.compute().item() == torch.exp(loss.compute()).item()  # val/ppl == exp(val/loss), bitwise
    ours.reset()
    assert ours.update_count == 0
