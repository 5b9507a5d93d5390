"""The real parsers of ``kforge``, captured without running anything: what the generated reference pages describe
and what the docs' commands are checked against.

Each tool of :data:`kempnerforge.commands.TOOLS` builds its parser inside its entry function; :func:`tool_parser`
calls that function with the parse replaced by a capture, so a new tool or option is documented and checked with no
list to update here. The training subcommands' parser is LightningCLI's, built by :class:`kempnerforge.cli.KForgeCLI`
exactly as ``kforge fit`` builds it (:func:`fit_parser`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

#: Arguments of the parsers' entry points when captured: none (the capture happens before any is read).
_NO_ARGS: list[str] = []
#: Options that switch a tool to a parser of its own (``kforge prepare-data --merge DIR...`` joins array parts).
MODES: dict[str, tuple[str, ...]] = {"prepare-data": ("--merge",)}


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _capturing() -> Iterator[None]:
    """Make the first ``parse_args`` / ``parse_known_args`` of any argparse or jsonargparse parser raise
    :class:`_Captured` with that parser."""
    import jsonargparse

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    patched = [(cls, name, cls.__dict__[name]) for cls in (argparse.ArgumentParser, jsonargparse.ArgumentParser)
               for name in ("parse_args", "parse_known_args") if name in cls.__dict__]  # fmt: skip
    for cls, name, _ in patched:
        setattr(cls, name, capture)
    try:
        yield
    finally:
        for cls, name, original in patched:
            setattr(cls, name, original)


def tool_parser(name: str, mode: str | None = None) -> argparse.ArgumentParser:
    """The parser ``kforge <name>`` parses its arguments with (``name`` a key of ``TOOLS``); with ``mode`` (one of
    :data:`MODES`), the one that option switches to.

    Raises:
        RuntimeError: the tool's entry function returned without parsing anything.
    """
    from kempnerforge.commands import TOOLS

    module_name, func = TOOLS[name][1].split(":")
    entry = getattr(importlib.import_module(module_name), func)
    with _capturing():
        try:
            entry([mode] if mode else list(_NO_ARGS))
        except _Captured as found:
            return found.parser
    raise RuntimeError(f"kforge {name} parsed no arguments")


def fit_parser(subcommand: str = "fit", recipe: str | None = None) -> Any:
    """LightningCLI's parser of ``kforge <subcommand>`` (jsonargparse), as :func:`kempnerforge.cli.make_cli` builds it.

    Args:
        subcommand: ``fit``, ``validate``, ``test`` or ``predict``.
        recipe: a ``--config`` file that decides the mode (a ``class_path`` model or data module: subclass mode, as
            the VLM and chat recipes use); None: the text recipes' ``CausalLM`` + ``TokenDataModule``.
    """
    from kempnerforge import cli

    args = [subcommand, *(["--config", recipe] if recipe else [])]

    class Grab(cli.KForgeCLI):
        def parse_arguments(self, parser: Any, args: Any) -> None:
            raise _Captured(parser)

    try:
        Grab(**cli.cli_classes(args), args=args, run=True, trainer_defaults={"precision": "32-true"},
             auto_configure_optimizers=False)  # fmt: skip
    except _Captured as found:
        return found.parser._subcommands_action._name_parser_map[subcommand]
    raise RuntimeError("KForgeCLI parsed no arguments")


def class_parser(cls: type, prefix: str) -> Any:
    """A jsonargparse parser of ``cls``'s constructor under ``prefix`` (``trainer.strategy.init_args``): how
    LightningCLI reads the ``init_args`` of a class named by ``class_path`` in a recipe."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, prefix, sub_configs=True)
    return parser


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-parsers of ``parser`` by name (``kforge convert dcp-to-hf``); empty when it has none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
