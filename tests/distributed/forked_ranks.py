"""Run a script on N local ranks forked from one pre-imported forkserver: torchrun's job without its import bill.

``torchrun`` starts a fresh interpreter per rank, and each pays ~11 s of CPU importing torch + Lightning + this
project (2 cores, shared by all ranks): most of a small distributed test. Here one ``multiprocessing`` forkserver
per pytest session imports those modules once (``set_forkserver_preload``), and every rank is ``fork``-ed from
it. The server never runs torch compute (so no OpenMP pool exists to be broken by ``fork``), and it is started
from a clean interpreter, not by forking pytest.

Each rank gets the environment torchrun's local agent sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, ROLE_*, MASTER_ADDR/PORT, TORCHELASTIC_*; see torch/distributed/elastic/agent/server/
local_elastic_agent.py), so Lightning picks ``TorchElasticEnvironment`` exactly as under torchrun; then the
script runs as ``__main__`` (``runpy``) with its own ``sys.argv`` and its folder first on ``sys.path``. Like
torchrun, when one rank fails the others are killed, and a timeout kills them all.

One difference from fresh interpreters: a variable that a preloaded module reads once at import (e.g. libgomp's
OMP_NUM_THREADS, torch._inductor.config's TORCHINDUCTOR_* flags) comes from the server's environment at its
start, not from the launch. The tests here pass only variables read at use (TORCHINDUCTOR_CACHE_DIR), and
OMP_NUM_THREADS is applied in each rank with ``torch.set_num_threads``. A test that needs import-time
variables, or a process tree of its own (signals to a launcher, CUDA), uses ``launch.torchrun``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

# What the rank scripts import (tests/distributed/*_script.py, *_check.py): loaded once in the server. A name
# that fails to import is skipped by multiprocessing; the rank then imports it itself.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "lightning.pytorch",
    "kempnerforge.callbacks",
    "kempnerforge.cli",
    "kempnerforge.data.datamodule",
    "kempnerforge.data.streaming",
    "kempnerforge.data.vlm_datamodule",
    "kempnerforge.model.vlm",
    "kempnerforge.module",
    "kempnerforge.parallel.expert_parallel",
    "kempnerforge.parallel.tensor_parallel",
    "kempnerforge.strategies",
]

_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The session's forkserver context, started on first use with OMP_NUM_THREADS=1.

    libgomp reads OMP_NUM_THREADS once, when torch is loaded, i.e. in the server: it must be 1 there (as
    torchrun gives every rank of a multi-process job), whatever the pytest process has.
    """
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                if saved is None:
                    del os.environ["OMP_NUM_THREADS"]
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            _context = ctx
        return _context


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (as ``torchrun --standalone`` picks its rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun's local agent sets for ``rank`` of ``nproc`` on one node (one role, no restarts)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        # No agent hosts a TCPStore here: rank 0 creates it (init_process_group's env:// path).
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _rank_main(script: str, args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """Body of one forked rank: own process group, env, output files, argv; run ``script`` as ``__main__``."""
    os.setpgrp()  # the launcher kills the rank with its DataLoader / compile workers as one group
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, like torchrun's `python -u`
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()  # the server's environment is frozen at its start: use the caller's, as given
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # libgomp read the env long ago, in the server
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` does
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # What interpreter exit would do next (multiprocessing ends the rank with os._exit): wait for
        # non-daemon threads, run atexit handlers (logging flush, async checkpoint executors, ...).
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def start_one(script: Path, args: list[str], env: dict[str, str], out: Path, err: Path):
    """Start ``script`` as a world of one forked rank and return its ``multiprocessing.Process`` at once.

    For tests that kill a run at a time of their choosing: the rank leads its own process group
    (``os.killpg(proc.pid, signal.SIGKILL)`` ends it with its workers, like ``kill -9`` of a job) and writes
    its output to ``out`` / ``err``.
    """
    ctx = _forkserver()
    rank = rank_env(0, 1, _free_port(), uuid.uuid4().hex)
    proc = ctx.Process(target=_rank_main, args=(str(script), list(args), {**env, **rank}, str(out), str(err)))
    proc.start()
    return proc


def _kill(procs) -> None:
    """SIGKILL every still-running rank and its process group (torchrun also kills survivors of a failure)."""
    procs = [p for p in procs if p.pid is not None]  # started
    for p in procs:
        if p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()  # setpgrp has not run yet: the rank is its parent's group member still
    for p in procs:
        p.join(10)


def run_ranks(
    nproc: int,
    script: Path,
    args: list[str],
    env: dict[str, str],
    timeout: float,
    kill_on_failure: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args`` on ``nproc`` forked ranks; wait until all exit, one fails, or ``timeout``.

    Args:
        nproc: number of ranks (world size), >= 1.
        script: Python file run as ``__main__`` in each rank.
        args: its command-line arguments.
        env: the ranks' environment (torchrun's per-rank variables are added on top).
        timeout: seconds for the whole launch.
        kill_on_failure: kill the other ranks when one fails, as torchrun does; False waits for every rank to
            exit by itself (a test that the survivors of a failure do not hang).

    Returns:
        ``CompletedProcess`` with ``returncode`` (0, or the first failing rank's exit code: negative for a
        signal), ``stdout`` and ``stderr`` (every rank's, in rank order).

    Raises:
        ValueError: ``nproc`` < 1.
        subprocess.TimeoutExpired: the ranks ran past ``timeout`` (they are killed first).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = _forkserver()
    port, run_id = _free_port(), uuid.uuid4().hex
    cmd = [f"forked_ranks(nproc={nproc})", str(script), *args]
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")) for r in range(nproc)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(str(script), list(args), {**env, **rank_env(r, nproc, port, run_id)}, *files[r]),
                name=f"rank{r}",
            )
            for r in range(nproc)
        ]
        try:
            for p in procs:
                p.start()
            returncode, timed_out = _wait(procs, time.monotonic() + timeout, kill_on_failure)
        finally:  # also on KeyboardInterrupt or a pytest-timeout: no rank outlives its launch
            _kill(procs)
        stdout = "".join(Path(o).read_text(errors="replace") for o, _ in files)
        stderr = "".join(Path(e).read_text(errors="replace") for _, e in files)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _wait(procs, deadline: float, kill_on_failure: bool = True) -> tuple[int, bool]:
    """Wait for all ranks to exit 0, or the first nonzero exit (all ranks' exits unless ``kill_on_failure``),
    or ``deadline``: (returncode, timed_out)."""
    pending = list(procs)
    first_failure = 0
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return 1, True
        multiprocessing.connection.wait([p.sentinel for p in pending], timeout=left)
        for p in [p for p in pending if not p.is_alive()]:
            p.join()
            pending.remove(p)
            if p.exitcode != 0 and kill_on_failure:
                return p.exitcode, False
            first_failure = first_failure or p.exitcode
    return first_failure, False
