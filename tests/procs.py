"""``subprocess.run`` for commands that start processes of their own (``kforge fit`` under Lightning's launcher, a
benchmark's ranks): in a session of its own, and its whole process group killed when the test gives up on it (a
timeout, a pytest-timeout, an interrupt), so no orphaned rank keeps a core busy for the rest of the suite."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def run_group(cmd: list[str], timeout: float | None = None, check: bool = False, **kwargs: Any):
    """``subprocess.run(cmd, timeout=timeout, check=check, **kwargs)`` in a new session; on any exception while it
    runs (``TimeoutExpired`` included, re-raised) every process of the group is SIGKILLed first.

    Returns:
        ``subprocess.CompletedProcess``.
    """
    kwargs.setdefault("start_new_session", True)
    if kwargs.pop("capture_output", False):
        kwargs["stdout"], kwargs["stderr"] = subprocess.PIPE, subprocess.PIPE
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if proc.poll() is not None:
                _kill_group(proc)  # the launcher exited: ranks it left behind go with it
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
