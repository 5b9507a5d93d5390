"""The ``kforge`` commands the documentation shows, read out of its Markdown, and their checks against the real CLI.

A command is found in a shell code block (``bash``, ``sh``, ``console`` or a block whose lines start with ``$ ``), in
an inline code span that starts with ``kforge <subcommand>``, or behind ``srun`` / ``sbatch`` (an sbatch template
runs ``kforge fit --config CONFIG <overrides>``). Each is checked one of two ways:

- run as written, in order, when it is in a ``title="On this machine (CPU)"`` block of a page that
  ``tests/e2e/test_docs_tutorials.py`` executes;
- otherwise parsed by the real parsers without running anything: a training subcommand with ``--print_config``
  (LightningCLI, in-process), a tool with its own argparse / jsonargparse parser (options that are required but left
  out of a fragment get a placeholder), ``kforge estimate``'s own options by its parser and the rest as ``kforge fit``.

A ``$ kforge ...`` line followed by the ``kforge: error: <field>: ...`` it prints is run instead, and must print
that field. So a renamed subcommand, option or config field fails a test until the docs say the new name.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Code block languages holding shell commands.
SHELL = ("bash", "sh", "shell", "console")
#: The title of the blocks a tutorial test runs as written.
CPU_TITLE = "On this machine (CPU)"

_FENCE = re.compile(r"^(\s*)```(\w*)([^\n]*)$")
_INLINE = re.compile(r"(?<!`)`(kforge [^`]+)`(?!`)")


@dataclass
class Block:
    """A fenced code block: its language, its ``title="..."`` (empty when none), its text and first line number."""

    lang: str
    title: str
    text: str
    line: int


@dataclass
class Command:
    """One ``kforge`` command: its arguments after ``kforge``, where it was found, how to check it."""

    argv: list[str]
    where: str
    executed: bool = False
    expected_error: str | None = None  # the field of the `kforge: error:` line the docs show after it
    dropped: list[str] = field(default_factory=list)  # --config files the page itself writes first

    def __str__(self) -> str:
        return f"{self.where}: kforge {shlex.join(self.argv)}"


def blocks(markdown: str) -> list[Block]:
    """Every fenced code block of ``markdown``."""
    found, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, rest = m.groups()
        title = re.search(r'title="([^"]*)"', rest)
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        found.append(Block(lang, title.group(1) if title else "", "\n".join(body), i + 1))
        i = j + 1
    return found


def shell_commands(text: str) -> list[tuple[str, int]]:
    """The commands of a shell block as ``(command, offset of its first line)``: ``\\`` continuations joined,
    heredoc bodies skipped, ``$ `` prompts removed, ``&&`` chains split."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
        if heredoc:
            while i + 1 < len(lines) and lines[i + 1].strip() != heredoc.group(1):
                i += 1
            i += 1
        line = line.strip().removeprefix("$ ")
        out += [(part.strip(), start) for part in line.split("&&") if part.strip()]
        i += 1
    return out


