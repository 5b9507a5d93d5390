"""Fits or does not fit, and which change makes it fit: every suggestion estimated again as printed.

A rank needs its tracked peak plus the allowance (:mod:`kempnerforge.estimate.allowance`: CUDA context, NCCL
buffers of the communicators its mesh creates, kernel workspaces, fragmentation); the neediest role decides.

When it does not fit, candidate changes are simulated again with the exact command-line change the report
prints (``kforge fit`` overrides, and ``--num_nodes / --devices_per_node`` for a cluster-size change): every role
of the changed run, after the same layout checks ``kforge fit``'s preflight runs before any process starts
(:meth:`KempnerStrategy.check_layout` through ``setup_environment``, then the data against the model). A change
``kforge fit`` would refuse is dropped, never printed, and so are the larger sizes of its knob. Each printed
suggestion carries its simulated peak and its own allowance (a new layout has other communicators). One knob at a
time (:data:`KNOBS`), each a sequence of sizes tried in order; the first that fits is printed, else the one that
needs the least:

- ``activation_checkpointing``: ``selective_op`` (from ``none`` / ``selective``), then ``full``;
- ``micro_batch_size``: halved, again down to 1 (tokens per step shrink with it);
- ``loss_impl``: ``chunked`` when the run computes full logits (tp = 1, no pipeline: the fused head + loss);
- ``tp``, ``pp``, ``cp``: x2 then x4 at the same world size, the ranks taken from ``dp_shard`` (halved; printed when
  the recipe pins it); ``tp`` with sequence parallelism, inside one node;
- ``gpus``: the world x2, x4, ... x64 (:data:`MAX_GPU_FACTOR`), filling one node up to 8 GPUs first, more nodes
  after; the new ranks join ``dp_shard`` (a pinned one is raised with them). At most :data:`MAX_GPU_TRIES` sizes
  are simulated.

A size is simulated only if its floor, plus the allowance of its layout (its communicators are known without a
step: :func:`~kempnerforge.estimate.allowance.layout_communicators`), fits. The floor at the same world size is
the parameter, gradient and optimizer-state bytes, which no such knob divides (sharded over ``dp_shard x tp x
cp``, or per stage over as many ranks, either way); for more GPUs it is the peak reasoned from the breakdown (the
states divided by the factor, the rest as it is, or the activations' peak if larger: the peak can move from the
optimizer step into the backward).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from kempnerforge.estimate.allowance import Allowance, Communicator, layout_communicators
from kempnerforge.estimate.report import Estimate, RoleEstimate, Suggestion, Verdict, flops_per_token, gb

#: Largest world multiple the ``gpus`` knob suggests.
MAX_GPU_FACTOR = 64
#: Most sizes tried for the ``gpus`` knob (each a simulated step per role).
MAX_GPU_TRIES = 3
STRATEGY = "--trainer.strategy.init_args"
#: The knobs a suggestion may change, in the order they are tried.
KNOBS = ("activation_checkpointing", "micro_batch_size", "loss_impl", "tp", "pp", "cp", "gpus")


@dataclass
class Candidate:
    """One change to try: ``overrides`` (``kforge fit`` arguments) on a ``num_nodes x devices`` cluster.

    Attributes:
        knob, overrides, num_nodes, devices, effect: as :class:`~kempnerforge.estimate.report.Suggestion` prints.
        degrees: the changed run's parallel degrees (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``).
        floor_bytes: a peak below which it cannot go (the states it keeps; for more GPUs the peak reasoned from
            the breakdown): with the layout's allowance above the GPU's memory, it is not simulated.
    """

    knob: str
    overrides: list[str]
    num_nodes: int
    devices: int
    effect: str
    degrees: dict[str, int]
    floor_bytes: int

    def change(self, est: Estimate) -> str:
        """The command-line change as printed: the cluster size when it changes, then the overrides."""
        parts = []
        if (self.num_nodes, self.devices) != (est.num_nodes, est.devices_per_node):
            parts.append(f"--num_nodes {self.num_nodes} --devices_per_node {self.devices}")
        return " ".join(parts + self.overrides)


#: ``candidate -> the changed run's estimate`` (no verdict; None: ``kforge fit`` would refuse it, or it cannot be
#: simulated).
Rerun = Callable[[Candidate], "Estimate | None"]
#: ``degrees -> the communicators of that layout`` (:func:`~kempnerforge.estimate.allowance.layout_communicators`).
Layout = Callable[[dict[str, int]], "list[Communicator]"]


def role_needed(allowance: Allowance, role: RoleEstimate) -> int:
    """Bytes role ``role`` needs: its tracked peak plus its allowance."""
    return allowance.needed(role.peak_bytes, role.communicators)


def _neediest(allowance: Allowance, roles: list[RoleEstimate]) -> RoleEstimate:
    return max(roles, key=lambda r: role_needed(allowance, r))


def _layout(degrees: dict[str, int]) -> list[Communicator]:
    return list(layout_communicators(*(degrees[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))))


def verdict(
    est: Estimate,
    allowance: Allowance,
    module: Any,
    strategy: Any,
    datamodule: Any,
    subclass_mode: bool = False,
    rerun: Rerun | None = None,
    layout: Layout = _layout,
    knobs: Collection[str] = KNOBS,
) -> Verdict:
    """The verdict of ``est`` against its ``gpu_memory_bytes``.

    Args:
        est: the estimate (roles filled in).
        allowance: the allowance model.
        module, strategy, datamodule: the rank-0 components (their settings decide which knobs apply).
        subclass_mode: the recipe names its classes by ``class_path`` (overrides are ``--data.init_args.*``).
        rerun: simulates a candidate change (every role); None: no suggestions.
        layout: the communicators of a layout (for a candidate's allowance before it is simulated).
        knobs: the knobs suggestions may change (a subset of :data:`KNOBS`).
    """
    budget = est.gpu_memory_bytes
    worst = _neediest(allowance, est.roles)
    need = role_needed(allowance, worst)
    terms = allowance.terms(worst.peak_bytes, worst.communicators)
    where = f"worst: rank {worst.rank}, {worst.role}" if len(est.roles) > 1 else worst.role
    head = f"peak {gb(worst.peak_bytes)} + allowance {gb(need - worst.peak_bytes)} = {gb(need)}"
    if need <= budget:
        summary = f"verdict: fits in {gb(budget)}: {head}, headroom {gb(budget - need)} ({where})"
        return Verdict(True, need, budget - need, worst.role, [], summary, terms)
    suggestions = []
    if rerun is not None:
        for knob, sizes in _knobs(est, worst, module, strategy, datamodule, subclass_mode):
            found = _search(est, allowance, sizes, rerun, layout) if knob in knobs else None
            if found is not None:
                suggestions.append(found)
    suggestions.sort(key=lambda s: (not s.fits, s.needed_bytes))
    best = f"; helps most: {suggestions[0].knob} ({suggestions[0].change})" if suggestions else ""
    summary = f"verdict: does not fit in {gb(budget)}: {head} ({where}){best}"
    return Verdict(False, need, budget - need, worst.role, suggestions, summary, terms)


def _search(
    est: Estimate, allowance: Allowance, sizes: Iterator[Candidate], rerun: Rerun, layout: Layout
) -> Suggestion | None:
    """Simulate ``sizes`` in order (those whose floor can fit): the first that fits, else the one that needs the
    least (None: none simulated, or the first simulated was refused: the larger sizes would be too)."""
    best = None
    now = flops_per_token(est)
    tries = 0
    for candidate in sizes:
        try:
            communicators = layout(candidate.degrees)
        except ValueError:  # degrees that do not lay out (MeshConfigError): kforge fit refuses them
            break
        if allowance.needed(candidate.floor_bytes, communicators) > est.gpu_memory_bytes:
            continue
        if candidate.knob == "gpus" and tries == MAX_GPU_TRIES:
            break
        tries += 1
        changed = rerun(candidate)
        if changed is None:
            break
        flops, need = flops_per_token(changed), role_needed(allowance, _neediest(allowance, changed.roles))
        found = Suggestion(
            knob=candidate.knob,
            change=candidate.change(est),
            peak_bytes=max(r.peak_bytes for r in changed.roles),
            needed_bytes=need,
            fits=need <= est.gpu_memory_bytes,
            flops_per_token=flops,
            effect=candidate.effect,
            flops_change=flops / now - 1 if now else 0.0,
        )
        if best is None or found.needed_bytes < best.needed_bytes:
            best = found
        if found.fits:
            return found
    return best


def _knobs(est, worst, module, strategy, datamodule, subclass_mode) -> Iterator[tuple[str, Iterator[Candidate]]]:
    """``(knob, sizes)`` in :data:`KNOBS` order (a knob that does not apply yields no size; sizes are lazy)."""
    # No knob at the same world size divides the states (sharded over dp_shard x tp x cp, or per stage over the
    # same ranks, either way): they are every such candidate's floor.
    states = worst.params_bytes + worst.grads_bytes + worst.optimizer_bytes
    same = {"num_nodes": est.num_nodes, "devices": est.devices_per_node, "floor_bytes": states}
    yield "activation_checkpointing", _ac(strategy, same | {"degrees": est.degrees})
    yield "micro_batch_size", _micro_batch(datamodule, subclass_mode, same | {"degrees": est.degrees})
    yield "loss_impl", _loss_impl(module, strategy, same | {"degrees": est.degrees})
    for axis in ("tp", "pp", "cp"):
        yield axis, _same_world(est, strategy, axis, same)
    yield "gpus", _more_gpus(est, worst, strategy)


def _ac(strategy: Any, same: dict[str, Any]) -> Iterator[Candidate]:
    key, mode = f"{STRATEGY}.activation_checkpointing", strategy.activation_checkpointing
    if mode in ("none", "selective"):  # recompute only the cheap ops first
        yield Candidate(
            "activation_checkpointing",
            [f"{key}=selective_op"],
            effect="recomputes the blocks' cheap ops in backward",
            **same,
        )
    if mode != "full":
        yield Candidate(
            "activation_checkpointing", [f"{key}=full"], effect="recomputes each block's forward in backward", **same
        )


def _micro_batch(datamodule: Any, subclass_mode: bool, same: dict[str, Any]) -> Iterator[Candidate]:
    key = "--data.init_args.micro_batch_size" if subclass_mode else "--data.micro_batch_size"
    mb = getattr(datamodule, "micro_batch_size", 1)
    new = mb // 2
    while new >= 1:
        effect = f"tokens per step / {mb // new} (micro_batch_size {mb} -> {new})"
        yield Candidate("micro_batch_size", [f"{key}={new}"], effect=effect, **same)
        new //= 2


def _loss_impl(module: Any, strategy: Any, same: dict[str, Any]) -> Iterator[Candidate]:
    from kempnerforge.module import VisionLanguage

    dims = strategy.parallel_mesh.dims
    full_logits = getattr(module, "resolved_loss_impl", "torch") == "torch"  # auto already fuses at tp = 1
    if dims.tp == 1 and dims.pp == 1 and full_logits and not isinstance(module, VisionLanguage):
        yield Candidate(
            "loss_impl",
            ["--model.loss_impl=chunked"],
            effect="the fused head + chunked loss: no (tokens, vocab) logits",
            **same,
        )


def _same_world(est: Estimate, strategy: Any, axis: str, same: dict[str, Any]) -> Iterator[Candidate]:
    """``axis`` (tp / pp / cp) x2 then x4, the ranks taken from ``dp_shard`` (pinned: printed)."""
    degree, dp_shard = est.degrees[axis], est.degrees["dp_shard"]
    pinned = strategy._degrees["dp_shard"] != -1
    for factor in (2, 4):
        new = degree * factor
        if dp_shard % factor or (axis == "tp" and new > est.devices_per_node):  # TP stays inside a node
            return
        overrides = [f"{STRATEGY}.{axis}={new}"]
        if axis == "tp" and not strategy.sequence_parallel:
            overrides.append(f"{STRATEGY}.sequence_parallel=true")
        if pinned:
            overrides.append(f"{STRATEGY}.dp_shard={dp_shard // factor}")
        sp = " with sequence parallelism" if axis == "tp" else ""
        effect = (
            f"{axis} {degree} -> {new}{sp}, dp_shard {dp_shard} -> {dp_shard // factor}: tokens per step / {factor}"
        )
        degrees = est.degrees | {axis: new, "dp_shard": dp_shard // factor}
        yield Candidate(axis, overrides, effect=effect, degrees=degrees, **same)


def _cluster(est: Estimate, factor: int) -> tuple[int, int]:
    """``num_nodes x devices`` with ``factor`` times the ranks: one node fills up to 8 GPUs first."""
    nodes, devices = est.num_nodes, est.devices_per_node
    while factor > 1 and nodes == 1 and devices < 8:
        devices, factor = devices * 2, factor // 2
    return nodes * factor, devices


def _more_gpus(est: Estimate, worst: RoleEstimate, strategy: Any) -> Iterator[Candidate]:
    """The world x2, x4, ... x64, the new ranks in ``dp_shard`` (pinned: printed); each size's floor is the peak
    reasoned from the breakdown (the states divided, the rest as it is)."""
    states = sum(worst.peak_breakdown.get(n, 0) for n in ("params", "grads", "optimizer_states", "unsharded_grads"))
    # With the states divided the peak can move from the optimizer step (activations freed) to the backward,
    # where the activations are still held: the larger of the two.
    rest = max(worst.peak_bytes - states, worst.peak_activation_bytes)
    dp_shard, pinned = est.degrees["dp_shard"], strategy._degrees["dp_shard"] != -1
    k = 2
    while k <= MAX_GPU_FACTOR:
        nodes, devices = _cluster(est, k)
        overrides = [f"{STRATEGY}.dp_shard={dp_shard * k}"] if pinned else []
        effect = (
            f"dp_shard {dp_shard} -> {dp_shard * k}: parameters, gradients and optimizer states / {k}, "
            f"tokens per step x{k}"
        )
        yield Candidate(
            "gpus", overrides, nodes, devices, effect, est.degrees | {"dp_shard": dp_shard * k}, rest + states // k
        )
        k *= 2
