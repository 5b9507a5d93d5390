"""TokenPerplexity (summed NLL + token count) against torchmetrics' Perplexity on the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from kempnerforge.metrics import TokenPerplexity
from kempnerforge.training.loss import IGNORE_INDEX


def test_equals_torchmetrics_perplexity_over_several_updates():
    g = torch.Generator().manual_seed(0)
    ours, oracle = TokenPerplexity(), Perplexity(ignore_index=IGNORE_INDEX)
    for rows in (2, 3, 1):
        logits = torch.randn(rows, 7, 11, generator=g) * 3
        labels = torch.randint(0, 11, (rows, 7), generator=g)
        labels[0, :3] = IGNORE_INDEX  # batches with different target counts: the mean is token-weighted
        nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        ours.update(nll, (labels != IGNORE_INDEX).sum())
        oracle.update(logits, labels)
    assert ours.update_count == 3
    assert ours.compute().item() == pytest.approx(oracle.compute().item(), rel=1e-6)
    ours.reset()
    assert ours.update_count == 0 and ours.count.item() == 0


def test_refuses_non_scalars():
    with pytest.raises(ValueError, match="takes scalars"):
        TokenPerplexity().update(torch.ones(2), 3)
