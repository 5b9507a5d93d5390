"""Token-weighted perplexity from summed cross-entropy, as a torchmetrics ``Metric``.

``torchmetrics.text.Perplexity`` takes the ``(batch, seq, vocab)`` logits and runs its own softmax over
them; the loss path already has the summed negative log-likelihood, and a pipeline's last stage has only
that sum. :class:`TokenPerplexity` accumulates the sum and the target-token count (reduced across ranks by
summation, as ``Perplexity`` does), so ``compute()`` is ``exp(total NLL / target tokens)`` over every
update on every rank: exactly ``exp(val/loss)`` of the token-weighted mean loss.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TokenPerplexity(Metric):
    """``exp(sum of per-token cross-entropy / number of target tokens)`` over all updates and ranks.

    ``update(nll_sum, n_targets)``: ``nll_sum`` a scalar tensor, the summed cross-entropy (nats) of the
    batch's target tokens; ``n_targets`` a scalar (tensor or int), how many target tokens that sum covers.
    ``compute()`` returns a scalar fp32 tensor (``nan`` before any target token was seen).

    Raises:
        ValueError: in ``update``, ``nll_sum`` or ``n_targets`` is not a scalar.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    total_nll: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # fp64 sums: millions of validation tokens, summed per batch, stay exact to fp32 rounding.
        self.add_state("total_nll", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, nll_sum: torch.Tensor, n_targets: torch.Tensor | int) -> None:
        """Add one batch's summed cross-entropy (nats) and its target-token count."""
        nll_sum = torch.as_tensor(nll_sum)
        n_targets = torch.as_tensor(n_targets)
        if nll_sum.numel() != 1 or n_targets.numel() != 1:
            raise ValueError(
                f"TokenPerplexity.update takes scalars (summed NLL, target tokens); got shapes "
                f"{tuple(nll_sum.shape)} and {tuple(n_targets.shape)}"
            )
        self.total_nll += nll_sum.detach().reshape(()).to(self.total_nll)
        self.count += n_targets.detach().reshape(()).to(self.count)

    def compute(self) -> torch.Tensor:
        """The perplexity, a scalar fp32 tensor."""
        return torch.exp(self.total_nll / self.count).float()
