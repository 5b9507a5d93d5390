"""Per-sequence expert-choice routing within one modality's expert group (MoMa, arXiv:2407.21770 sec. 2.2).

Expert choice (Zhou et al. 2022, arXiv:2202.09368): instead of each token picking experts, each
expert picks the ``capacity`` tokens with the highest affinity, so loads are balanced by construction.
MoMa applies it inside each modality's group and scores with a sigmoid (each expert's gate is
independent of the others' scores).

Choices are made per sequence, not per micro-batch: only the tokens of one sample compete, so the
routing does not depend on how a global batch is split over data-parallel ranks or micro-batches.
Padded tokens never take capacity (their affinity is -inf), and the capacity comes from the count of
real tokens of the modality in that sample: ``min(n_real, ceil(capacity_factor * n_real / n_experts))``.

Expert choice is NOT causal: whether token t is chosen depends on the scores of later tokens of the
same sample. It is for training only; autoregressive decoding (``kforge generate``) must refuse it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kempnerforge.model.moe import GroupedExperts


@dataclass
class ExpertChoice:
    """The routing of one forward of :class:`ExpertChoiceFFN` (detached, for inspection and tests).

    Attributes:
        token: (batch, num_experts, k) int64 position (within the modality's tokens of the sample)
            chosen by each expert; ``k`` is the largest capacity in the batch.
        valid: (batch, num_experts, k) bool, False where a slot lies beyond that sample's capacity.
        capacity: (batch,) int64 tokens each expert takes in each sample.
    """

    token: torch.Tensor
    valid: torch.Tensor
    capacity: torch.Tensor


def expert_capacity(n_real: torch.Tensor, capacity_factor: float, num_experts: int) -> torch.Tensor:
    """Tokens each expert takes per sample: ``min(n_real, ceil(capacity_factor * n_real / num_experts))``.

    Args:
        n_real: (batch,) int64 real (unpadded) tokens of the modality in each sample.
        capacity_factor: > 0; 1.0 processes every token once on average.
        num_experts: experts in the group (>= 1).

    Returns:
        (batch,) int64.
    """
    # float64 with a small guard against rounding up: 1.1 * 90 / 3 is 33.00000000000001; its capacity is 33, not 34.
    cap = torch.ceil(n_real.double() * capacity_factor / num_experts - 1e-9).long()
    return torch.minimum(cap.clamp(min=0), n_real)


def expert_choice(scores: torch.Tensor, real: torch.Tensor | None, capacity_factor: float) -> ExpertChoice:
    """Each expert picks its top-capacity real tokens of each sample (arXiv:2202.09368, eq. 1-2).

    Args:
        scores: (batch, tokens, num_experts) router affinities (any monotone scale).
        real: (batch, tokens) bool, True at real tokens, or None (all real).
        capacity_factor: see :func:`expert_capacity`.

    Returns:
        :class:`ExpertChoice`; slots beyond a sample's capacity are marked invalid. ``k`` is the capacity
        of a sample without padding (a bound known on the host, so nothing is read back from the device).
    """
    bsz, n_tok, n_exp = scores.shape
    if real is None:
        real = torch.ones(bsz, n_tok, dtype=torch.bool, device=scores.device)
    capacity = expert_capacity(real.sum(1), capacity_factor, n_exp)
    k = (
        min(n_tok, max(0, math.ceil(n_tok * capacity_factor / n_exp - 1e-9))) if bsz else 0
    )  # expert_capacity on the host
    masked = scores.detach().float().masked_fill(~real[..., None], float("-inf")).transpose(1, 2)
    token = masked.topk(k, dim=-1).indices  # (batch, experts, k)
    valid = torch.arange(k, device=scores.device)[None, None, :] < capacity[:, None, None]
    return ExpertChoice(token=token, valid=valid.expand_as(token), capacity=capacity)


class ExpertChoiceFFN(nn.Module):
    """One modality's group of SwiGLU experts behind a sigmoid expert-choice router.

    ``out[t] = sum over experts e that chose t of sigmoid(router(x)[t, e]) * expert_e(x[t])``; a token
    no expert chose gets 0 (the block's residual carries it). Experts are packed
    (:class:`~kempnerforge.model.moe.GroupedExperts`, ``torch._grouped_mm`` where supported).

    Not an ``is_moe`` layer: expert parallelism and the token-choice MoE statistics do not apply.
    ``data_dependent_shapes`` makes per-block ``torch.compile`` refuse it (token-choice MoE layers compile;
    this module is not verified under compile, although its shapes are fixed and its grouped GEMM takes
    offsets computed on the device).
    After each forward, :attr:`routing` holds the detached :class:`ExpertChoice`.

    Args:
        dim: model width, channels.
        hidden: SwiGLU width of one expert, channels.
        num_experts: experts in this group.
        capacity_factor: see :func:`expert_capacity`.

    Shapes: forward(x (batch, tokens, dim), real (batch, tokens) bool or None) -> (batch, tokens, dim).
    """

    data_dependent_shapes = True

    def __init__(self, dim: int, hidden: int, num_experts: int, capacity_factor: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.routing: ExpertChoice | None = None

    def forward(self, x: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """Route each sample's tokens, run the experts on the chosen ones, combine (class docstring)."""
        bsz, n_tok, dim = x.shape
        gates = torch.sigmoid(self.router(x).float())  # (batch, tokens, experts), fp32 as the MoE router
        route = expert_choice(gates, real, self.capacity_factor)
        self.routing = route
        # Rows grouped by expert (the layout GroupedExperts wants): (experts, batch, k) flattened row-major.
        # Every slot is a row (fixed shapes, no host sync); slots beyond a sample's capacity (padding) are
        # computed and weighted 0, so they change neither the output nor any gradient.
        token = route.token.permute(1, 0, 2)
        keep = route.valid.permute(1, 0, 2).reshape(-1)
        sample = torch.arange(bsz, device=x.device)[None, :, None].expand_as(token)
        expert = torch.arange(self.num_experts, device=x.device)[:, None, None].expand_as(token).reshape(-1)
        flat = (sample * n_tok + token).reshape(-1)  # (rows,) index into x.reshape(-1, dim)
        counts = torch.full((self.num_experts,), bsz * token.shape[-1], dtype=torch.long, device=x.device)
        routed = self.experts(x.reshape(-1, dim)[flat], counts)
        gate = gates.reshape(-1, self.num_experts)[flat, expert] * keep
        out = torch.zeros(bsz * n_tok, dim, dtype=routed.dtype, device=x.device)
        return out.index_add(0, flat, routed * gate[:, None].to(routed.dtype)).view(bsz, n_tok, dim)
