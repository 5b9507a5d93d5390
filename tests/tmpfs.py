"""A tmpfs mounted for one test (needs mount rights: root in a container with CAP_SYS_ADMIN), skipped where it
cannot be made: a full disk that is really full, or a folder that is read-only even for root."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """Mount a tmpfs with ``options`` (``size=1m``, ``ro,size=1m``) at the new folder ``mnt``; unmount afterwards.

    Raises:
        pytest.skip.Exception: the mount is refused here.
    """
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
