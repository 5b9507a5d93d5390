"""Counting the host synchronizations of training steps on CPU, as they would happen on an accelerator.

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports every synchronizing call. On a CPU nothing waits,
so :class:`HostSyncCounter` emulates a device: a ``TorchFunctionMode`` tags every tensor as *host*
(made from Python / numpy data, or by a factory call without a ``device``, and whatever is computed
from host tensors only) or *device* (everything else: parameters, gradients, optimizer state created
like a parameter, batches after the strategy's transfer, and all results that touch one of them), and
counts each call that would make the host wait for the device:

- read-backs of a device tensor: ``item``, ``tolist``, ``__bool__`` / ``__float__`` / ``__int__`` /
  ``__index__`` / ``__complex__``, ``__format__`` / ``__repr__`` / ``__str__``, ``numpy`` /
  ``__array__``, ``__contains__``, ``cpu()``, ``to("cpu")``, ``equal``, ``allclose``, ``is_nonzero``;
- shapes that come from data: ``nonzero``, ``argwhere``, ``masked_select``, ``unique`` (and
  ``unique_consecutive``), ``bincount``, ``repeat_interleave`` with tensor repeats and no
  ``output_size``, one-argument ``where``, and indexing or assignment with a boolean tensor;
- blocking host-to-device copies (PyTorch synchronizes the stream after a copy without
  ``non_blocking``): ``to(device)`` / ``cuda()`` / ``copy_`` of a host tensor into a device one, and
  ``torch.tensor`` / ``as_tensor`` of Python data with a ``device``.

What it cannot see: synchronizations inside C++ kernels that happen on CUDA only (none of the ops
above are used there by kempnerforge) and ``.to(torch.device("cpu"))`` written with a device object
(indistinguishable from ``.to(self.device)`` on a CPU run; kempnerforge writes ``.cpu()``). Lightning's
batch transfer passes ``non_blocking=True`` on accelerators only, so it is not counted here either.
The ``gpu``-marked test cross-checks the counts with ``torch.cuda.set_sync_debug_mode`` on CUDA.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]

_READBACKS = {
    "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "__format__", "__repr__",
    "__str__", "numpy", "__array__", "__contains__", "cpu", "equal", "allclose", "is_nonzero",
}  # fmt: skip
_DATA_SHAPES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "_unique2"}
_FACTORIES = {
    "tensor", "as_tensor", "from_numpy", "frombuffer", "scalar_tensor", "zeros", "ones", "empty", "full", "arange",
    "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided",
    "tril_indices", "triu_indices",
}  # fmt: skip


@dataclass
class SyncEvent:
    """One synchronizing call: the op, where it was made (``file:line`` in the repository, or the first
    frame outside torch), and the loop iteration it happened in."""

    op: str
    where: str
    iteration: int


class HostSyncCounter(TorchFunctionMode):
    """Tags tensors host / device and records :class:`SyncEvent` s while :attr:`active` (see the module docstring).

    Use as a context manager around ``trainer.fit`` together with :meth:`callback`, which sets
    :attr:`iteration` at every training batch and switches counting on from ``warmup`` iterations on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[SyncEvent] = []
        self.active = False  # counting on (set by :meth:`callback`)
        self.iteration = -1  # the training loop's batch index
        # id -> weak reference (a WeakSet would compare tensors with ==); a stale id is overwritten on reuse.
        self._host: dict[int, weakref.ref] = {}

    # -- bookkeeping ------------------------------------------------------------------------------

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host tensor (see the module docstring); unknown tensors are device tensors."""
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, out: Any, host: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if host:
                    self._host[id(t)] = weakref.ref(t)
                else:
                    self._host.pop(id(t), None)

    def _record(self, op: str) -> None:
        if self.active:
            self.events.append(SyncEvent(op, _where(), self.iteration))

    def per_iteration(self, first: int, last: int) -> dict[int, list[SyncEvent]]:
        """Events of each counted iteration ``first..last`` (inclusive; empty lists included)."""
        out: dict[int, list[SyncEvent]] = {i: [] for i in range(first, last + 1)}
        for e in self.events:
            if e.iteration in out:
                out[e.iteration].append(e)
        return out

    def summary(self) -> Counter:
        """``(op, where) -> count`` over every recorded event (for failure messages and the README)."""
        return Counter((e.op, e.where) for e in self.events)

    def callback(self, warmup: int) -> Callback:
        """A Lightning callback that sets :attr:`iteration` per training batch and counts from ``warmup`` on."""
        counter = self

        class _Iterations(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                counter.iteration = trainer.fit_loop.total_batch_idx
                counter.active = counter.iteration >= warmup

            def on_train_end(self, trainer, pl_module) -> None:
                counter.active = False

        return _Iterations()

    # -- the mode ---------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if not self.is_host(t)]
        self._check(name, args, kwargs, tensors, on_device)
        out = func(*args, **kwargs)
        self._mark(out, self._output_is_host(name, args, kwargs, tensors, on_device))
        return out

    def _check(self, name, args, kwargs, tensors, on_device) -> None:
        if name in _READBACKS or name in _DATA_SHAPES:
            if on_device:
                self._record(name)
        elif name == "to" and tensors:
            target = _target_device(args[1:], kwargs)
            src_host = self.is_host(args[0])
            if target == "host" and not src_host:
                self._record("to(cpu)")
            elif target == "device" and src_host and not kwargs.get("non_blocking") and not _from_batch_transfer():
                self._record("to(device) of a host tensor")
        elif name == "cuda" and tensors and self.is_host(args[0]) and not kwargs.get("non_blocking"):
            self._record("cuda() of a host tensor")
        elif name == "copy_" and len(args) > 1 and not kwargs.get("non_blocking") and not _positional_nb(args):
            if self.is_host(args[0]) != self.is_host(args[1]):
                self._record("copy_ between host and device")
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None and not _is_cpu_str(kwargs["device"]):
            if not (args and isinstance(args[0], torch.Tensor) and not self.is_host(args[0])):
                self._record(f"{name}(data, device=...)")
        elif name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            if kwargs.get("output_size") is None and on_device:
                self._record("repeat_interleave (tensor repeats)")
        elif name == "where" and len(args) == 1 and not kwargs and on_device:
            self._record("where(condition)")
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and on_device:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(index)[0]):
                self._record(f"{name} with a boolean mask")

    def _output_is_host(self, name, args, kwargs, tensors, on_device) -> bool:
        if name == "to" and tensors:
            target = _target_device(args[1:], kwargs)
            return self.is_host(args[0]) if target is None else target == "host"
        if name in ("cpu", "numpy", "pin_memory"):
            return True
        if name == "cuda":
            return False
        if name in _FACTORIES or name.endswith("_like"):
            device = kwargs.get("device")
            if device is None:
                return not on_device if name.endswith("_like") or tensors else True
            return _is_cpu_str(device)
        return not on_device


def _is_cpu_str(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _target_device(args: tuple, kwargs: dict) -> str | None:
    """``"host"`` for ``"cpu"`` strings, ``"device"`` for torch.device objects / other strings / a tensor
    of the device, None when ``to`` only changes the dtype."""
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, str | torch.device):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    if device is None:
        return None
    return "host" if _is_cpu_str(device) else "device"


def _positional_nb(args: tuple) -> bool:
    return len(args) > 2 and bool(args[2])


def _from_batch_transfer() -> bool:
    frame = sys._getframe(3)
    return frame is not None and frame.f_code.co_filename.endswith("fabric/utilities/apply_func.py")


def _where() -> str:
    """``file:line`` of the innermost repository frame (kempnerforge, strategies, callbacks), else of the
    innermost frame outside torch and this file."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        rel = path[len(str(REPO)) + 1 :] if path.startswith(str(REPO)) else None
        if rel and rel.split("/")[0] in ("kempnerforge", "strategies", "callbacks"):
            return f"{rel}:{frame.f_lineno}"
        if fallback is None and "/torch/" not in path and not path.endswith("host_syncs.py"):
            fallback = f"{path.split('site-packages/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"
