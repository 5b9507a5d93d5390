"""Mixture-of-Experts feed-forward: router, packed routed experts (grouped GEMM), shared experts.

Follows Mixtral (arXiv:2401.04088) and Qwen-MoE for softmax routing, DeepSeek-V3 (arXiv:2412.19437)
for sigmoid routing with shared experts, Switch Transformer (arXiv:2101.03961) for capacity, and
torchtitan v0.2 (``torchtitan/models/moe``) for packed expert weights run through ``torch.nn.functional.grouped_mm``.
Numerically equal to the HF ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` / ``DeepseekV3MoE``
with the weights copied (see ``tests/unit/test_moe_hf_parity.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.grouped_mm_op import grouped_mm_op
from kempnerforge.model.mlp import FeedForward
from kempnerforge.model.router import Router, load_balancing_loss, sequence_balance_loss, z_loss
from kempnerforge.parallel import ep_dispatch
from kempnerforge.parallel.ep_dispatch import ScaleGrad, dispatch_combine
from kempnerforge.parallel.expert_tensor_parallel import grad_all_reduce


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """True when this torch build runs the grouped GEMM (:data:`_GROUPED_MM`) for ``x``'s device and dtype
    (probed once per (device type, dtype); the answer is cached)."""
    # Fake tensors (kforge estimate) answer with the meta kernel's rules (CUDA's: bf16 only), not this build's
    # CPU kernel: probed and cached apart, so a simulation never changes what real tensors use.
    return _probe_grouped_mm(x.device, x.dtype, isinstance(x, FakeTensor))


# Under torch.compile the probe runs once, eagerly, at trace time (its answer a constant of the graph).
@torch.compiler.assume_constant_result
def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, fake: bool) -> bool:
    key = (device.type, dtype, fake)
    if key not in _GROUPED_MM_PROBE:
        ok = _GROUPED_MM is not None
        if ok:
            try:
                a = torch.ones(2, 8, device=device, dtype=dtype)
                b = torch.ones(2, 8, 8, device=device, dtype=dtype)
                _GROUPED_MM(a, b, offs=torch.arange(1, 3, device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_PROBE[key] = ok
    return _GROUPED_MM_PROBE[key]


_GROUPED_MM_PROBE: dict[tuple[str, torch.dtype, bool], bool] = {}
#: The grouped GEMM: public ``torch.nn.functional.grouped_mm`` (a thin wrapper of the same kernel) where
#: this torch has it, else the private op it wraps (older torch), else None (the per-expert loop).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, use_grouped: bool = True) -> torch.Tensor:
    """Row groups of ``x`` times their expert's weight: ``out[rows of e] = x[rows of e] @ w[e].T``.

    Uses ``torch.nn.functional.grouped_mm`` (one kernel, no host sync) when ``use_grouped`` and the build supports
    it for this device/dtype; otherwise an exact per-expert loop over ``x.split(counts)`` (one host
    sync for the split sizes). Experts with zero rows are fine on both paths.

    Args:
        x: (rows, in) rows sorted by expert.
        w: (num_experts, out, in) packed expert weights (nn.Linear layout per expert).
        counts: (num_experts,) int64 rows per expert, summing to at most ``rows``; rows after the last
            group belong to no expert: their output rows are unspecified (zeros on the loop path) and
            the caller masks them.
        use_grouped: allow the grouped kernel (False forces the loop, e.g. for tests).

    Returns:
        (rows, out) in ``x``'s dtype.
    """
    if use_grouped and grouped_mm_supported(x):
        return _grouped_mm_offs(x, w, group_offsets(counts))
    hook = ep_dispatch.SPLITS_HOOK  # kforge estimate: fake counts have no values to read back
    # The loop needs host sizes (a host sync; the grouped kernel does not).
    sizes = hook(x, counts.numel())[0] if hook is not None else counts.tolist()
    rest = x.shape[0] - sum(sizes)  # rows after the last group (dropped assignments): zeros
    chunks = x.split([*sizes, rest])
    return torch.cat([chunk @ w[e].T for e, chunk in enumerate(chunks[:-1])] + [x.new_zeros(rest, w.shape[1])], dim=0)


def group_offsets(counts: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM's ``offs``: (num_experts,) int32 cumulative row ends of ``counts`` (on its device)."""
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def _grouped_mm_offs(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm`'s kernel path with the offsets already computed (one cumsum per expert layer)."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        # The native op's fake kernel refuses these dtypes (see grouped_mm_op); same eager kernel.
        return grouped_mm_op(x, w.transpose(-2, -1), offs)
    out = _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    if out.requires_grad and not torch.compiler.is_compiling():
        # The CPU backward rejects expanded (stride-0) output grads, e.g. from a plain .sum().
        out.register_hook(lambda g: g.contiguous())
    return out


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts with packed weights: ``w2_e(silu(w1_e x) * w3_e x)``.

    Parameters ``w1``, ``w3``: (num_experts, hidden, dim); ``w2``: (num_experts, dim, hidden). Expert
    parallelism shards them on dim 0. HF Mixtral's ``gate_up_proj`` is ``cat([w1, w3], dim=1)`` and its
    ``down_proj`` is ``w2``.

    Under expert parallelism (:func:`kempnerforge.parallel.expert_parallel.apply_ep` sets ``ep_group``),
    the weights are DTensors sharded on dim 0 over the ``ep`` mesh, and rows travel to the rank owning
    their expert and back (:func:`~kempnerforge.parallel.ep_dispatch.dispatch_combine`).

    Under tensor parallelism (:class:`~kempnerforge.parallel.expert_tensor_parallel.ExpertTensorParallel` sets
    ``tp_mesh``) each weight holds this rank's slice of every expert's hidden channels and the output is this
    rank's partial sum (the MoE layer reduces it over TP); with both, the weights are DTensors on the 2-D
    ``(ep, tp)`` mesh.

    Shapes: forward(x (rows, dim) sorted by expert, counts (num_experts,)) -> (rows, dim).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = True
        self.ep_group = None
        self.ep_size = 1
        self.tp_mesh = None
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run each row through its expert (see :func:`grouped_mm`)."""
        if self.ep_group is None:
            return self._local(x, counts)
        return dispatch_combine(x, counts, self.ep_group, self.ep_size, self._local)

    def _weight(self, w: torch.Tensor) -> torch.Tensor:
        if isinstance(w, DTensor):  # expert- / tensor-parallel: this rank's experts and hidden channels only
            return ScaleGrad.apply(w.to_local(), 1.0 / self.ep_size)
        return w

    def _local(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._weight(self.w1), self._weight(self.w2), self._weight(self.w3)
        if self.use_grouped_mm and grouped_mm_supported(x):
            offs = group_offsets(counts)  # once for the three GEMMs
            h = F.silu(_grouped_mm_offs(x, w1, offs)) * _grouped_mm_offs(x, w3, offs)
            return _grouped_mm_offs(h, w2, offs)
        h = F.silu(grouped_mm(x, w1, counts, False)) * grouped_mm(x, w3, counts, False)
        return grouped_mm(h, w2, counts, False)


@dataclass
class MoEStats:
    """Detached statistics of one MoE forward (read by the training loop for balancing and logging).

    Attributes:
        counts: (num_experts,) fp32 assignments routed to each expert, before capacity dropping.
        dropped: scalar fp32 number of assignments dropped by the capacity limit.
        assignments: tokens * top_k of this forward.
        lb_loss, seq_loss, z_loss: scalar fp32 values of the three auxiliary losses (unweighted).
    """

    counts: torch.Tensor
    dropped: torch.Tensor
    assignments: int
    lb_loss: torch.Tensor
    seq_loss: torch.Tensor
    z_loss: torch.Tensor


class MoE(nn.Module):
    """Routed + shared experts replacing a block's dense feed-forward.

    ``out = sum_k w_k * expert_{i_k}(x) + gate(x) * sum_s shared_s(x)`` per token (gate = 1 unless
    ``shared_expert_gate``). With ``capacity_factor`` c > 0, expert capacity is
    ``ceil(c * tokens * top_k / num_experts)`` and the assignments beyond it, in token order, are
    dropped (their tokens keep only the residual and the shared experts, Switch Transformer sec. 2.2).

    Under activation checkpointing (``save_routing``, set by
    :func:`kempnerforge.parallel.activation_checkpoint.apply_ac`) the recomputation reuses the expert
    indices chosen by the original forward, so a bias update or a kernel's non-determinism between
    forward and backward cannot change the routing. The choices wait in a first-in first-out queue of
    ``saved_routing_depth`` forwards (1; a pipeline stage runs up to all its micro-batches' forwards before
    their backwards, in the same order, and sets it to the micro-batch count + 1).

    After each forward, :attr:`aux_loss` holds the weighted sum of the enabled auxiliary losses
    (differentiable, scalar fp32; 0 when all weights are 0) and :attr:`stats` the detached
    :class:`MoEStats`. Neither is in the state dict.

    Under tensor parallelism (``experts.tp_mesh`` set, :mod:`kempnerforge.parallel.expert_tensor_parallel`) the
    input is replicated over TP, the router runs on every TP rank alike, and the output is a partial sum over TP
    (the TP plan reduces it at the layer boundary).

    Shapes: forward(x (batch, seq, dim)) -> (batch, seq, dim).
    """

    is_moe = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.expert_hidden
        self.router = Router(
            config.dim,
            config.num_experts,
            config.top_k,
            config.router,
            config.router_renormalize,
            config.route_scale,
            config.num_expert_groups,
            config.num_limited_groups,
        )
        self.experts = GroupedExperts(config.dim, hidden, config.num_experts)
        self.shared_experts = nn.ModuleDict(
            {str(i): FeedForward(config.dim, hidden) for i in range(config.n_shared_experts)}
        )
        self.shared_gate = nn.Linear(config.dim, 1, bias=False) if config.shared_expert_gate else None
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        # Set by apply_ac on checkpointed blocks: the forward keeps its expert choice so the
        # recomputation in backward routes exactly the same tokens (not in the state dict).
        self.save_routing = False
        self.saved_routing_depth = 1
        self._saved_indices: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, run the experts, combine (see class docstring)."""
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        route = self.router(tokens, self._routing_for_recompute())
        # torch._C._current_graph_task_id: -1 outside a backward; torch has no public way to tell (checkpoint uses it).
        if self._reuse_routing() and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            # The oldest forward's choice is recomputed first; beyond the depth the oldest is dropped.
            self._saved_indices = [*self._saved_indices, route.indices.detach()][-self.saved_routing_depth :]
        flat_experts = route.indices.reshape(-1)  # (tokens * top_k,), assignment a = token * k + slot
        # scatter_add, not bincount: bincount's output size depends on the data (a host sync on CUDA).
        counts = torch.zeros(self.config.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        # Stable sort: assignments grouped by expert, in token order inside each group.
        order = torch.argsort(flat_experts, stable=True)
        kept_counts, dropped, keep = counts, torch.zeros((), device=x.device), None
        if self.config.capacity_factor > 0:
            order, kept_counts, keep = self._apply_capacity(order, flat_experts, counts)
            dropped = (counts - kept_counts).sum().float()
        token_idx = order // self.config.top_k
        gate_w = route.weights.reshape(-1).index_select(0, order).to(tokens.dtype)
        tp, expert_in = self.experts.tp_mesh, tokens
        if tp is not None:  # the experts' outputs are partial over TP: so are these two tensors' gradients
            expert_in, gate_w = grad_all_reduce(tokens, tp), grad_all_reduce(gate_w, tp)
        # index_select, not x[idx]: its backward is an index_add, not the slower accumulating index_put.
        if keep is None:
            routed = self.experts(expert_in.index_select(0, token_idx), kept_counts)
        else:
            # Fixed shapes, no host sync: every assignment keeps its row; dropped ones sit after the kept
            # rows (beyond the experts' groups, so no expert computes them), read a zero row appended to
            # the tokens (whatever the grouped GEMM leaves in their output rows, and in their gradients,
            # never reaches a real token) and are masked out of the combine.
            padded = torch.cat([expert_in, tokens.new_zeros(1, dim)])
            routed = self.experts(padded.index_select(0, torch.where(keep, token_idx, tokens.shape[0])), kept_counts)
            routed = torch.where(keep[:, None], routed, 0)
        # The combine accumulates into the shared experts' output (one out-of-place index_add: no zero-filled
        # buffer, no extra sum); the backward of index_add is one index_select.
        shared = self._shared(tokens, tp)
        base = torch.zeros_like(tokens) if shared is None else shared
        out = base.index_add(0, token_idx, routed * gate_w[:, None].to(routed.dtype))
        self._record(route, counts, dropped, batch)
        return out.view(batch, seq, dim)

    def _shared(self, tokens: torch.Tensor, tp) -> torch.Tensor | None:
        """Sum of the shared experts on ``tokens`` (tokens, dim), gated when ``shared_expert_gate``; None without."""
        experts = list(self.shared_experts.values())
        if not experts:
            return None
        shared = experts[0](tokens)
        for expert in experts[1:]:
            shared = shared + expert(tokens)
        if self.shared_gate is not None:
            gate = torch.sigmoid(self.shared_gate(tokens))
            shared = (gate if tp is None else grad_all_reduce(gate, tp)) * shared
        return shared

    def discard_saved_routing(self) -> None:
        """Forget the newest saved expert choice: its forward's backward will not recompute it (the
        pipeline schedule's shape-inference pass); a no-op without activation checkpointing."""
        if self._saved_indices:
            self._saved_indices.pop()

    def _reuse_routing(self) -> bool:
        # Compiled (per-block compile of a checkpointed block), the recomputation is part of the compiled
        # backward graph: no Python reruns, and the partitioner either saves the expert indices or recomputes
        # top-k from the forward's saved (version-checked) inputs, so the routing cannot change either way.
        return self.save_routing and not torch.compiler.is_compiling()

    def _routing_for_recompute(self) -> torch.Tensor | None:
        """The expert choice saved by the original forward when this forward is an activation-checkpointing
        recomputation (it runs inside a backward graph task), else None (route afresh)."""
        if not self._reuse_routing() or torch._C._current_graph_task_id() == -1:
            return None
        return self._saved_indices.pop(0) if self._saved_indices else None

    def _apply_capacity(
        self, order: torch.Tensor, flat_experts: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keep the first ``capacity`` assignments of each expert (``order`` is grouped by expert).

        Returns:
            ``(order, kept_counts, keep)``: all assignments, the kept ones grouped by expert (in token
            order) followed by the dropped ones; the kept rows per expert; and the (assignments,) bool
            mask of the kept ones in that order. Shapes do not depend on the data (no host sync).
        """
        cfg = self.config
        capacity = math.ceil(cfg.capacity_factor * flat_experts.numel() / cfg.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        sorted_experts = flat_experts.index_select(0, order)
        rank = torch.arange(order.numel(), device=order.device)
        keep = rank - starts.index_select(0, sorted_experts) < capacity
        # Kept rows stay grouped by expert in token order; the dropped ones move to the end, in order. A stable
        # partition: each row's new place from prefix counts (a scan and a scatter, not a second sort).
        kept_before = torch.cumsum(keep, 0) - keep.long()
        n_kept = kept_before[-1:] + keep[-1:].long()
        dest = torch.where(keep, kept_before, n_kept + rank - kept_before)
        new_order = torch.empty_like(order).scatter_(0, dest, order)
        return new_order, counts.clamp(max=capacity), rank < n_kept

    def _record(self, route, counts: torch.Tensor, dropped: torch.Tensor, batch: int) -> None:
        cfg = self.config
        lb = load_balancing_loss(route.probs, counts, cfg.top_k)
        seq_l = sequence_balance_loss(route.probs, route.indices, batch)
        z = z_loss(route.logits)
        aux = torch.zeros((), device=lb.device)
        for weight, value in ((cfg.aux_loss_weight, lb), (cfg.seq_aux_loss_weight, seq_l), (cfg.z_loss_weight, z)):
            if weight > 0:
                aux = aux + weight * value
        self.aux_loss = aux
        self.stats = MoEStats(
            counts.detach().float(), dropped, route.indices.numel(), lb.detach(), seq_l.detach(), z.detach()
        )
