"""The estimate's results: per-role numbers, the verdict, and their text and JSON forms.

Units: bytes (printed as GB = 1e9 bytes, the unit GPU datasheets use, and GiB where noted), FLOPs
(printed as TFLOP = 1e12), seconds.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from kempnerforge.estimate.allowance import Communicator, mesh_communicators

#: Tracker states used to measure what a module keeps after its forward.
BEFORE_FORWARD = ("Before Pre-Forward", "Pre-Forward")
AFTER_FORWARD = ("After Post-Forward", "Post-Forward")
AFTER_PRE_FORWARD = ("After Pre-Forward",)
#: Tracker states holding a module's high point while active (as :data:`kempnerforge.estimate.tracker.PEAK_STATES`).
PEAK_STATES = ("Peak Forward", "Peak Backward")


@dataclass
class ModuleMemory:
    """One tracked module (an FSDP2 unit, or any module when nothing is FSDP-wrapped), first forward call.

    Attributes:
        module: FQN under the root (``"<Root> (root)"`` for the root; ``layers.N (xK)`` for K alike blocks).
        gathered_bytes: parameters all-gathered for its forward (unsharded parameters + all-gather buffers).
        activation_bytes: activations still held after its forward (kept for backward).
        peak_bytes: the rank's peak while the module was active (forward or backward); for a group, the highest
            of its members'.
    """

    module: str
    gathered_bytes: int
    activation_bytes: int
    peak_bytes: int


@dataclass
class RoleEstimate:
    """The estimate for one rank standing for a role (every rank alike, or one pipeline position).

    Attributes:
        rank: the simulated global rank; role: what it stands for.
        params_bytes, grads_bytes, optimizer_bytes: local parameters, gradients (end of backward), optimizer states.
        params_global_bytes: this rank's parameters unsharded; sharding: ``params_global_bytes / params_bytes``.
        peak_bytes: peak of tracked tensor bytes over the step; peak_breakdown: by category at that moment.
        peak_activation_bytes: the most activation bytes held at any tracked moment.
        largest_modules: the modules holding the most (gathered + activation bytes), largest first.
        flops: FLOPs executed by this rank in the step (recomputation included).
        comm: collective bytes per step by ``kind[axis]``; comm_calls: calls.
        tokens: tokens of this rank's data shard per step (micro_batch_size x seq_len).
        fallbacks: modules counted analytically (``{"module", "reason", "calls", "flops", "activation_bytes"}``).
        step_seconds: time the simulated step took here.
        communicators: the NCCL communicators (process groups of more than one rank) the mesh created on this
            rank, for the allowance.
        memory: the tracker summary (peak, per-module snapshots), for programmatic checks; not printed.
        timeline: memory over the step, one event per FSDP unit hook (each module's without FSDP2), phase mark and
            highest point between two of them: ``{"phase": "forward" | "backward" | "optimizer", "label",
            "total": bytes, "bytes": {category: bytes}}``; its largest ``total`` is ``peak_bytes``
            (:class:`~kempnerforge.estimate.tracker.Timeline`). In ``--json``, drawn by ``--plot``.
    """

    rank: int
    role: str
    params_bytes: int
    params_global_bytes: int
    sharding: float
    grads_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    peak_breakdown: dict[str, int]
    peak_activation_bytes: int
    largest_modules: list[ModuleMemory]
    flops: int
    comm: dict[str, int]
    comm_calls: dict[str, int]
    tokens: int
    fallbacks: list[dict[str, Any]]
    step_seconds: float
    communicators: list[Communicator] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict, repr=False)
    timeline: list[dict[str, Any]] = field(default_factory=list, repr=False)


@dataclass
class Suggestion:
    """A change that could make it fit, estimated again as printed (every role of the changed run simulated).

    Attributes:
        knob: what changes (``activation_checkpointing``, ``micro_batch_size``, ``loss_impl``, ``gpus``, ``tp``,
            ``pp``, ``cp``).
        change: the command-line change, as given to ``kforge estimate`` (and, but for ``--num_nodes /
            --devices_per_node``, to ``kforge fit``): fit overrides and the cluster size when it changes.
        peak_bytes: the changed run's peak per rank (the highest of its roles), simulated.
        needed_bytes: what the changed run's neediest role needs: its peak plus its allowance (the changed
            layout's own communicators).
        fits: ``needed_bytes`` <= the GPU's memory.
        flops_per_token: the changed run's executed FLOPs per token of its global batch (:func:`flops_per_token`).
        effect: what else changes (degrees, tokens per step, recomputation).
        flops_change: FLOPs per token relative to the run as configured (0.24: 24% more).
        how: always ``"estimated"``: no suggestion is printed without its own simulated step.
    """

    knob: str
    change: str
    peak_bytes: int
    needed_bytes: int
    fits: bool
    flops_per_token: float
    effect: str = ""
    flops_change: float = 0.0
    how: str = "estimated"


@dataclass
class Verdict:
    """Fits or not, against one GPU's memory.

    Attributes:
        fits: every role's ``needed_bytes`` <= the GPU's memory.
        needed_bytes: the neediest role's peak plus its allowance for what the tracker does not see
            (:mod:`kempnerforge.estimate.allowance`: CUDA context, NCCL buffers, kernel workspaces, fragmentation).
        headroom_bytes: GPU memory minus ``needed_bytes`` (negative when it does not fit).
        worst_role: the neediest role.
        suggestions: for a configuration that does not fit, at most one change per knob, fitting ones first, then
            by ``needed_bytes`` (each estimated again).
        summary: one line.
        allowance: the neediest role's allowance by term (``cuda_context``, ``nccl``, ``workspaces``,
            ``fragmentation``; bytes).
    """

    fits: bool
    needed_bytes: int
    headroom_bytes: int
    worst_role: str
    suggestions: list[Suggestion]
    summary: str
    allowance: dict[str, int] = field(default_factory=dict)


@dataclass
class Estimate:
    """The whole estimate of one recipe on one simulated cluster (see :func:`kempnerforge.estimate.estimate`)."""

    num_nodes: int
    devices_per_node: int
    gpu_memory_bytes: int
    degrees: dict[str, int]
    model_params: int
    roles: list[RoleEstimate]
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    seconds: float = 0.0
    #: The allowance model's parameters (:class:`~kempnerforge.estimate.allowance.Allowance`), GPU kind included.
    allowance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict with everything the text report shows (and the per-module snapshots)."""
        out = asdict(self)
        for role, data in zip(self.roles, out["roles"], strict=True):
            data["modules"] = role.memory.get("modules", {})
            data.pop("memory", None)
        return out

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


