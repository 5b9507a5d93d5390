"""User errors: a setting, a path or the job's size that cannot work, named by the field that causes it.

``kforge`` prints such an error as one line, ``kforge: error: <field>: <message>``, and exits with status 2
(:mod:`kempnerforge.cli_errors`); any other exception keeps its traceback. Library code raises these (or the
typed errors the CLI lists as user errors, e.g. ``MeshConfigError``) with a message that says what is allowed.
This module imports nothing heavy: the ``kforge`` entry point loads it before torch.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with what the user gave, not with the code.

    Args:
        field: the config field, CLI option, file or environment variable that causes it
            (``model.config.n_heads``, ``data.tokenizer``, ``--config``, ``SLURM_NTASKS``).
        message: what is wrong and what is allowed, without the field prefix.

    Attributes:
        field: as given.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple:
        # Picklable with every attribute (a DataLoader worker or another rank may send it), whatever __init__ takes.
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict) -> UserError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class PathError(UserError):
    """A path in the config that does not exist or is not what the field needs (a folder, a file)."""


class RendezvousTimeoutError(UserError):
    """Fewer ranks than the world size joined the rendezvous in time.

    Attributes:
        joined: ranks that joined (None when this rank could not reach rank 0's store at all).
        expected: the world size the job's settings imply.
    """

    def __init__(self, field: str, message: str, joined: int | None, expected: int) -> None:
        super().__init__(field, message)
        self.joined, self.expected = joined, expected
