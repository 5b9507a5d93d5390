"""Checkpoint errors that describe the user's checkpoint, not the code (``kforge`` prints them as one line)."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint path that cannot be loaded: missing, incomplete, or written under another layout."""


class CorruptCheckpointError(CheckpointError):
    """A complete checkpoint with a file that is missing, truncated or unreadable.

    Attributes:
        file: the bad file (None when only the message names it, e.g. an error from another rank).
    """

    def __init__(self, message: str, file: Path | None = None) -> None:
        super().__init__(message)
        self.file = file
