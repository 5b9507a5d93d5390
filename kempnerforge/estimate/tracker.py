"""Memory accounting of one step: torch's ``FSDPMemTracker`` (``MemTracker`` where nothing is FSDP-wrapped).

The trackers are ``TorchDispatchMode`` s that follow every tensor storage a rank allocates (fake or real)
and label it (sharded / unsharded parameter, gradient, optimizer state, activation, temporary, FSDP2
all-gather and reduce-scatter buffers), with snapshots at every FSDP unit's pre/post forward and backward.
Small extensions over torch's class, for the simulated step only:

- several FSDP roots at once (a pipeline rank holds one root per stage); torch's class takes one;
- the per-module statistics live in a plain dict: torch's weak-key dict pays an attribute probe on every
  module for every op (``CheckpointWrapper.__getattr__``), half of a 70B step's simulation time;
- a module of a multi-module unit whose forward never runs gets statistics at its unit's backward.

:func:`memory_summary` turns a finished tracker into plain numbers (bytes) by category.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
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


class StepMemoryTracker(FSDPMemTracker):
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


class _NoHook:
    def remove(self) -> None:
        pass


class RepeatableMemTracker(MemTracker):
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
        ``{"peak": {category: bytes, "total": bytes}, "modules": {fqn: {"peak": bytes,
        "snapshots": {state: [{category: bytes, ...}, ...]}}}}``; states are the tracker's
        (``"Before Pre-Forward"``, ``"After Post-Forward"``, ``"Peak Backward"``, ...), one entry per call.
    """
    peak = _merge_devices(tracker.get_tracker_snapshot("peak"))
    modules: dict[str, Any] = {}
    for stats in tracker.memory_tracking.values():
        snaps = {
            getattr(state, "value", str(state)): [_merge_devices(s) for s in entries]
            for state, entries in stats.snapshots.items()
        }
        local = max(stats.local_peak.values(), default=0)
        modules[stats.mod_fqn] = {"peak": int(local), "snapshots": snaps}
    return {"peak": peak, "modules": modules}