def _first(snaps: dict[str, list[dict[str, int]]], states: tuple[str, ...]) -> dict[str, int] | None:
    for state in states:
        if snaps.get(state):
            return snaps[state][0]
    return None


def _module_name(fqn: str) -> tuple[str, str]:
    """The printed name of a tracked module (root class and checkpoint wrapper dropped) and its group key (block
    indices as ``N``)."""
    name = fqn.split(".", 1)[1] if "." in fqn else f"{fqn} (root)"
    name = name.replace("_checkpoint_wrapped_module.", "")
    return name, re.sub(r"(?<=\.)\d+(?=\.|$)", "N", name)


def module_peaks(memory: dict[str, Any], top: int = 15) -> list[tuple[str, dict[str, int]]]:
    """The ``top`` module groups by the most memory held while one of them was active (forward or backward).

    Modules grouped as in :func:`module_table` (``layers.N (xK)``); each group's value is the tracker's snapshot at
    its highest member's high point: ``{category: bytes, ..., "total": bytes}`` (``total`` = the module's
    ``"peak"`` in the tracker summary). Sorted by ``total``, largest first.
    """
    groups: dict[str, list[tuple[str, dict[str, int]]]] = {}
    for fqn, stats in memory.get("modules", {}).items():
        highs = [s for state in PEAK_STATES for s in stats["snapshots"].get(state, [])]
        if highs:
            name, key = _module_name(fqn)
            groups.setdefault(key, []).append((name, max(highs, key=lambda s: s.get("total", 0))))
    rows = []
    for key, members in groups.items():
        name, high = max(members, key=lambda m: m[1].get("total", 0))
        rows.append((f"{key} (x{len(members)})" if len(members) > 1 else name, high))
    rows.sort(key=lambda r: r[1].get("total", 0), reverse=True)
    return rows[:top]


