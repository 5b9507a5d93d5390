"""Checks of the paths a command reads or writes, before it starts: one :class:`~kempnerforge.errors.PathError` naming
the field (``data.tokenizer`` under ``fit``, ``--tokenizer`` under a tool) instead of a traceback from deep inside
the tokenizer library, the dataset reader or ``os.makedirs`` after the process group started.

Each check reads at most a directory listing and file sizes and writes nothing: a folder to be written is checked
with ``os.access`` on the nearest existing parent (a read-only mount answers no even for root).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from kempnerforge.errors import PathError

__all__ = ["check_source", "check_tokenizer", "check_writable"]

#: Files a local tokenizer folder holds (``tokenizers``' ``tokenizer.json``, or what ``AutoTokenizer`` reads).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def check_tokenizer(path: str | os.PathLike, field: str) -> None:
    """``path`` is a local tokenizer: a folder holding one of :data:`TOKENIZER_FILES`, or a ``tokenizer.json`` file.

    Raises:
        PathError: it does not exist, is another kind of file, or is a folder without tokenizer files.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise PathError(field, f"{str(path)!r} does not exist; give a local tokenizer folder (nothing is downloaded)")
    if p.is_file():
        if p.suffix != ".json":
            raise PathError(field, f"{path} is a file, not a tokenizer folder (or its tokenizer.json)")
        return
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise PathError(field, f"{path} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")


def check_source(source: str | os.PathLike, field: str) -> None:
    """``source`` (a file, folder or glob pattern) exists and is not only empty files.

    Raises:
        PathError: nothing matches, or every matched file (every file under a matched folder) has 0 bytes.
    """
    matches = [Path(m) for m in glob.glob(str(Path(source).expanduser()))]
    if not matches:
        raise PathError(field, f"{str(source)!r} does not exist (a local file, folder or glob pattern)")
    files = [f for m in matches for f in ([m] if m.is_file() else m.rglob("*")) if f.is_file()]
    if not files:
        raise PathError(field, f"{source} holds no files")
    if all(f.stat().st_size == 0 for f in files):
        raise PathError(field, f"{source} is empty ({len(files)} file{'s' * (len(files) > 1)} of 0 bytes)")


def check_writable(path: str | os.PathLike, field: str) -> None:
    """Folder ``path`` exists as a writable folder, or can be created (its nearest existing parent is a writable
    folder); nothing is created.

    Raises:
        PathError: ``path`` or a parent is a file, or the nearest existing folder is not writable (read-only mount,
            permissions).
    """
    p = Path(path).expanduser().absolute()
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise PathError(field, f"{path} is not writable: {existing} is a file, so it cannot be a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        if _read_only_mount(existing):
            raise PathError(field, f"{path} is not writable: {existing} is on a read-only filesystem")
        raise PathError(field, f"{path} is not writable: no write permission in {existing}")


def _read_only_mount(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
