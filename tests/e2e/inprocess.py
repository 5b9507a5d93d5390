"""Run ``kforge`` in the pytest process, for CLI tests that only parse, print, validate or prepare data.

A ``kforge`` subprocess pays ~11 s of imports (torch, Lightning, torchmetrics) before it parses one argument;
in-process the same ``kempnerforge.cli.main`` runs in well under a second. The result looks like a finished
subprocess (exit code, stdout, stderr), and what the call changes in this process (working directory,
environment such as PL_GLOBAL_SEED, ``sys.argv``, RNG states, warning filters) is restored afterwards, so later tests see
the process as before. Real ``kforge`` subprocesses remain for the tests that train.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from kempnerforge.cli import main

REPO = Path(__file__).resolve().parents[2]


def kforge_in_process(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``kforge *args`` run as ``kempnerforge.cli.main(list(args))`` in ``cwd``.

    Returns:
        ``CompletedProcess``: ``returncode`` is the ``SystemExit`` code (0 when ``main`` returns; 1, with the
        traceback on stderr as the interpreter would print it, when it raises), ``stdout`` / ``stderr`` what it
        wrote there.
    """
    out, err = io.StringIO(), io.StringIO()
    env, cwd_before, argv = dict(os.environ), os.getcwd(), sys.argv
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    code = 0
    try:
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
        os.chdir(cwd_before)
        sys.argv = argv
        os.environ.clear()
        os.environ.update(env)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    return subprocess.CompletedProcess(["kforge", *args], code, out.getvalue(), err.getvalue())