def module_table(memory: dict[str, Any], top: int = 6) -> list[ModuleMemory]:
    """The ``top`` module groups by gathered + activation bytes, from a tracker summary.

    Modules whose names differ only in a block index (``layers.3``, ``layers.4``, ...) are one row named
    ``layers.N (xK)`` with the largest member's gathered and activation bytes and the highest peak of any member
    (as :func:`module_peaks` ranks it); the root's class name is dropped from the names.
    """
    groups: dict[str, list[ModuleMemory]] = {}
    for fqn, stats in memory.get("modules", {}).items():
        before, after = _first(stats["snapshots"], BEFORE_FORWARD), _first(stats["snapshots"], AFTER_FORWARD)
        gathered_at = _first(stats["snapshots"], AFTER_PRE_FORWARD) or after
        if before is None or after is None:
            continue
        act = after.get("activations", 0) - before.get("activations", 0)
        gathered = sum(gathered_at.get(k, 0) - before.get(k, 0) for k in ("unsharded_params", "all_gather_buffers"))
        name, key = _module_name(fqn)
        groups.setdefault(key, []).append(ModuleMemory(name, max(gathered, 0), max(act, 0), int(stats["peak"])))
    rows = []
    for key, members in groups.items():
        big = max(members, key=lambda m: (m.gathered_bytes + m.activation_bytes, m.peak_bytes))
        label = f"{key} (x{len(members)})" if len(members) > 1 else big.module
        peak = max(m.peak_bytes for m in members)
        rows.append(ModuleMemory(label, big.gathered_bytes, big.activation_bytes, peak))
    rows.sort(key=lambda r: r.gathered_bytes + r.activation_bytes, reverse=True)
    return rows[:top]


def peak_activations(memory: dict[str, Any]) -> int:
    """The most activation bytes at any tracked moment (module snapshots and the global peak)."""
    best = memory.get("peak", {}).get("activations", 0)
    for stats in memory.get("modules", {}).values():
        for entries in stats["snapshots"].values():
            for snap in entries:
                best = max(best, snap.get("activations", 0))
    return int(best)


def describe_role(build: Any, rank: int) -> str:
    """``"every rank"`` without pipelining, else ``"pp rank p (stages ...)"``."""
    pipeline = build.strategy.pipeline
    if pipeline is None:
        return "every rank"
    mesh = build.strategy.parallel_mesh
    return f"pp rank {mesh.coordinates()['pp']} (stages {', '.join(map(str, pipeline.ids))})"


def role_estimate(build: Any, rank: int, result: Any) -> RoleEstimate:
    """A :class:`RoleEstimate` from a :class:`~kempnerforge.estimate.step.StepResult`."""
    memory = result.memory
    peak = dict(memory.get("peak", {}))
    return RoleEstimate(
        rank=rank,
        role=describe_role(build, rank),
        params_bytes=result.params_bytes,
        params_global_bytes=result.params_global_bytes,
        sharding=result.params_global_bytes / max(result.params_bytes, 1),
        grads_bytes=result.grads_bytes,
        optimizer_bytes=result.optimizer_bytes,
        peak_bytes=int(peak.pop("total", 0)),
        peak_breakdown={k: v for k, v in sorted(peak.items(), key=lambda kv: -kv[1]) if v},
        peak_activation_bytes=peak_activations(memory),
        largest_modules=module_table(memory),
        flops=result.flops,
        comm=result.comm,
        comm_calls=result.comm_calls,
        tokens=result.tokens,
        fallbacks=[asdict(f) for f in result.fallbacks],
        step_seconds=round(result.seconds, 2),
        communicators=mesh_communicators(build.strategy.parallel_mesh),
        memory=memory,
        timeline=list(memory.get("timeline", [])),
    )


def flops_per_token(est: Estimate) -> float:
    """FLOPs the whole cluster executes per token of the step's global batch: each role stands for
    ``world / pp`` ranks and the step holds ``dp`` data shards of ``tokens`` each, so it is the roles' FLOPs
    times ``tp x cp`` over a data shard's tokens (layouts compare on it; recomputation raises it)."""
    tokens = max(est.roles[0].tokens, 1)
    return sum(r.flops for r in est.roles) * est.degrees["tp"] * est.degrees["cp"] / tokens


def gb(n: float) -> str:
    """Bytes as GB (1e9), two decimals; MB (1e6) below 1 GB, kB below 1 MB."""
    if abs(n) < 1e6:
        return f"{n / 1e3:.1f} kB"
    if abs(n) < 1e9:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.2f} GB"


