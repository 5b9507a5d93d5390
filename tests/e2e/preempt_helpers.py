"""Helpers for the preemption / kill tests: a tiny 2-process `kforge fit` config, launching, and loss read-back."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 10


def write_config(
    tmp: Path,
    data_dir: Path,
    extra_callbacks: list[dict] | None = None,
    async_save: bool = False,
    preemption: bool = True,
) -> Path:
    """debug.yaml shrunk to a ~3M-parameter model (mostly the embedding), 10 steps, CSV losses every step.
    ``preemption=False``: the recipe's own callbacks only (no Preemption: the strategy's default handling)."""
    cfg = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
    cfg["trainer"].update(
        devices=2,
        max_steps=MAX_STEPS,
        limit_val_batches=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        logger={
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp / "runs"), "name": "t", "flush_logs_every_n_steps": 1},
        },
    )
    cfg["trainer"]["strategy"]["init_args"]["async_checkpoint"] = async_save
    ckpt = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))["init_args"]
    ckpt.update(dirpath=str(tmp / "ckpt"), every_n_train_steps=4)
    # check_every_s=0: agree on the flag every step, so a signal at a random step of this 10-step run stops
    # it at the next one (the default agrees every ~10 s of training; tests/unit covers that schedule).
    default = [{"class_path": "kempnerforge.callbacks.Preemption", "init_args": {"check_every_s": 0}}]
    cfg["trainer"]["callbacks"] += extra_callbacks or (default if preemption else [])
    cfg["model"]["config"].update(dim=64, n_layers=2, max_seq_len=64, multiple_of=32)
    cfg["data"].update(data_dir=str(data_dir), seq_len=32, micro_batch_size=2)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


#: Every process group :func:`start` launched; ``kill_started`` (after each test, tests/conftest.py) ends those alive.
STARTED: list[subprocess.Popen] = []


def kill_started() -> list[int]:
    """SIGKILL the process group of every :func:`start`-ed command still running (a test that failed or timed out
    mid-run must not leave ranks competing with the rest of the suite for the cores); returns their pids."""
    alive = [p for p in STARTED if p.poll() is None]
    for proc in alive:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    STARTED.clear()
    return [p.pid for p in alive]


def start(cfg: Path, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """`kforge fit --config cfg` (2 processes through Lightning's launcher) in its own session."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    out = open(log or cfg.with_suffix(".log"), "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "kempnerforge.cli", "fit", "--config", str(cfg)],
        cwd=REPO,
        env=full,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    STARTED.append(proc)
    return proc


def losses(tmp: Path, metric: str = "train/loss") -> dict[int, float]:
    """``metric`` by step over every CSVLogger version in order (a resumed run overwrites the steps it redid)."""
    found: dict[int, float] = {}
    for version in sorted((tmp / "runs" / "t").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        metrics = version / "metrics.csv"
        if metrics.is_file():
            for row in csv.DictReader(metrics.open()):
                if row.get(metric):
                    found[int(row["step"])] = float(row[metric])
    return found


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0, poll: float = 0.01) -> None:
    """Poll ``predicate`` until true; fail if the process exits first or time runs out."""
    end = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before the condition was met")
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(poll)


def children(pid: int) -> list[int]:
    """Direct child process ids (Linux /proc)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def log_text(cfg: Path) -> str:
    return cfg.with_suffix(".log").read_text()
