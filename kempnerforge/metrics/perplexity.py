"""Validation perplexity as ``exp`` of the token-weighted mean loss: no second softmax over the vocabulary.

torchmetrics' ``Perplexity`` takes the full ``(batch, seq, vocab)`` logits and runs its own softmax over
them, which doubles the largest tensor of a validation step and cannot see vocab-sharded (tensor
parallel) or chunked (``loss_chunk_size``) losses. The loss the training path already computed holds
everything perplexity needs.
"""

from __future__ import annotations

import torch
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override


class ExpMeanMetric(MeanMetric):
    """``exp`` of a weighted mean; fed the per-token mean loss weighted by target tokens, it is perplexity.

    ``update(value, weight)`` and the cross-rank sync are ``MeanMetric``'s, so given the same updates as a
    ``MeanMetric`` of the loss, ``compute()`` is exactly ``exp`` of that metric's value (same sums, same
    sync, one ``exp``): ``val/ppl == exp(val/loss)``.

    Shapes: ``update(value (), weight ())`` fp32 scalars (nats per token, token count); ``compute() -> ()``.
    """

    @override
    def compute(self) -> torch.Tensor:
        """``exp(sum(value * weight) / sum(weight))`` over every update of every rank."""
        return torch.exp(super().compute())
