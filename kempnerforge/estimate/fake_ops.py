"""What the simulated step does where fake tensors cannot answer: routing assumptions and analytic fallbacks.

Fake tensors carry shapes, never values, so an op whose output shape depends on data (``nonzero``, boolean
indexing, reading split sizes back to the host) or an op without a fake / meta kernel cannot run. Two answers:

- :func:`balanced_routing`: MoE expert parallelism reads the all-to-all split sizes back from the exchanged
  expert counts. The simulation assumes balanced routing (every EP rank receives ``rows / ep`` rows from every
  rank), the load a balanced run converges to; a skewed load needs more memory on the hot ranks.
- :class:`AnalyticFallback`: any other such failure inside a block, or inside one of a block's residual-stream
  children (attention, feed-forward, MoE), is caught at the innermost such module. Its output is replaced by a
  stand-in of the input's shape that keeps the autograd graph (its parameters still get full-size gradients),
  holds an analytic activation buffer until backward and adds analytic FLOPs; the module and the reason are
  reported. Never a silent zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.distributed.tensor import DTensor

import kempnerforge.parallel.ep_dispatch as ep_dispatch
from kempnerforge.model.init import canonical_fqn

#: Exceptions that mean "this cannot run on fake tensors" (not a bug in the model).
FAKE_TENSOR_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
)

#: Names of a block's children whose output has the input's (batch, seq, dim) shape.
RESIDUAL_CHILDREN: frozenset[str] = frozenset({"attention", "feed_forward", "moe"})


def balanced_splits(x: torch.Tensor, ep: int) -> tuple[list[int], list[int]]:
    """Rows sent to and received from each of ``ep`` ranks when routing is balanced: ``x``'s rows split as
    evenly as possible, and (every rank being alike) as many received from each rank as sent to it."""
    base, extra = divmod(x.shape[0], ep)
    splits = [base + (1 if i < extra else 0) for i in range(ep)]
    return splits, list(splits)


@contextmanager
def balanced_routing() -> Iterator[None]:
    """Make expert-parallel dispatch use :func:`balanced_splits` instead of reading counts back (see
    :data:`kempnerforge.parallel.ep_dispatch.SPLITS_HOOK`); restored on exit."""
    saved = ep_dispatch.SPLITS_HOOK
    ep_dispatch.SPLITS_HOOK = balanced_splits
    try:
        yield
    finally:
        ep_dispatch.SPLITS_HOOK = saved


class FakeTensorLimitError(RuntimeError):
    """A step that cannot run on fake tensors outside what :class:`AnalyticFallback` covers (e.g. a vision
    encoder or a model-wide index map reading values back to the host); the message names the code."""


def describe_failure(err: BaseException) -> str:
    """Where a fake-tensor failure happened: the innermost project frame (and the module whose method it is)
    and the op, e.g. ``"ModalityDispatch.__init__ (kempnerforge/model/vlm/dispatch.py:53), inside
    MoTBackbone.forward: aten._local_scalar_dense.default"``."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "/kempnerforge/" in code.co_filename and "/kempnerforge/estimate/" not in code.co_filename:
            owner = tb.tb_frame.f_locals.get("self")
            where = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
            path = code.co_filename[code.co_filename.rindex("/kempnerforge/") + 1 :]
            frames.append((where, f"{path}:{tb.tb_lineno}", isinstance(owner, nn.Module)))
        tb = tb.tb_next
    op = getattr(err, "func", None) or err
    if not frames:
        return str(op)
    where, at, _ = frames[-1]
    module = next((w for w, _, is_module in reversed(frames[:-1]) if is_module), None)
    return f"{where} ({at})" + (f", inside {module}" if module else "") + f": {op}"


@contextmanager
def separate_sharding_propagation() -> Iterator[None]:
    """Run DTensor's sharding propagation under its own ``FakeTensorMode`` while simulating.

    DTensor infers every op's global output shape by running the op on global-shape fake tensors, under the
    active fake mode if there is one (``detect_fake_mode() or FakeTensorMode()``). Under the simulation's fake
    mode those global-shape tensors look like real allocations to the memory tracker (which tells them apart
    only by the fake mode they run under): one ``_foreach_mul_`` over every gradient in clipping then counted
    the whole unsharded model once more. With this, propagation never sees the simulation's mode, as in a
    real (non-fake) run; restored on exit.
    """
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


@dataclass
class FallbackRecord:
    """One module the simulation could not run on fake tensors, counted analytically instead.

    Attributes:
        module: canonical FQN (e.g. ``layers.3.moe``).
        reason: the exception type and the op it names.
        calls: forward calls replaced (activation recomputation counts again).
        flops: analytic FLOPs added (forward + backward, all calls).
        activation_bytes: analytic activation bytes held per call until its backward.
    """

    module: str
    reason: str
    calls: int = 0
    flops: int = 0
    activation_bytes: int = 0


