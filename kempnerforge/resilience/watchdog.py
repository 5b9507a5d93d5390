"""A watchdog that ends a stalled shutdown: if the preemption save and exit do not finish in time, exit hard."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


class Watchdog:
    """Calls ``os._exit(exit_code)`` after ``timeout_s`` seconds unless :meth:`cancel` is called first.

    A hung collective (a peer died mid-save) never returns, so a clean shutdown cannot be guaranteed
    from the main thread; a daemon timer thread can still end the process so the scheduler's requeue
    proceeds. The previous complete checkpoint stays valid (``latest`` moves only after a full save).

    Args:
        timeout_s: seconds before the process is ended (> 0).
        exit_code: exit status used when it fires.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    def __init__(self, timeout_s: float, exit_code: int = 1) -> None:
        if not timeout_s > 0:
            raise ValueError(f"Watchdog timeout_s={timeout_s!r} must be > 0 seconds.")
        self.timeout_s = timeout_s
        self.exit_code = exit_code
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        log.error(
            "Watchdog: shutdown did not finish in %.0f s; exiting with status %d.", self.timeout_s, self.exit_code
        )
        os._exit(self.exit_code)

    def start(self) -> None:
        """Arm the timer (idempotent)."""
        if self._timer is None:
            self._timer = threading.Timer(self.timeout_s, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        """Disarm the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