def kforge_argv(command: str) -> list[str] | None:
    """The arguments after ``kforge`` of a shell command, or None when it runs no kforge: ``srun [options] kforge``
    and ``sbatch [options] scripts/slurm/*.sbatch CONFIG ...`` (as ``fit --config CONFIG ...``; the array template
    ``prepare_data_array.sbatch PARTS SOURCE TOKENIZER OUTPUT_DIR ...`` as its ``prepare-data`` part 0) count; comments,
    redirections and ``&`` are removed."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    kept, skip = [], False
    for word in words:  # redirections (and the file after a bare `>`), a trailing `&`
        if skip:
            skip = False
        elif re.fullmatch(r"\d?>>?|<", word):
            skip = True
        elif not re.match(r"^\d?>>?&?\d*|^&$|^\|$", word):
            kept.append(word)
    words = kept
    if words[:1] == ["srun"]:
        words = words[next((i for i, w in enumerate(words) if w == "kforge"), len(words)) :]
    if words[:1] == ["sbatch"]:
        script = next((i for i, w in enumerate(words) if w.endswith(".sbatch")), None)
        if script is None or script + 1 >= len(words):
            return None
        args = words[script + 1 :]
        if words[script].endswith("prepare_data_array.sbatch"):  # PARTS SOURCE TOKENIZER OUTPUT_DIR [options]
            parts, source, tokenizer, out, *rest = [*args, "", "", "", ""][: max(len(args), 4)]
            return ["prepare-data", "--source", source, "--tokenizer", tokenizer, "--output_dir", out,
                    "--num_shards", parts, "--shard_index", "0", *rest]  # fmt: skip
        return ["fit", "--config", *args]
    return words[1:] if words[:1] == ["kforge"] else None


def page_commands(path: Path, executed: bool = False) -> list[Command]:
    """Every kforge command of the Markdown file ``path``; ``executed``: the page's CPU blocks are run by a test."""
    text = path.read_text()
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found: list[Command] = []
    fenced_lines = set()
    for block in blocks(text):
        fenced_lines.update(range(block.line, block.line + block.text.count("\n") + 2))
        prompts = [ln for ln in block.text.splitlines() if ln.startswith("$ ")]
        if block.lang not in SHELL and not prompts:
            continue
        body_lines = block.text.splitlines()
        for command, offset in shell_commands(block.text):
            argv = kforge_argv(command)
            if argv is None:
                continue
            cmd = Command(argv, f"{rel}:{block.line + 1 + offset}")
            cmd.executed = executed and block.title == CPU_TITLE
            after = body_lines[offset + 1] if offset + 1 < len(body_lines) else ""
            error = re.match(r"kforge: error: (\S+?):", after)
            if body_lines[offset].startswith("$ ") and error:
                cmd.expected_error = error.group(1)
            found.append(cmd)
    for number, line in enumerate(text.splitlines(), 1):
        if number in fenced_lines:
            continue
        for span in _INLINE.findall(line):
            argv = kforge_argv(span)
            if argv:
                found.append(Command(argv, f"{rel}:{number}"))
    _drop_written_configs(found, text)
    return found


def _drop_written_configs(commands: list[Command], page: str) -> None:
    """A ``--config`` file the page writes before using it (``cat > x.yaml``, or a folder an earlier command gets as
    ``--output_dir``) cannot be read when the command is only parsed: it is dropped from the parse, and recorded."""
    written = set(re.findall(r">>?\s*(\S+\.ya?ml)", page))
    outputs = []
    for cmd in commands:
        args = cmd.argv
        for i, arg in enumerate(args[:-1]):
            if arg == "--config" and not (REPO / args[i + 1]).exists():
                target = args[i + 1]
                if target in written or any(target.startswith(out.rstrip("/") + "/") for out in outputs):
                    cmd.dropped.append(target)
        for i, arg in enumerate(args[:-1]):
            if arg == "--output_dir":
                outputs.append(args[i + 1])
        for target in cmd.dropped:
            i = cmd.argv.index(target)
            cmd.argv = cmd.argv[: i - 1] + cmd.argv[i + 1 :]


