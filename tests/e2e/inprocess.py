"""Run ``kforge`` in the pytest process: CLI tests that parse, print, validate or prepare data, and recipe runs
beside the one that goes through a real ``kforge`` process.

A ``kforge`` subprocess pays ~11 s of imports (torch, Lightning, torchmetrics) before it parses one argument;
in-process the same ``kempnerforge.cli.main`` runs in well under a second. The result looks like a finished
subprocess (exit code, stdout, stderr), and what the call changes in this process (working directory,
environment such as PL_GLOBAL_SEED, ``sys.argv``, RNG states, warning filters, a process group the run
initialized) is restored afterwards, so later tests see the process as before. Each trained recipe still
has a run as a real ``kforge`` subprocess (quickstart, CLI short run, preemption, one arch per VLM recipe test).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from kempnerforge.cli import main
from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]


def kforge_in_process(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``kforge *args`` run as ``kempnerforge.cli.main(list(args))`` in ``cwd``.

    Returns:
        ``CompletedProcess``: ``returncode`` is the ``SystemExit`` code (0 when ``main`` returns; 1, with the
        traceback on stderr as the interpreter would print it, when it raises), ``stdout`` / ``stderr`` what it
        wrote there, Lightning's log lines included (its handlers hold the real stderr: they are pointed at the
        captured one for the call).
    """
    out, err = io.StringIO(), io.StringIO()
    env, cwd_before, argv = dict(os.environ), os.getcwd(), sys.argv
    had_group = dist.is_initialized()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    code = 0
    streams = [
        (h, h.stream)
        for name in ("lightning", "lightning.pytorch", "lightning.fabric")
        for h in logging.getLogger(name).handlers
        if type(h) is logging.StreamHandler
    ]
    try:
        for handler, _ in streams:
            handler.setStream(err)
        os.chdir(cwd)
        sys.argv = ["kforge", *args]  # what LightningCLI sees in a real `kforge` process (pytest's otherwise)
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as e:  # argparse / LightningCLI exits: --help, --print_config, parse errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    err.write(e.code + "\n")
            except Exception:  # an uncaught error: the interpreter prints the traceback and exits 1
                traceback.print_exc(file=err)
                code = 1
    finally:
        for handler, stream in streams:
            handler.setStream(stream)
        if not had_group and dist.is_initialized():  # KempnerStrategy's 1-rank group outlives Trainer.fit
            dist.destroy_process_group()
        os.chdir(cwd_before)
        sys.argv = argv
        os.environ.clear()
        os.environ.update(env)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    return subprocess.CompletedProcess(["kforge", *args], code, out.getvalue(), err.getvalue())


def run_kforge(*args: str, subprocess_run: bool = False, timeout: float = 400) -> subprocess.CompletedProcess:
    """``kforge *args`` from the repository root: a real ``kforge`` process (``subprocess_run``: what a user runs,
    imports included) or :func:`kforge_in_process`; raise AssertionError with the output tails when it fails."""
    if subprocess_run:
        env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "kempnerforge.cli", *args]
        proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        proc = kforge_in_process(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
