"""Signal handling that only sets a flag, and the cross-rank agreement on that flag.

A handler that saves (a collective) while another rank is mid-backward deadlocks sharded checkpoints
(Lightning's stock SLURM handler does that; see NOTES-platform.md). Here the handler records the
signal number and returns; the training loop asks :func:`agree_any` at the next step boundary.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


def parse_signal(name: str | int) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"SIGUSR1"`` or a number -> :class:`signal.Signals`.

    Raises:
        ValueError: an unknown signal name or number (names the value and the allowed form).
    """
    try:
        if isinstance(name, int):
            return signal.Signals(name)
        key = name.upper()
        return signal.Signals[key if key.startswith("SIG") else "SIG" + key]
    except (KeyError, ValueError):
        raise ValueError(
            f"signals: {name!r} is not a signal; use names like 'SIGTERM', 'SIGUSR1' or numbers."
        ) from None


def _is_lightning_handler(handler: Any) -> bool:
    """Lightning's own signal handlers (its ``_SignalConnector`` methods): they save or broadcast inside the
    handler, which is what this module avoids."""
    owner = getattr(handler, "__self__", None)
    return type(owner).__name__ == "_SignalConnector"


def chained_handlers(handler: Any) -> list[Any]:
    """The callables to run after the flag for a handler that was installed before: the handler itself, or, for
    Lightning's composite handler (``_HandlersCompose``), the members that are not Lightning's own."""
    members = getattr(handler, "signal_handlers", None) if type(handler).__name__ == "_HandlersCompose" else None
    candidates = list(members) if members is not None else [handler]
    return [h for h in candidates if callable(h) and not _is_lightning_handler(h)]


class SignalFlag:
    """Installs handlers for ``signals`` that remember the first signal received, then run the handlers that
    were installed before (a user's SIGTERM handler keeps working), minus Lightning's own.

    SIGINT (Ctrl-C) is a signal like the others: the first one sets the flag (Python's default handler, which
    would raise ``KeyboardInterrupt`` mid-step, is not chained); a second one raises ``KeyboardInterrupt`` at once.

    Args:
        signals: signal names or numbers to catch.
        chain: call the earlier handlers after setting the flag (the default). They run inside the signal
            handler, as they did before: a handler that raises (``sys.exit``) ends the run there.

    Attributes:
        received: the signal number received, or None.
    """

    def __init__(self, signals: Iterable[str | int], chain: bool = True) -> None:
        self.signals = [parse_signal(s) for s in signals]
        self.chain = chain
        self.received: int | None = None
        self._interrupted = False  # a SIGINT arrived: the next one raises KeyboardInterrupt
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # The flag only: no I/O, no collectives (they may deadlock against a rank inside a collective).
        if signum == signal.SIGINT and self._interrupted:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without waiting for the step boundary
        self._interrupted = self._interrupted or signum == signal.SIGINT
        if self.received is None:
            self.received = signum
        if self.chain:
            for handler in chained_handlers(self._previous.get(signum)):
                if handler is not signal.default_int_handler:  # it raises KeyboardInterrupt mid-step
                    handler(signum, frame)

    def remember(self) -> None:
        """Record the current handlers as the ones to chain and to :meth:`restore` (a later :meth:`install` keeps
        them). Call it before anything else replaces them (Lightning does at the start of ``fit``)."""
        for sig in self.signals:
            self._previous.setdefault(int(sig), signal.getsignal(sig))

    def install(self) -> None:
        """Replace the current handlers (remembering them for chaining and :meth:`restore`, unless
        :meth:`remember` already did). Main thread only."""
        self.remember()
        for sig in self.signals:
            signal.signal(sig, self._handler)

    def restore(self) -> None:
        """Put back the handlers remembered by :meth:`remember` / :meth:`install` (no-op when there are none)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


@runtime_checkable
class StepFlagSource(Protocol):
    """A callback holding a host-side flag that all ranks must agree on at an optimizer-step boundary
    (e.g. :class:`~kempnerforge.callbacks.Preemption`'s signal flag).

    A per-step agreement that runs anyway (:class:`~kempnerforge.callbacks.NaNGuard`'s non-finite
    check) carries these flags in the same reduction: one all-reduce and one host read-back for all.
    """

    def local_step_flag(self) -> bool:
        """This rank's flag now."""
        ...

    def receive_agreed_flag(self, value: bool) -> None:
        """The flag agreed over all ranks at this optimizer step (called before ``on_train_batch_end``)."""
        ...


def agree_max(
    values: Sequence[bool | float | torch.Tensor], device: torch.device | str = "cpu", group: Any = None
) -> list[float]:
    """The maximum over all ranks of each value, in one all-reduce (MAX) and one host read-back.

    Args:
        values: per-rank values: bools, floats, or 0-d / 1-element tensors (any dtype); tensors stay on
            their device until the read-back.
        device: device of the reduction tensor (CUDA for NCCL).
        group: process group (None: the world; no process group: the local values).

    Returns:
        The agreed values as floats (fp64), in order.
    """
    parts = [
        v.detach().reshape(()).to(device=device, dtype=torch.float64)
        if isinstance(v, torch.Tensor)
        else torch.full((), float(v), dtype=torch.float64, device=device)  # a fill, not a host-to-device copy
        for v in values
    ]
    t = torch.stack(parts)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def agree_any(flag: bool | torch.Tensor, device: torch.device | str = "cpu", group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (all-reduce MAX; a no-op without a process group).

    Args:
        flag: this rank's flag, a bool or a 0-d / 1-element tensor (bool, int or float).
        device: device of the reduction tensor (CUDA for NCCL).
        group: process group (None: the world).

    Returns:
        The agreed flag (one 8-byte host read-back).
    """
    return agree_max([flag], device, group)[0] > 0
