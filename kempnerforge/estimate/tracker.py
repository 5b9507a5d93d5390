"""Memory accounting of one step: torch's ``FSDPMemTracker`` (``MemTracker`` where nothing is FSDP-wrapped).

The trackers are ``TorchDispatchMode`` s that follow every tensor storage a rank allocates (fake or real)
and label it (sharded / unsharded parameter, gradient, optimizer state, activation, temporary, FSDP2
all-gather and reduce-scatter buffers), with snapshots at every FSDP unit's pre/post forward and backward.
Small extensions over torch's class, for the simulated step only:

- several FSDP roots at once (a pipeline rank holds one root per stage); torch's class takes one;
- the per-module statistics live in a plain dict: torch's weak-key dict pays an attribute probe on every
  module for every op (``CheckpointWrapper.__getattr__``), half of a 70B step's simulation time;
- a module of a multi-module unit whose forward never runs gets statistics at its unit's backward;
- a timeline of the step (:class:`Timeline`): the bytes by category at every FSDP unit's (or, without FSDP2, every
  module's) pre/post forward/backward hook and at the phase marks the step sets, plus the highest point between two
  of those, so that the timeline's maximum is the tracker's peak.

:func:`memory_summary` turns a finished tracker into plain numbers (bytes) by category.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule
from torch.utils.weak import WeakIdKeyDictionary

#: Report category of each tracker reference type (FSDP2 tracker and plain tracker).
CATEGORY: dict[str, str] = {
    _FSDPRefType.SHARDED_PARAM.value: "params",
    _FSDPRefType.UNSHARDED_PARAM.value: "unsharded_params",
    _FSDPRefType.ALL_GATHER.value: "all_gather_buffers",
    _FSDPRefType.BUFFER.value: "buffers",
    _FSDPRefType.SHARDED_GRAD.value: "grads",
    _FSDPRefType.UNSHARDED_GRAD.value: "unsharded_grads",
    _FSDPRefType.REDUCE_SCATTER.value: "reduce_scatter_buffers",
    _FSDPRefType.ACT.value: "activations",
    _FSDPRefType.TEMP.value: "temporaries",
    _FSDPRefType.OPT.value: "optimizer_states",
    _FSDPRefType.INP.value: "inputs",
    _MemRefType.PARAM.value: "params",
    _MemRefType.GRAD.value: "grads",
    _MemRefType.OPT.value: "optimizer_states",
    _MemRefType.OTH.value: "inputs",
}


#: Tracker states whose snapshot is the module's high point (one per forward / backward call).
PEAK_STATES = ("Peak Forward", "Peak Backward")


class _UnitStats(dict):
    """Per-module statistics (module -> ``_FSDPModMemStats``) that start on first use: a module of a multi-module
    FSDP2 unit whose own forward never runs (the head of ``[norm, output]`` when the fused head + loss reads its
    weight directly) still reaches the unit's backward, where torch's tracker expects an entry."""

    def __init__(self, names: dict[nn.Module, str]) -> None:
        super().__init__()
        self._names = names

    def __missing__(self, module: nn.Module) -> _FSDPModMemStats:
        stats = _FSDPModMemStats(self._names.get(module, type(module).__name__))
        self[module] = stats
        return stats


class Timeline:
    """Mixin for a ``MemTracker``: the step's memory over time, as ``self.timeline``.

    Each event is ``{"phase", "label", "total", "bytes": {category: bytes}}`` (categories as :data:`CATEGORY`,
    zeros left out; ``total`` their sum). Events are recorded at the tracker's hooks and at :meth:`mark`; between
    two events the tracker sees every allocation (``_update_peak_stats`` runs after every op), and the highest
    point of that stretch becomes an event of its own (label ``"peak"``) when it is above both events around it
    (or level with the one that ends it, in another breakdown). The first event with the largest ``total`` is therefore the moment of the tracker's peak
    (its ``get_tracker_snapshot("peak")``), breakdown included. Cost: one comparison per op and a dict copy each
    time the stretch's high point rises; a few events per FSDP unit.
    """

    def _start_timeline(self) -> None:
        self.timeline: list[dict[str, Any]] = []
        self.phase = "forward"
        self._high: dict[Any, dict[Any, int]] | None = None
        self._high_total = -1
        self._high_phase = self.phase

    def mark(self, label: str, phase: str | None = None) -> None:
        """Record an event named ``label``; ``phase`` (``"forward"``, ``"backward"``, ``"optimizer"``), if given, is
        the phase from this event on (the stretch before it keeps the phase it ran in)."""
        self._close_stretch()
        if phase is not None:
            self.phase = phase
        self._append(self.phase, label, self._curr_mem_snap)

    def _record(self, label: str) -> None:
        self._close_stretch()
        self._append(self.phase, label, self._curr_mem_snap)

    def _close_stretch(self) -> None:
        high, self._high = self._high, None
        self._high_total = -1
        if high is None:
            return
        merged = _merge_devices(high)
        top, now = merged.get("total", 0), _merge_devices(self._curr_mem_snap)
        before = self.timeline[-1]["total"] if self.timeline else -1
        # Above both ends of the stretch; or level with its end but another breakdown (the first moment counts).
        if top > before and (top > now.get("total", 0) or (top == now.get("total", 0) and merged != now)):
            self.timeline.append(_event(self._high_phase, "peak", merged))

    def _append(self, phase: str, label: str, snapshot: dict[Any, dict[Any, int]]) -> None:
        self.timeline.append(_event(phase, label, _merge_devices(snapshot)))

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        total = sum(dev[_TOTAL_KEY] for dev in self._curr_mem_snap.values())
        if total > self._high_total:
            self._high_total = total
            self._high = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}
            self._high_phase = self.phase


def _event(phase: str, label: str, merged: dict[str, int]) -> dict[str, Any]:
    return {
        "phase": phase,
        "label": label,
        "total": merged.get("total", 0),
        "bytes": {k: v for k, v in merged.items() if k != "total" and v},
    }


class StepMemoryTracker(Timeline, FSDPMemTracker):
    """``FSDPMemTracker`` over one or more FSDP2 roots (e.g. a pipeline rank's stage modules).

    Args:
        roots: the FSDP2 root modules of this rank.
        optimizer: the optimizer whose states are tracked.

    Raises:
        TypeError: a root is not an ``FSDPModule``.
    """

    def __init__(self, roots: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> None:
        if not roots or not all(isinstance(r, FSDPModule) for r in roots):
            raise TypeError("StepMemoryTracker needs FSDP2 roots; use MemTracker for a model FSDP2 left unwrapped.")
        MemTracker.__init__(self)
        self._root_mod = roots[0] if len(roots) == 1 else nn.ModuleList(roots)
        self._optm = optimizer
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDPState.PRE_FW
        self._ref_class = _FSDPRefType
        names = {m: f"{type(r).__name__}.{n}" if n else type(r).__name__ for r in roots for n, m in r.named_modules()}
        self.memory_tracking = _UnitStats(names)  # a plain dict (see the module docstring) with defaults
        self._names = names
        self._start_timeline()

    def _events_around(self, module: nn.Module, hook: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` (one of torch's instrumented FSDP2 hooks) with a timeline event before and after it."""
        name = self._names.get(module, type(module).__name__)

        @wraps(inner)
        def around(*args: Any, **kwargs: Any) -> Any:
            self._record(f"{name}: before {hook}")
            out = inner(*args, **kwargs)
            self._record(f"{name}: after {hook}")
            return out

        return around

    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig: Callable[..., Any]) -> Callable[..., Any]:
        return self._events_around(fsdp_mod, "pre-forward", super()._fsdp_state_pre_forward(fsdp_mod, orig))

    def _fsdp_state_post_forward(self, fsdp_mod: FSDPModule, orig: Callable[..., Any]) -> Callable[..., Any]:
        return self._events_around(fsdp_mod, "post-forward", super()._fsdp_state_post_forward(fsdp_mod, orig))

    def _fsdp_param_group_pre_backward(self, fsdp_mod: FSDPModule, orig: Callable[..., Any]) -> Callable[..., Any]:
        return self._events_around(fsdp_mod, "pre-backward", super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

    def _fsdp_param_group_post_backward(self, fsdp_mod: FSDPModule, orig: Callable[..., Any]) -> Callable[..., Any]:
        return self._events_around(fsdp_mod, "post-backward", super()._fsdp_param_group_post_backward(fsdp_mod, orig))


class _NoHook:
    def remove(self) -> None:
        pass


class RepeatableMemTracker(Timeline, MemTracker):
    """torch's plain ``MemTracker`` that accepts a top-level module called again within one step, and frozen
    parameters.

    A pipeline stage runs once per micro-batch; torch's tracker takes a second top-level call for a second
    iteration and raises. The module's statistics restart instead (the global peak is unaffected). It also
    registers a gradient hook on every parameter, which a frozen one (``requires_grad=False``, e.g. a VLM's
    encoder) refuses: those are tracked without a hook (they get no gradient).
    """

    def __init__(self) -> None:
        super().__init__()
        self.memory_tracking = {}  # see the module docstring
        self._start_timeline()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        for p in module.parameters():
            if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {name} == {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)
        self._record(f"{name}: pre-forward")

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        self._record(f"{self._mod_tracker.get_known_fqn(module)}: post-forward")

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._pre_bw_hook(module, args)
        if module is not None:
            self._record(f"{self._mod_tracker.get_known_fqn(module)}: pre-backward")

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        if module is not None:
            self._record(f"{self._mod_tracker.get_known_fqn(module)}: post-backward")


def make_tracker(roots: Sequence[nn.Module], model: nn.Module, optimizer: torch.optim.Optimizer) -> MemTracker:
    """The tracker for this rank: :class:`StepMemoryTracker` when every root is FSDP2-wrapped, else torch's
    :class:`RepeatableMemTracker` following ``model`` and ``optimizer`` (FSDP2 skipped at one rank in fp32)."""
    if all(isinstance(r, FSDPModule) for r in roots):
        return StepMemoryTracker(roots, optimizer)
    tracker = RepeatableMemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def track_inputs(tracker: MemTracker, batch: dict[str, torch.Tensor]) -> None:
    """Register the batch tensors with ``tracker`` (created before it was entered)."""
    tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
    if isinstance(tracker, FSDPMemTracker):
        tracker.track_inputs(tuple(tensors))
    else:
        tracker.track_external(*tensors)


def _by_category(dev_snapshot: dict[Any, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in dev_snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total":
            out["total"] = int(value)
            continue
        cat = CATEGORY.get(name, str(name).lower())
        out[cat] = out.get(cat, 0) + int(value)
    return out


def _merge_devices(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for dev_snapshot in snapshot.values():
        for cat, value in _by_category(dev_snapshot).items():
            merged[cat] = merged.get(cat, 0) + value
    return merged


def memory_summary(tracker: MemTracker) -> dict[str, Any]:
    """Plain numbers from a finished tracker (bytes).

    Returns:
        ``{"peak": {category: bytes, "total": bytes}, "modules": {fqn: {"peak": bytes (the most while it was
        active, forward or backward),
        "snapshots": {state: [{category: bytes, ...}, ...]}}}, "timeline": [event, ...]}``; states are the
        tracker's (``"Before Pre-Forward"``, ``"After Post-Forward"``, ``"Peak Backward"``, ...), one entry per call;
        events as :class:`Timeline` records them (empty for a tracker without one).
    """
    peak = _merge_devices(tracker.get_tracker_snapshot("peak"))
    modules: dict[str, Any] = {}
    for stats in tracker.memory_tracking.values():
        snaps = {
            getattr(state, "value", str(state)): [_merge_devices(s) for s in entries]
            for state, entries in stats.snapshots.items()
        }
        # The tracker restarts local_peak at each pre-backward: the forward's high point lives in its snapshots.
        highs = [s.get("total", 0) for state in PEAK_STATES for s in snaps.get(state, [])]
        local = max([*stats.local_peak.values(), *highs], default=0)
        modules[stats.mod_fqn] = {"peak": int(local), "snapshots": snaps}
    return {"peak": peak, "modules": modules, "timeline": list(getattr(tracker, "timeline", []))}
