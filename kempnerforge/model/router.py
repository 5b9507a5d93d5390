"""Top-k token routers for Mixture-of-Experts layers.

- ``softmax``: Mixtral (arXiv:2401.04088) / Qwen-MoE: softmax over all experts, top-k, optional
  renormalization of the k weights (HF ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``).
- ``sigmoid``: DeepSeek-V3 (arXiv:2412.19437, sec. 2.1.2): sigmoid affinities; experts are *selected*
  by affinity + a per-expert bias, but the gate weights are the unbiased affinities (normalized over
  the k chosen, times ``route_scale``). The bias is a buffer (the optimizer never sees it), updated
  once per optimizer step by :meth:`Router.update_bias` from the all-reduced expert load
  (auxiliary-loss-free load balancing, Wang et al., arXiv:2408.15664).

Either router can limit each token to its best ``num_limited_groups`` of ``num_groups`` expert groups
(DeepSeek-V3's node-limited routing, :meth:`Router.select`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RouterOutput:
    """What a router returns for ``tokens`` routed tokens.

    Attributes:
        logits: (tokens, num_experts) fp32 router logits (z-loss input).
        probs: (tokens, num_experts) fp32 per-expert affinities summing to 1 per token (softmax
            probabilities, or sigmoid scores divided by their sum): the load-balancing losses use these.
        indices: (tokens, top_k) int64 chosen experts.
        weights: (tokens, top_k) fp32 gate weights of the chosen experts.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """Linear gate + top-k selection.

    Args:
        dim: model width, channels.
        num_experts: routed experts.
        top_k: experts per token.
        score_func: ``"softmax"`` or ``"sigmoid"``.
        renormalize: divide the k weights by their sum (sigmoid: + 1e-20 as DeepSeek-V3's HF code).
        route_scale: multiplier on the gate weights (DeepSeek-V3 ``routed_scaling_factor``).
        num_groups, num_limited_groups: group-limited routing (DeepSeek-V3 ``n_group`` / ``topk_group``, see
            :meth:`select`); 1 = off.

    ``gate.weight`` (num_experts, dim) is the HF router ``weight``; ``expert_bias`` (num_experts,) fp32 is
    HF DeepSeek-V3's ``e_score_correction_bias``: a persistent buffer (checkpointed, so a resumed run
    routes the same), zero for the softmax router.

    Shapes: forward(x (tokens, dim)) -> :class:`RouterOutput`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str,
        renormalize: bool,
        route_scale: float,
        num_groups: int = 1,
        num_limited_groups: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_groups = num_groups
        self.num_limited_groups = num_limited_groups
        self.score_func = score_func
        self.renormalize = renormalize
        self.route_scale = route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, indices: torch.Tensor | None = None) -> RouterOutput:
        """Route ``x`` (tokens, dim); with ``indices`` (tokens, top_k) given, reuse that selection (an
        activation-checkpointing recomputation) and only recompute the differentiable weights."""
        logits = self.gate(x).float()
        if self.score_func == "softmax":
            probs = torch.softmax(logits, dim=-1)
            # Selection on detached values, weights by gather: the same autograd graph whether the
            # indices are chosen here or reused by an activation-checkpointing recomputation.
            if indices is None:
                indices = self.select(probs.detach())
            weights = probs.gather(1, indices)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            scores = torch.sigmoid(logits)
            # The bias only changes which experts are chosen, never the weights (DeepSeek-V3 eq. 16).
            if indices is None:
                indices = self.select(scores.detach() + self.expert_bias)
            weights = scores.gather(1, indices)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return RouterOutput(logits, probs, indices, weights * self.route_scale if self.route_scale != 1.0 else weights)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """The top_k experts of each token by ``scores`` (tokens, num_experts) (detached, biased for sigmoid).

        With ``num_groups > 1`` (group-limited routing, DeepSeek-V3 arXiv:2412.19437 sec. 2.1.2 / HF
        ``DeepseekV3TopkRouter``): the experts form ``num_groups`` consecutive equal groups, a group's score is the
        sum of its two highest expert scores, each token keeps its ``num_limited_groups`` best groups and picks its
        top_k experts among theirs (on a cluster, each group is a node: a token's experts span few nodes).

        Returns:
            (tokens, top_k) int64 expert indices.
        """
        if self.num_groups > 1:
            grouped = scores.view(scores.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (tokens, num_groups)
            best = group_scores.topk(self.num_limited_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            scores = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
        return torch.topk(scores, self.top_k, dim=-1).indices

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """One aux-loss-free balancing step: ``bias += rate * sign(mean(load) - load)``, then center it.

        Overloaded experts get a lower bias (chosen less), underloaded a higher one. Centering (zero
        mean) keeps the bias from drifting, which changes no selection (top-k is shift-invariant).

        Args:
            load: (num_experts,) tokens routed to each expert over one optimizer step, summed over
                every data-parallel rank (identical on all ranks, so every replica updates alike).
            rate: update speed gamma (DeepSeek-V3 used 0.001).
        """
        load = load.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))
        self.expert_bias.sub_(self.expert_bias.mean())


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss, mean over tokens of logsumexp(logits)^2 (ST-MoE, arXiv:2202.08906 eq. 5).

    Shapes: logits (tokens, num_experts) -> scalar fp32.
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_i f_i * P_i`` (arXiv:2101.03961 eq. 4-6).

    ``f_i`` = fraction of the ``tokens * top_k`` assignments sent to expert i (before capacity
    dropping), ``P_i`` = mean router probability of expert i. Equals 1 under perfect balance; same
    value as HF ``load_balancing_loss_func`` divided by top_k.

    Shapes: probs (tokens, E), counts (E,) -> scalar fp32.
    """
    num_experts = probs.shape[-1]
    f = counts.float() / counts.sum().clamp(min=1)
    return num_experts * (f * probs.float().mean(dim=0)).sum()


def sequence_balance_loss(probs: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, mean over sequences (arXiv:2412.19437 eq. 17-20).

    Per sequence of length S: ``f_i = E / (k S) * #(tokens choosing i)``, ``P_i = mean_t s'_{t,i}``
    with s' the per-token normalized affinities; loss = ``sum_i f_i P_i`` (1 under balance).

    Shapes: probs (batch * seq, E), indices (batch * seq, k) -> scalar fp32.
    """
    num_experts, top_k = probs.shape[-1], indices.shape[-1]
    seq = probs.shape[0] // batch
    flat = indices.reshape(batch, seq * top_k)
    # Per-sequence counts by scatter_add, not one_hot(...).sum(): no (batch, seq * k, E) temporary, and no min / max
    # read-back (one_hot checks its input's range on the host on CPU).
    chosen = torch.zeros(batch, num_experts, dtype=torch.float32, device=probs.device)
    chosen.scatter_add_(1, flat, torch.ones(flat.shape, dtype=torch.float32, device=probs.device))  # (batch, E)
    f = chosen * (num_experts / (top_k * seq))
    p = probs.float().view(batch, seq, num_experts).mean(dim=1)
    return (f * p).sum(dim=-1).mean()
