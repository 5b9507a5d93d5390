"""The ``kforge`` console script. ``kforge --help`` prints without importing torch or Lightning (well under a
second; importing them takes 5-15 s on a busy login node), a tool imports only its own module, and the
training commands go on to the LightningCLI (:func:`kempnerforge.cli.main`).
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main()