def _analytic_cost(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(forward FLOPs, saved activation bytes) of ``module`` on ``x`` (..., dim).

    MoE layers: routed ``top_k`` and shared SwiGLU experts (3 matmuls of dim x expert width each) plus the
    router; saved: the dispatched rows, the three expert intermediates and the output per assignment, and the
    fp32 router logits / probabilities. Other modules: ``2 * tokens * parameters`` FLOPs and 4x the input
    bytes saved (input, output and two intermediates of its width), a deliberately rough count.
    """
    tokens, dim, b = x.numel() // x.shape[-1], x.shape[-1], x.element_size()
    cfg = getattr(module, "config", None)
    if getattr(module, "is_moe", False) and cfg is not None:
        hidden, k, shared, experts = cfg.expert_hidden, cfg.top_k, cfg.n_shared_experts, cfg.num_experts
        flops = 2 * tokens * (k + shared) * 3 * dim * hidden + 2 * tokens * dim * experts
        saved = tokens * (k + shared) * (2 * dim + 3 * hidden) * b + 3 * tokens * experts * 4
        return flops, saved
    params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    return 2 * tokens * params, 4 * x.numel() * b


class _StandIn(torch.autograd.Function):
    """Identity on ``x`` that saves ``buffer`` for backward and gives ``params`` zero gradients."""

    @staticmethod
    def forward(ctx, x, buffer, add_flops, backward_flops, *params):
        ctx.save_for_backward(buffer)
        ctx.add_flops, ctx.backward_flops = add_flops, backward_flops
        ctx.param_meta = [(p.shape, p.dtype, p.device) for p in params]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.add_flops(ctx.backward_flops)
        zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.param_meta]
        return (grad, None, None, None, *zeros)


class AnalyticFallback:
    """Wraps the forward of every block of ``model.layers`` (and of the blocks' residual children) so that a
    fake-tensor failure inside it falls back to an analytic count (see the module docstring).

    Args:
        models: the modules whose ``layers`` blocks are wrapped (a pipeline rank's pruned model).
        add_flops: callback receiving analytic FLOPs (the step's :class:`~kempnerforge.estimate.counters.StepCounter`).

    Attributes:
        records: ``{module fqn: FallbackRecord}``.
    """

    def __init__(self, model: nn.Module, add_flops) -> None:
        self.model = model
        self.add_flops = add_flops
        self.records: dict[str, FallbackRecord] = {}
        self._wrapped: list[nn.Module] = []

    def _candidates(self) -> Iterator[tuple[str, nn.Module]]:
        layers = getattr(self.model, "layers", None)
        if layers is None:
            return
        for name, block in layers.named_children():
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            inner = getattr(inner, "_orig_mod", inner)
            yield f"layers.{name}", inner
            for child_name, child in inner.named_children():
                if child_name in RESIDUAL_CHILDREN:
                    yield f"layers.{name}.{child_name}", child

    def __enter__(self) -> AnalyticFallback:
        for fqn, module in self._candidates():
            module.forward = self._wrap(canonical_fqn(fqn), module, module.forward)
            self._wrapped.append(module)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module in self._wrapped:
            del module.forward  # back to the class's forward
        self._wrapped = []

    def _wrap(self, fqn: str, module: nn.Module, forward):
        def guarded(*args, **kwargs):
            try:
                return forward(*args, **kwargs)
            except FAKE_TENSOR_ERRORS as err:
                x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                return self._stand_in(fqn, module, x, err)

        return guarded

    def _stand_in(self, fqn: str, module: nn.Module, x: torch.Tensor, err: BaseException) -> torch.Tensor:
        flops, saved = _analytic_cost(module, x)
        op = getattr(err, "func", None)
        record = self.records.setdefault(fqn, FallbackRecord(fqn, f"{type(err).__name__}: {op or err}"))
        record.calls += 1
        record.flops += 3 * flops
        record.activation_bytes = saved
        self.add_flops(flops)
        params = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if p.requires_grad]
        buffer = torch.empty(saved, dtype=torch.uint8, device=x.device)
        if getattr(module, "is_moe", False):
            _neutral_moe_outputs(module, x)
        return _StandIn.apply(x, buffer, self.add_flops, 2 * flops, *params)


def _neutral_moe_outputs(moe: nn.Module, x: torch.Tensor) -> None:
    """What the module's loss path reads from an MoE layer after its forward (``aux_loss``, ``stats``), as
    zeros: the layer's forward did not finish, and its balance losses are scalars (no memory to count)."""
    from kempnerforge.model.moe import MoEStats

    zero = torch.zeros((), device=x.device)
    counts = torch.zeros(moe.config.num_experts, device=x.device)
    moe.aux_loss = zero
    moe.stats = MoEStats(counts, zero, x.numel() // x.shape[-1] * moe.config.top_k, zero, zero, zero)
