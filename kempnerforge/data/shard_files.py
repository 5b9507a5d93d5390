"""Files of a prepared token folder that text and chat preparation share: names, atomic writes, the output folder.

:mod:`kempnerforge.data.prepare` (text) and :mod:`kempnerforge.data.chat_prepare` (chat) both write through
these, so neither imports the other.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

METADATA_FILE = "metadata.json"
SHARD_PATTERN = "shard_{:05d}.npy"
# Files prepare_data itself writes; only these are removed by overwrite=True.
_ARTIFACT_RE = re.compile(
    r"^((shard|mask|offsets)_\d{5,}\.npy|metadata\.json)(\.tmp)?$|^\.prepare$"
)  # mask/offsets: chat


def is_prepare_artifact(name: str) -> bool:
    """True for file names :func:`prepare_data` writes (shards, metadata, their ``.tmp`` files, the ``.prepare`` records
    folder)."""
    return bool(_ARTIFACT_RE.match(name))


def atomic_write(path: Path, write: Callable[[Any], None], unique: bool = False) -> None:
    """Writes via ``path.tmp`` + fsync + rename, so a crash never leaves a partial ``path``.

    ``unique``: a temporary name of this call's own (``path.<random hex>.tmp``), for a file that several processes
    (array parts on several nodes) may write at once with the same content: none renames another's half-written one.
    """
    tmp = path.with_name(path.name + (f".{uuid.uuid4().hex[:16]}" if unique else "") + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_writable_dir(output_dir: Path) -> None:
    """Create ``output_dir`` (and its parents) and check that this process can write into it.

    Raises:
        FileExistsError: it cannot be created (a read-only parent, a file in the way) or is not writable; the message
            names ``output_dir`` (the option) in one line.
    """
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        writable = os.access(output_dir, os.W_OK | os.X_OK)
    except OSError as err:  # a read-only parent, a file in the way: one line naming the option
        raise FileExistsError(f"output_dir {str(output_dir)!r} cannot be created ({err.strerror})") from err
    if not writable:
        raise FileExistsError(f"output_dir {str(output_dir)!r} is not writable; give a folder you can write")


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Creates ``output_dir``; refuses a non-empty one unless ``overwrite``.

    With ``overwrite`` only our own files go (metadata.json first, so the folder stops looking
    complete before any shard disappears); anything else in the folder is left alone.
    """
    make_writable_dir(output_dir)
    entries = sorted(p.name for p in output_dir.iterdir())
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise FileExistsError(
            f"output_dir {str(output_dir)!r} is not empty ({len(entries)} entries: {shown}); "
            "pass overwrite=True (kforge prepare-data --overwrite true) to replace a previous preparation"
        )
    (output_dir / METADATA_FILE).unlink(missing_ok=True)
    for name in entries:
        if is_prepare_artifact(name):
            if (output_dir / name).is_dir():  # .prepare: a text preparation's records
                shutil.rmtree(output_dir / name, ignore_errors=True)
            else:
                (output_dir / name).unlink(missing_ok=True)