def describe_layout(est: Estimate) -> str:
    """The mesh in words, e.g. ``"pp=2 x dp_shard=4"`` or ``"dp_shard=8, ep=8 within dp_shard"``."""
    d = est.degrees
    # ep borrows its ranks from dp_shard (x cp): it is no factor of the world size, so it is named apart.
    axes = " x ".join(f"{k}={v}" for k, v in d.items() if v > 1 and k != "ep") or "one rank"
    if d.get("ep", 1) > 1:
        axes += f", ep={d['ep']} within dp_shard{' x cp' if d.get('cp', 1) > 1 else ''}"
    return axes


def format_text(est: Estimate) -> str:
    """The human-readable report."""
    axes = describe_layout(est)
    lines = [
        f"kforge estimate: {est.num_nodes} x {est.devices_per_node} ranks ({axes}), "
        f"{est.model_params / 1e9:.2f}B parameters, {gb(est.gpu_memory_bytes)} per GPU",
    ]
    for role in est.roles:
        lines += _format_role(role)
    for note in est.notes:
        lines.append(f"note: {note}")
    if est.verdict is not None:
        lines.append(est.verdict.summary)
        lines.append(_format_allowance(est))
        for s in est.verdict.suggestions:
            fits = "fits" if s.fits else "still too big"
            cost = f"; {100 * s.flops_change:+.0f}% FLOPs per token" if round(100 * s.flops_change) else ""
            lines.append(
                f"  - {s.knob}: {s.change} -> peak {gb(s.peak_bytes)}, needs {gb(s.needed_bytes)} per rank "
                f"({s.how}{cost}; {fits}): {s.effect}"
            )
    lines.append(f"(simulated in {est.seconds:.0f} s)")
    return "\n".join(lines)


def _format_allowance(est: Estimate) -> str:
    """The neediest role's allowance, term by term, with the model's parameters."""
    terms, model = est.verdict.allowance, est.allowance
    role = next(r for r in est.roles if r.role == est.verdict.worst_role)
    groups = ", ".join(f"{c.axis} {c.ranks}" for c in role.communicators)
    count = len(role.communicators)
    nccl = (
        f"NCCL {gb(terms['nccl'])} ({count} communicator{'s' * (count != 1)}{': ' + groups if groups else ''}; "
        f"{model['nccl_channels']} channels x {gb(model['nccl_connection_bytes'])} per connection)"
    )
    return (
        f"  allowance: CUDA context {gb(terms['cuda_context'])} ({model['gpu']}) + {nccl} + kernel workspaces "
        f"{gb(terms['workspaces'])} + fragmentation {100 * model['fragmentation']:g}% of the peak "
        f"{gb(terms['fragmentation'])}"
    )


def _format_role(role: RoleEstimate) -> list[str]:
    lines = [
        f"[rank {role.rank}: {role.role}]",
        f"  parameters       {gb(role.params_bytes):>12}  (of {gb(role.params_global_bytes)} unsharded: 1/{role.sharding:.1f})",
        f"  gradients        {gb(role.grads_bytes):>12}",
        f"  optimizer states {gb(role.optimizer_bytes):>12}",
        f"  peak activations {gb(role.peak_activation_bytes):>12}",
        f"  peak memory      {gb(role.peak_bytes):>12}  = "
        + ", ".join(f"{k} {gb(v)}" for k, v in role.peak_breakdown.items() if v >= 1e7),
        f"  FLOPs per step   {role.flops / 1e12:>9.1f} TFLOP executed on this rank ({role.tokens} tokens of its data shard per step)",
    ]
    if role.comm:
        lines.append("  collectives per step: " + ", ".join(f"{k} {gb(v)}" for k, v in role.comm.items()))
    if role.largest_modules:
        lines.append(
            "  largest modules (gathered params + activations kept after forward; peak while active), per unit:"
        )
        for m in role.largest_modules:
            lines.append(
                f"    {m.module:<40} {gb(m.gathered_bytes)} + {gb(m.activation_bytes)}; peak {gb(m.peak_bytes)}"
            )
    for f in role.fallbacks:
        lines.append(
            f"  analytic fallback: {f['module']} could not run on fake tensors ({f['reason']}): "
            f"{f['flops'] / 1e12:.2f} TFLOP and {gb(f['activation_bytes'])} of activations per call counted analytically"
        )
    return lines
