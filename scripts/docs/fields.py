"""One row per option of a parser: name, type, default, choices and help, as the parser itself holds them."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

#: Action classes that are no option of their own (help, nested config files, subclass help).
_SKIP_ACTIONS = ("_HelpAction", "_ActionConfigLoad", "_ActionHelpClassPath", "_ActionHelpClass", "_ActionPrintConfig")


@dataclass(frozen=True)
class Field:
    """One option: ``name`` as typed on the command line (``--model.config.dim``), with its ``type``, ``default``,
    ``choices`` and ``help`` rendered as text (Markdown for help)."""

    name: str
    type: str
    default: str
    choices: str
    help: str
    required: bool = False


def type_name(action: argparse.Action) -> str:
    """The option's type as a reader writes it (``int``, ``int | None``, ``Literal['cosine', ...]``)."""
    hint = getattr(action, "_typehint", None)
    if hint is None:
        hint = action.type
    if hint is None:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return "flag"
        return "str" if action.nargs != 0 else "flag"
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"\btyping\.", "", text)
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Z]\w*)", r"\1", text)  # lightning.pytorch...Strategy -> Strategy
    text = text.replace("NoneType", "None")
    union = re.fullmatch(r"Union\[(.*)\]", text)
    if union and "[" not in union.group(1):
        text = " | ".join(part.strip() for part in union.group(1).split(","))
    return text


def default_text(action: argparse.Action) -> str:
    """The default as it would be written in a recipe; empty when the option has none (required)."""
    if action.required:
        return ""
    value = action.default
    if value is argparse.SUPPRESS:
        return ""
    if isinstance(action, argparse._StoreTrueAction):
        return "false"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "class_path"):  # a jsonargparse Namespace of a class: its class_path
        return str(value.class_path)
    return str(value)


def markdown_help(text: str | None) -> str:
    """A docstring's reStructuredText roles and literals as Markdown code, on one line (it goes in a table cell)."""
    if not text:
        return ""
    text = " ".join(text.split())
    text = re.sub(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return escape_pipes(text.replace("%%", "%"))


def escape_pipes(text: str) -> str:
    """``|`` escaped for a table cell outside code spans (inside them the table parser leaves it alone)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def fields(parser: Any, under: str = "") -> list[Field]:
    """The options of ``parser`` whose name starts with ``under`` (``--model.``), in the parser's order."""
    found = []
    for action in parser._actions:
        if not action.option_strings or type(action).__name__ in _SKIP_ACTIONS:
            continue
        name = max(action.option_strings, key=len)
        if not name.startswith(f"--{under}") or action.help == argparse.SUPPRESS:
            continue
        choices = ", ".join(map(str, action.choices)) if getattr(action, "choices", None) else ""
        found.append(
            Field(name, type_name(action), default_text(action), choices, markdown_help(action.help), action.required)
        )
    return found


def table(rows: list[Field], strip: str = "") -> str:
    """A Markdown table of ``rows``; ``strip`` is removed from the front of each name (the section says it)."""
    lines = ["| option | type | default | description |", "| --- | --- | --- | --- |"]
    for row in rows:
        name = row.name.removeprefix(strip) if strip else row.name
        default = "*required*" if row.required else (f"`{row.default}`" if row.default != "" else "")
        kind = f"`{row.type}`" + (f" (one of {row.choices})" if row.choices else "")
        lines.append(f"| `{name}` | {escape_pipes(kind)} | {escape_pipes(default)} | {row.help} |")
    return "\n".join(lines)
