"""Run a script under ``torchrun`` with a timeout, so a deadlock becomes a test failure, not a CI hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "train_script.py"


def torchrun(nproc: int, script: Path, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` local gloo ranks; raise AssertionError with the output on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def train(nproc: int, data: Path, out: Path, *extra: str, timeout: float = 240) -> dict:
    """Run ``train_script.py`` and return its JSON record (losses, grad_norms, steps)."""
    torchrun(nproc, TRAIN_SCRIPT, ["--data", str(data), "--out", str(out), *extra], timeout=timeout)
    return json.loads(out.read_text())
