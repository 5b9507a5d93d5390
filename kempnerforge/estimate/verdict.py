"""Fits or does not fit, and which knob helps most.

The tracker counts tensor bytes. A real GPU also holds the CUDA context and NCCL's buffers (about 1-2 GB,
outside the caching allocator) and loses some memory to allocator fragmentation; the verdict adds
:data:`RESERVED_BYTES` and :data:`FRAGMENTATION` of the peak for those.

When a configuration does not fit, candidates are scored:

- estimated (simulated again on the worst role, with the one change): ``activation_checkpointing`` =
  ``selective_op`` (from none / selective) and ``full``,
  a halved ``data.micro_batch_size``, ``model.loss_impl=chunked`` when the run computes full logits (the fused
  head + loss never holds them; ``auto`` already fuses at tp=1 without a pipeline), the knobs whose effect on
  activations is not proportional;
- reasoned from the peak's breakdown: more GPUs for FSDP2 (parameters, gradients and optimizer states
  divide by the ``dp_shard`` factor; the rest of the peak is at least the activations' peak, since the peak can
  move from the optimizer step into the backward), and a doubled ``tp`` at the same world size (activations and gathered
  weights halve; states stay, being sharded over ``dp_shard x tp`` either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kempnerforge.estimate.report import Estimate, RoleEstimate, Suggestion, Verdict, gb

#: Bytes per GPU the tracker cannot see: CUDA context and NCCL communicator buffers.
RESERVED_BYTES = 2_000_000_000
#: Share of the tracked peak lost to caching-allocator fragmentation.
FRAGMENTATION = 0.05

STATES = ("params", "grads", "optimizer_states", "unsharded_grads")
GATHERED = ("unsharded_params", "all_gather_buffers", "reduce_scatter_buffers")


def needed(peak: int) -> int:
    """GPU memory a tracked peak of ``peak`` bytes needs (peak + fragmentation + reserved)."""
    return int(peak * (1 + FRAGMENTATION)) + RESERVED_BYTES


def _part(role: RoleEstimate, names: tuple[str, ...]) -> int:
    return sum(role.peak_breakdown.get(n, 0) for n in names)


def _more_gpus(est: Estimate, worst: RoleEstimate, budget: int) -> Suggestion | None:
    """The smallest doubling of the world (more FSDP2 shards) whose reasoned peak fits."""
    states = _part(worst, STATES)
    rest = worst.peak_bytes - states
    nodes, devices = est.num_nodes, est.devices_per_node
    for k in (2, 4, 8, 16, 32, 64):
        # With the states divided the peak can move from where it is now (often the optimizer step, with
        # the activations freed) to the backward, where the activations are still held: take the larger.
        peak = max(rest, worst.peak_activation_bytes) + states // k
        if needed(peak) <= budget or k == 64:
            d, n = devices, nodes
            factor = k
            while factor > 1 and d < 8:
                d, factor = d * 2, factor // 2
            n *= factor
            return Suggestion(
                "dp_shard",
                f"--num_nodes {n} --devices_per_node {d} (dp_shard x{k}: parameters, gradients and optimizer "
                f"states / {k})",
                peak,
                "reasoned",
                needed(peak) <= budget,
            )
    return None


def _tp(est: Estimate, worst: RoleEstimate, model_config: Any, budget: int) -> Suggestion | None:
    tp = est.degrees["tp"]
    new = 2 * tp
    dp_shard = est.degrees["dp_shard"]
    heads = (model_config.n_heads, model_config.n_kv_heads_resolved)
    if dp_shard % 2 or new > est.devices_per_node or any(h % new for h in heads) or model_config.num_experts:
        return None
    states = _part(worst, STATES)
    peak = states + (worst.peak_bytes - states) // 2
    change = (
        f"--trainer.strategy.init_args.tp={new} --trainer.strategy.init_args.sequence_parallel=true "
        "(activations and gathered weights / 2)"
    )
    return Suggestion("tp", change, peak, "reasoned", needed(peak) <= budget)


def verdict(
    est: Estimate,
    module: Any,
    strategy: Any,
    datamodule: Any,
    subclass_mode: bool = False,
    reestimate: Callable[[list[str]], tuple[int, float]] | None = None,
) -> Verdict:
    """The verdict of ``est`` against its ``gpu_memory_bytes``.

    Args:
        est: the estimate (roles filled in).
        module, strategy, datamodule: the rank-0 components (their settings decide which knobs apply).
        subclass_mode: the recipe names its classes by ``class_path`` (overrides are ``--model.init_args.*``).
        reestimate: ``overrides -> (peak bytes, FLOPs per token)`` of the worst role with the fit overrides added, or
            None to only reason from the breakdown.
    """
    budget = est.gpu_memory_bytes
    worst = max(est.roles, key=lambda r: r.peak_bytes)
    need = needed(worst.peak_bytes)
    fits = need <= budget
    where = f"worst: rank {worst.rank}, {worst.role}" if len(est.roles) > 1 else worst.role
    if fits:
        summary = (
            f"verdict: fits in {gb(budget)}: peak {gb(worst.peak_bytes)} + allowance {gb(need - worst.peak_bytes)}"
            f" = {gb(need)}, headroom {gb(budget - need)} ({where})"
        )
        return Verdict(True, need, budget - need, worst.role, [], summary)
    suggestions = _estimated(module, strategy, datamodule, subclass_mode, reestimate, budget)
    for s in (_tp(est, worst, module.config, budget), _more_gpus(est, worst, budget)):
        if s is not None:
            suggestions.append(s)
    suggestions.sort(key=lambda s: (not s.fits, s.peak_bytes))
    best = f"; helps most: {suggestions[0].knob} ({suggestions[0].how})" if suggestions else ""
    summary = (
        f"verdict: does not fit in {gb(budget)}: peak {gb(worst.peak_bytes)} + allowance "
        f"{gb(need - worst.peak_bytes)} = {gb(need)} ({where}){best}"
    )
    return Verdict(False, need, budget - need, worst.role, suggestions, summary)


def _estimated(module, strategy, datamodule, subclass_mode: bool, reestimate, budget: int) -> list[Suggestion]:
    if reestimate is None:
        return []
    candidates: list[tuple[str, list[str]]] = []
    ac = "--trainer.strategy.init_args.activation_checkpointing"
    if strategy.activation_checkpointing in ("none", "selective"):  # recompute only the cheap ops first
        candidates.append(("activation_checkpointing", [f"{ac}=selective_op"]))
    if strategy.activation_checkpointing != "full":
        candidates.append(("activation_checkpointing", [f"{ac}=full"]))
    mb = getattr(datamodule, "micro_batch_size", 1)
    n_micro = strategy.pipeline.microbatches if strategy.pipeline is not None else 1
    if mb >= 2 and (mb // 2) % n_micro == 0:
        key = "--data.init_args.micro_batch_size" if subclass_mode else "--data.micro_batch_size"
        candidates.append(("micro_batch_size", [f"{key}={mb // 2}"]))
    chunkable = strategy.parallel_mesh.dims.tp == 1 and strategy.pipeline is None and not _is_vlm(module)
    if chunkable and getattr(module, "resolved_loss_impl", "torch") == "torch":  # auto already fuses here
        candidates.append(("loss_impl", ["--model.loss_impl=chunked"]))
    out = []
    for knob, overrides in candidates:
        peak, flops_per_token = reestimate(overrides)
        out.append(Suggestion(knob, " ".join(overrides), peak, "estimated", needed(peak) <= budget, flops_per_token))
    return out


def _is_vlm(module: Any) -> bool:
    from kempnerforge.module import VisionLanguage

    return isinstance(module, VisionLanguage)
