"""DataLoader worker processes ignore the stop signals: the training process decides when to stop.

A scheduler or a terminal signals the whole process group (``scancel``, ``kill -TERM -- -PGID``, Ctrl-C), which
includes every DataLoader worker. torch's worker installs a SIGTERM handler that ends the worker at once (and SIGUSR1
ends any process by default), so the training process, which only sets a flag and stops at the next step boundary
with a checkpoint, died first with ``DataLoader worker ... is killed by signal: Terminated`` (exit 1, no
checkpoint). Workers still exit when their parent does (torch's worker watchdog), and SIGKILL still ends them.

A worker that ignores SIGTERM must not outlive an exiting parent either: at interpreter exit multiprocessing
SIGTERMs every daemonic child and then joins it, so a loader whose workers were still up at exit (an iterator a
trainer or a test keeps) hung the process forever after its last line. :func:`stop_children_at_exit` (registered
at import, so it runs before multiprocessing's own hook) SIGKILLs those still alive a second after the SIGTERM.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit hook first: atexit runs ours, registered later, before it
import signal
import time

#: What schedulers and terminals send to stop a job (SLURM's SIGTERM and ``--signal=USR1@...``, Ctrl-C).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` for every training and validation ``StatefulDataLoader``: set SIGTERM, SIGUSR1 and SIGINT
    to ignored in this worker (it runs after torch installs its worker handlers).

    Args:
        worker_id: the worker's index (unused; the ``worker_init_fn`` signature).
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_children_at_exit(grace_s: float = 1.0) -> list[int]:
    """End this process's daemonic children (DataLoader workers among them) as multiprocessing's exit hook does,
    SIGTERM, but with a deadline: those still alive after ``grace_s`` seconds (a worker ignores SIGTERM) get SIGKILL.
    Runs at interpreter exit, before that hook (see the module docstring); returns the pids it had to kill."""
    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return []
    # torch's SIGCHLD handler raises in this thread when a worker dies of a signal ("DataLoader worker ... is killed
    # by signal"), which would stop this hook halfway; at exit that report has nobody left to read it.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for proc in children:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in children:
        proc.join(max(0.0, deadline - time.monotonic()))
    killed = [proc for proc in children if proc.is_alive()]
    for proc in killed:  # every one first, then wait for them
        proc.kill()
    for proc in killed:
        proc.join(5.0)
    return [proc.pid for proc in killed]


atexit.register(stop_children_at_exit)
