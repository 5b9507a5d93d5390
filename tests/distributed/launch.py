"""Launch a script on several local gloo ranks with a timeout, so a deadlock becomes a test failure, not a CI hang.

``launch`` forks the ranks from a pre-imported forkserver (``forked_ranks.py``: same per-rank environment as
torchrun, ~10 s less import per rank); ``torchrun`` runs the real ``torch.distributed.run`` for a test that
needs its own process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.forked_ranks import run_ranks
from tests.procs import run_group

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "train_script.py"


def _env() -> dict[str, str]:
    """The caller's environment with one thread per rank (2 shared cores) and unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        cmd = " ".join(str(c) for c in proc.args)
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def launch(
    nproc: int, script: Path, args: list[str], timeout: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` forked gloo ranks (torchrun's environment); raise AssertionError with the
    output on failure when ``check``, subprocess.TimeoutExpired past ``timeout`` seconds (ranks killed)."""
    proc = run_ranks(nproc, script, args, _env(), timeout)
    return _check(proc) if check else proc


def torchrun(nproc: int, script: Path, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Launch ``script`` under ``torchrun --standalone`` (fresh interpreters); raise AssertionError with the output
    on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    proc = run_group([*cmd, *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    return _check(proc)


def train(nproc: int, data: Path, out: Path, *extra: str, timeout: float = 240, real_torchrun: bool = False) -> dict:
    """Run ``train_script.py`` and return its JSON record (losses, grad_norms, steps).

    ``real_torchrun``: fresh interpreters under torchrun instead of forked ranks (tests/gpu: CUDA ranks keep the
    launcher they were verified with on a GPU machine).
    """
    run = torchrun if real_torchrun else launch
    run(nproc, TRAIN_SCRIPT, ["--data", str(data), "--out", str(out), *extra], timeout=timeout)
    return json.loads(out.read_text())


def launch_runs(
    nproc: int, script: Path, data: Path, root: Path, runs: list[str], *, ckpt_root: bool = False,
    timeout: float = 600, tag: str = "records",
) -> dict:  # fmt: skip
    """Launch a multi-run script (:mod:`tests.distributed.multi_run`) on ``nproc`` forked ranks with ``runs``
    (``name:key=value,...``); ``--ckpt-root root`` when ``ckpt_root``. Returns rank 0's ``{name: record}``."""
    out = root / f"{tag}_{nproc}.json"
    saves = ["--ckpt-root", str(root)] if ckpt_root else []
    launch(nproc, script, ["--data", str(data), "--out", str(out), *saves, "--runs", *runs], timeout=timeout)
    return json.loads(out.read_text())
