"""The ``kforge`` console script. ``kforge --help`` prints without importing torch or Lightning (well under a
second; importing them takes 5-15 s on a busy login node), a tool imports only its own module, and the
training commands go on to the LightningCLI (:func:`kempnerforge.cli.main`).
"""

from __future__ import annotations

import gc
import sys

from kempnerforge.commands import run_without_lightning


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kforge`` console script.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).
    """
    if run_without_lightning(sys.argv[1:] if argv is None else list(argv)):
        return
    from kempnerforge.cli import main as cli_main  # torch, Lightning: only for the training commands

    cli_main(argv)


def console_main() -> None:
    """The ``kforge`` console script: :func:`main`, then an exit that skips the cyclic collector's last passes.

    After a training command the heap holds millions of objects (torch, Lightning, transformers, jsonargparse);
    the interpreter's shutdown collections walk all of them: 1-3 s of a 1-step run's wall time (about 20%),
    the same on every rank. ``gc.freeze()`` moves them to the permanent generation, which those passes skip.
    Files, loggers and checkpoints are already closed by then (``Trainer.fit``'s teardown) and ``atexit``
    handlers (W&B, MLflow) still run. Only the console script does this: an in-process ``main`` (tests,
    notebooks) keeps collecting normally. Not when Triton is loaded (GPU runs): its nanobind objects would then
    be reported as leaked, dozens of lines at the end of every job's log.
    """
    main()
    if "triton" not in sys.modules:
        gc.freeze()


if __name__ == "__main__":
    console_main()
