"""DataLoader worker processes ignore the stop signals: the training process decides when to stop.

A scheduler or a terminal signals the whole process group (``scancel``, ``kill -TERM -- -PGID``, Ctrl-C), which
includes every DataLoader worker. torch's worker installs a SIGTERM handler that ends the worker at once (and SIGUSR1
ends any process by default), so the training process, which only sets a flag and stops at the next step boundary
with a checkpoint, died first with ``DataLoader worker ... is killed by signal: Terminated`` (exit 1, no
checkpoint). Workers still exit when their parent does (torch's worker watchdog), and SIGKILL still ends them.
"""

from __future__ import annotations

import signal

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
