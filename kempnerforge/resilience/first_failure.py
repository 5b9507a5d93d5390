"""Name the rank that failed first on every rank's error.

When one rank raises, the others fail a moment later inside a collective that lost its peer ("Connection
closed by peer" on gloo) or are killed by the launcher. Their own error says nothing about why. Each
failing rank therefore records ``rank R: <type>: <message>`` in the job's rendezvous TCPStore with one
atomic compare-and-set (the first record wins); a rank that finds another rank's record adds it to its
own exception as a note (PEP 678), so the traceback it prints ends with the original error. Nothing
here is a collective: it works while the other ranks are stuck or gone.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

#: Longest error text stored (characters); the rest of a huge message is cut.
MAX_CHARS = 2000


def _key() -> str:
    # A torchrun restart reuses its agent's store: each restart gets its own record.
    return f"kempnerforge/first_failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def note_first_failure(exception: BaseException, rank: int, host: str, port: int, timeout_s: float = 1.0) -> str | None:
    """Record ``exception`` as the job's first failure, or add the one recorded earlier to it as a note.

    Args:
        exception: this rank's error (gets a note when another rank failed first).
        rank: this process's global rank.
        host, port: the rendezvous TCPStore (``MASTER_ADDR`` / ``MASTER_PORT``: the cluster environment's
            ``main_address`` / ``main_port``).
        timeout_s: seconds to wait for the store (it lives in rank 0's process and is gone when rank 0 is).

    Returns:
        The first failure's text when it was another rank's (that text is also the note), else None.
        Never raises: without a reachable store the exception is left as it is.
    """
    mine = f"rank {rank}: {type(exception).__name__}: {exception}"[:MAX_CHARS]
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        first = store.compare_set(_key(), "", mine).decode(errors="replace")
    except Exception as err:  # store gone or unreachable: nothing to add
        log.debug("first-failure record unavailable: %s", err)
        return None
    if first == mine:
        return None
    exception.add_note(f"kempnerforge: the first rank to fail was {first}")
    log.error("This rank failed after another one; the first failure was %s", first)
    return first
