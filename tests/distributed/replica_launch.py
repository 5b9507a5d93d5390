"""Launch replica groups for the fault-tolerance tests: a torchft lighthouse in the test process, each group a world
of forked ranks with its own rendezvous port (as one SLURM job step per group would have)."""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import time
import uuid
from pathlib import Path

from tests.distributed.forked_ranks import _forkserver, _free_port, _kill, _rank_main, rank_env

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "replica_group_script.py"


@contextlib.contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 60_000, heartbeat_timeout_ms: int = 2_000):
    """A torchft lighthouse on a free port for the ``with`` block; yields its ``http://host:port``."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and vote at info
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield server.address()
    finally:
        server.shutdown()


class Group:
    """The forked ranks of one replica group, started at once; their output goes to ``<logs>/<name>.<rank>.{out,err}``."""

    def __init__(self, name: str, nproc: int, args: list[str], env: dict[str, str], logs: Path) -> None:
        ctx = _forkserver()
        port, run_id = _free_port(), uuid.uuid4().hex
        base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn", **env}
        self.files = [(logs / f"{name}.{r}.out", logs / f"{name}.{r}.err") for r in range(nproc)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(str(SCRIPT), list(args), {**base, **rank_env(r, nproc, port, run_id)}, *map(str, self.files[r])),
                name=f"{name}.{r}",
            )
            for r in range(nproc)
        ]
        for proc in self.procs:
            proc.start()

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes after every rank exits or ``timeout`` seconds (then the rest are killed: None)."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            left = deadline - time.monotonic()
            if left > 0:
                multiprocessing.connection.wait([proc.sentinel], timeout=left)
        codes = [proc.exitcode for proc in self.procs]
        _kill(self.procs)
        return codes

    def kill(self) -> None:
        _kill(self.procs)

    def log(self) -> str:
        return "".join(Path(f).read_text(errors="replace") for pair in self.files for f in pair if Path(f).exists())
