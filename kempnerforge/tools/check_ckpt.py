"""``kforge check-ckpt``: is a checkpoint whole? Every file checked against the checksum recorded when it was written.

    kforge check-ckpt checkpoints/debug/step=00000100.ckpt     # one checkpoint
    kforge check-ckpt checkpoints/debug                        # every checkpoint in the folder, and its `latest`

Prints one line per checkpoint (``OK``, ``BAD``, ``UNVERIFIED`` for one written before checksums were recorded,
whose structure alone is checked, ``PARTIAL`` for a save that never finished) and one line per bad file.
Reads every byte of every file once, in this process (no process group).

Exit status: 0 when no checkpoint is bad, 2 when one is (or the path holds no checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.checkpoint.layout import COMPLETE_FILE, LATEST_FILE, PARTIAL_SUFFIX, latest_name
from kempnerforge.cli_errors import ToolArgumentParser
from kempnerforge.exit_status import SUCCESS, USAGE


def _is_checkpoint(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in (COMPLETE_FILE, ".metadata", "meta.pt"))


def check_one(path: Path) -> tuple[str, list[str]]:
    """``(status line, one line per bad file)`` for checkpoint directory ``path``."""
    from kempnerforge.checkpoint.verify import check_checkpoint

    if path.name.endswith(PARTIAL_SUFFIX):
        return f"PARTIAL {path} (a save that did not finish; never resumed from)", []
    problems: list[str] = []
    if not (path / COMPLETE_FILE).is_file():
        problems.append(f"  {path / COMPLETE_FILE}: missing (the save did not complete)")
    errors, verified = check_checkpoint(path)
    problems += [f"  {err.file or path}: {_reason(str(err), err.file)}" for err in errors]
    if problems:
        return f"BAD {path}", problems
    if not verified:
        return f"UNVERIFIED {path} (written before checksums were recorded: structure checked only)", []
    return f"OK {path}", []


def _reason(message: str, file: Path | None) -> str:
    # "checkpoint X is corrupt: FILE reason" -> "reason": the line starts with the file already.
    if file is not None and f"{file} " in message:
        return message.split(f"{file} ", 1)[1]
    return message


def _latest_problem(folder: Path) -> str | None:
    try:
        name = latest_name(folder)
    except CheckpointError as err:
        return f"  {folder / LATEST_FILE}: {err}"
    if name is not None and not (folder / name / COMPLETE_FILE).is_file():
        return f"  {folder / LATEST_FILE}: names {name}, which is not a complete checkpoint"
    return None


def check_ckpt(path: str | Path) -> int:
    """Check checkpoint ``path`` or every checkpoint in the folder ``path``; print the report.

    Returns:
        The exit status: 0 when nothing is bad, 2 when a checkpoint or the ``latest`` pointer is bad or there is
        no checkpoint at ``path``.
    """
    path = Path(path)
    if _is_checkpoint(path):
        targets, latest = [path], None
    elif path.is_dir():
        targets = sorted(p for p in path.iterdir() if p.is_dir() and ".ckpt" in p.name)
        latest = _latest_problem(path)
    else:
        print(f"kforge: error: check-ckpt: {path} does not exist", file=sys.stderr)
        return USAGE
    if not targets:
        print(f"kforge: error: check-ckpt: {path} holds no checkpoint (no *.ckpt directory)", file=sys.stderr)
        return USAGE
    bad = latest is not None
    if latest is not None:
        print(f"BAD {path / LATEST_FILE}")
        print(latest)
    for target in targets:
        status, problems = check_one(target)
        print(status)
        for line in problems:
            print(line)
        bad = bad or bool(problems)
    return USAGE if bad else SUCCESS


def build_parser() -> ToolArgumentParser:
    """Arguments of ``kforge check-ckpt``."""
    p = ToolArgumentParser(prog="kforge check-ckpt", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a checkpoint directory, or a folder of them (a run's ModelCheckpoint dirpath)")
    return p


def check_ckpt_main(argv: list[str] | None = None) -> None:
    """Entry point of ``kforge check-ckpt``.

    Raises:
        SystemExit: the status of :func:`check_ckpt`.
    """
    args = build_parser().parse_args(argv)
    raise SystemExit(check_ckpt(args.path))