def recipe_commands(path: Path) -> list[Command]:
    """The kforge commands in a recipe's leading comment (``# kforge estimate --config ... \\`` continued on the
    next comment line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").strip())
    found, text = [], "\n".join(lines)
    for command, offset in shell_commands(text):
        argv = kforge_argv(command.split(" (")[0]) if re.match(r"(srun )?kforge ", command) else None
        if argv:
            rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            found.append(Command(_until_prose(argv), f"{rel}:{offset + 1}"))
    return found


def _until_prose(argv: list[str]) -> list[str]:
    """A comment's command up to where its prose starts (``... --devices_per_node 4 with both flags above``): the
    subcommand (and ``convert``'s direction), then options and the values of options written without ``=``."""
    keep = argv[: 2 if argv[:1] == ["convert"] else 1]
    for word in argv[len(keep) :]:
        if word.startswith("-") or (keep[-1].startswith("--") and "=" not in keep[-1]):
            keep.append(word)
        else:
            break
    return keep


def doc_pages() -> list[Path]:
    """The README and every page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


# -- checking a command against the real CLI ------------------------------------------------------------------------

DOCS_SCRIPTS = REPO / "scripts" / "docs"


def _parsers():
    """``scripts/docs/parsers.py``: the parsers the reference pages are generated from."""
    import sys

    if str(DOCS_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(DOCS_SCRIPTS))
    import parsers

    return parsers


#: The recipe a generic ``--config recipe.yaml`` in prose is parsed with.
ANY_RECIPE = "configs/debug.yaml"
#: What a placeholder in a command stands for when it is parsed (``<recipe>``, ``...``, ``N``, ``DIR``).
_PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|^[A-Z]{1,4}$")


def normalized(argv: list[str]) -> list[str]:
    """``argv`` with the docs' placeholders replaced by a value (``1``) and ``<...>`` words that shlex split joined;
    a ``--config`` file that does not exist stays (the parse then fails: only files the page writes are dropped)."""
    joined: list[str] = []
    for word in argv:
        if joined and joined[-1].count("<") > joined[-1].count(">"):
            joined[-1] += " " + word
        else:
            joined.append(word)
    out: list[str] = []
    for word in joined:
        name, eq, value = word.partition("=")
        if (
            out
            and out[-1] == "--config"
            and (_PLACEHOLDER.search(word) or ("/" not in word and not Path(word).exists()))
        ):
            out.append(ANY_RECIPE)  # `--config recipe.yaml`, `--config configs/<recipe>.yaml`: any recipe
            continue
        if eq and name.startswith("--") and _PLACEHOLDER.search(value):
            out.append(f"{name}=1")
        elif not word.startswith("--") and _PLACEHOLDER.search(word):
            out.append("1")
        else:
            out.append(word)
    return out


def _with_values(parser, args: list[str]) -> list[str]:
    """``args`` with a placeholder value after a trailing option that takes one (``kforge eval --ckpt`` in prose) and
    each required option the fragment leaves out (``--source`` of ``prepare-data --format chat``)."""
    import argparse

    actions = {s: a for a in parser._actions for s in a.option_strings}
    out = list(args)
    if out and out[-1] in actions and actions[out[-1]].nargs != 0 and "=" not in out[-1]:
        out.append("1")
    given = {a.split("=")[0] for a in out if a.startswith("-")}
    for action in parser._actions:
        if action.required and action.option_strings and not given & set(action.option_strings):
            out += [action.option_strings[-1], "1"]
        if action.required and not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            if not [a for a in out if not a.startswith("-")]:
                out.append("1")
    return out


def _parse_tool(name: str, args: list[str]) -> str | None:
    """Parse ``args`` with ``kforge <name>``'s own parser; the error line, or None."""
    import contextlib
    import io

    parsers = _parsers()
    mode = next((m for m in parsers.MODES.get(name, ()) if m in args or any(a.startswith(m + "=") for a in args)), None)
    parser = parsers.tool_parser(name, mode)
    subs = parsers.subparsers(parser)
    if subs:
        if not args or args[0] not in subs:
            return f"kforge {name}: no such direction {args[:1]} (one of {sorted(subs)})"
        args = [args[0], *_with_values(subs[args[0]], args[1:])]
    else:
        args = _with_values(parser, args)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if name == "estimate":
                _, rest = parser.parse_known_args(args)
                return check_training("fit", rest)
            parser.parse_args(args)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return err.getvalue().strip() or f"exit {exit_.code}"
    return None


def check_training(sub: str, args: list[str], cwd: Path = REPO) -> str | None:
    """``kforge <sub> <args> --print_config`` in-process; the error output, or None when it parses."""
    from tests.e2e.inprocess import kforge_in_process

    proc = kforge_in_process(sub, *args, "--print_config", cwd=cwd)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def check(cmd: Command) -> str | None:
    """What is wrong with ``cmd`` as the real CLI sees it; None when it parses (see the module docstring)."""
    from kempnerforge.commands import LIGHTNING_COMMANDS, TOOLS

    argv = normalized(cmd.argv)
    if not argv or argv[0] in ("-h", "--help"):
        return None
    names = [*LIGHTNING_COMMANDS, *TOOLS]
    mentioned = [argv[0], *[argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "/"]]  # `kforge fit / validate`
    unknown = [n for n in mentioned if n not in names]
    if unknown:
        return f"unknown subcommand {unknown[0]!r} (kforge has {', '.join(names)})"
    if len(mentioned) > 1:  # prose naming several subcommands: the names are what is checked
        return None
    rest = argv[1:]
    if not rest or rest in (["--help"], ["-h"]):
        return None
    if argv[0] in LIGHTNING_COMMANDS:
        if rest[-1].startswith("--") and "=" not in rest[-1] and rest[-1] != "--print_config":  # `fit --ckpt_path`
            rest = [*rest, "1"]
        return check_training(argv[0], rest)
    return _parse_tool(argv[0], rest)
