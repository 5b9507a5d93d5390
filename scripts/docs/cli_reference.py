"""The generated CLI reference: ``kforge --help``, then every subcommand's options from its real parser."""

from __future__ import annotations

from fields import fields, markdown_help, table
from parsers import MODES, fit_parser, subparsers, tool_parser

#: Where each training subcommand's ``--model.*`` / ``--data.*`` / ``--trainer.*`` fields are documented.
CONFIG_PAGE = "config.md"


def _tool_section(name: str) -> list[str]:
    parser = tool_parser(name)
    out = [f"## `kforge {name}`", "", markdown_help(parser.description), ""]
    subs = subparsers(parser)
    if not subs:
        out += [table(fields(parser)), ""]
        for mode in MODES.get(name, ()):
            other = tool_parser(name, mode)
            out += [f"### `kforge {name} {mode}`", "", markdown_help(other.description or ""), "",
                    table(fields(other)), ""]  # fmt: skip
        return out
    for sub, sub_parser in subs.items():
        out += [f"### `kforge {name} {sub}`", "", markdown_help(sub_parser.description or ""), "",
                table(fields(sub_parser)), ""]  # fmt: skip
    return out


def _training_section(name: str, help_line: str) -> list[str]:
    parser = fit_parser(name)
    own = [f for f in fields(parser) if "." not in f.name]
    return [
        f"## `kforge {name}`",
        "",
        markdown_help(help_line),
        "",
        f"LightningCLI: `--config recipe.yaml` (repeatable: later files override earlier ones), then `--model.*`, "
        f"`--data.*` and `--trainer.*` overrides; every field is listed in the [configuration reference]({CONFIG_PAGE}). "
        "Its own options:",
        "",
        table(own),
        "",
    ]


def cli_markdown() -> str:
    """The page ``reference/cli.md``."""
    from kempnerforge.commands import LIGHTNING_COMMANDS, TOOLS, help_text

    out = [
        "# CLI reference",
        "",
        "Generated from the parsers `kforge` runs (`scripts/docs/cli_reference.py`); every option below is what the "
        "command accepts today.",
        "",
        "```text",
        "$ kforge --help",
        help_text(),
        "```",
        "",
    ]
    for name, line in LIGHTNING_COMMANDS.items():
        out += _training_section(name, line)
    for name in TOOLS:
        out += _tool_section(name)
    return "\n".join(out)
