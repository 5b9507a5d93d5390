"""The table of ``kforge`` subcommands: one line of help each, and the dispatch of the tools.

The console script (:mod:`kempnerforge.entry`) prints :func:`help_text` without importing torch, and both it
and :func:`kempnerforge.cli.main` run a tool through :func:`run_tool`, which imports the tool's module only
when its command runs. A new tool is one entry in :data:`TOOLS`.
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

#: LightningCLI subcommands (trainer methods), with one line of help each.
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "train a recipe (kforge fit --config configs/debug.yaml); run it again and it resumes by itself",
    "validate": "run the validation loop on a checkpoint (--ckpt_path)",
    "test": "run the test loop on a checkpoint (--ckpt_path)",
    "predict": "run the predict loop on a checkpoint (--ckpt_path)",
}
#: Tools besides the Lightning subcommands: name -> (one line of help, "module:function" taking argv).
TOOLS: dict[str, tuple[str, str]] = {
    "prepare-data": (
        "tokenize text (files, folders, jsonl / parquet, datasets folders) into memory-mapped token shards, on N "
        "processes or as array parts (--merge joins them)",
        "kempnerforge.data.prepare_cli:prepare_main",
    ),
    "generate": (
        "sample from a checkpoint (KV cache; --image / --video for vision-language checkpoints)",
        "kempnerforge.tools.generate:generate_main",
    ),
    "convert": (
        "DCP checkpoint <-> Hugging Face safetensors (dcp-to-hf, hf-to-dcp)",
        "kempnerforge.tools.convert:convert_main",
    ),
    "eval": (
        "perplexity of a checkpoint on its validation split or other text",
        "kempnerforge.tools.evaluate:eval_main",
    ),
    "estimate": (
        "per-rank memory, FLOPs and communication of a recipe on a simulated cluster, before you queue it",
        "kempnerforge.tools.estimate:estimate_main",
    ),
    "check-ckpt": (
        "verify a checkpoint (or a folder of them) against the checksums recorded when it was written (exit 2 if BAD)",
        "kempnerforge.tools.check_ckpt:check_ckpt_main",
    ),
    "lighthouse": (
        "run torchft's lighthouse for replica-group fault tolerance (prints its http://host:port; the ft extra)",
        "kempnerforge.tools.lighthouse:lighthouse_main",
    ),
    "check-env": (
        "check CUDA, NCCL, the SLURM job, the checkpoint folder and logger credentials (exit 2 if MISSING)",
        "kempnerforge.tools.check_env:check_env_main",
    ),
}


def help_text() -> str:
    """``kforge --help``: every command with one line."""
    width = max(map(len, [*LIGHTNING_COMMANDS, *TOOLS])) + 2
    lines = [
        "usage: kforge <command> [options]        kforge <command> --help: the command's options",
        "",
        "kempnerforge: a Lightning trainer for decoder LLMs, MoE and vision-language models on N-D parallel meshes.",
        "",
        "training (LightningCLI; --config recipe.yaml, then --model.* / --data.* / --trainer.* overrides):",
        *(f"  {name:<{width}}{text}" for name, text in LIGHTNING_COMMANDS.items()),
        "",
        "tools:",
        *(f"  {name:<{width}}{text}" for name, (text, _) in TOOLS.items()),
        "",
        "A bad setting or path is refused before anything starts, as one line: kforge: error: <field>: <message>",
        "(exit status 2).",
    ]
    return "\n".join(lines)


def print_help(args: list[str]) -> None:
    """``kforge`` alone or ``kforge --help``: :func:`help_text` on stdout.

    Raises:
        SystemExit: code 2 when no command was given (``kforge`` alone is a usage error).
    """
    print(help_text())
    if not args:
        raise SystemExit(2)


def run_tool(name: str, argv: list[str]) -> None:
    """Import and run tool ``name`` (a key of :data:`TOOLS`) with ``argv``.

    Raises:
        SystemExit: code 2 with one line when the tool is not part of this installation or ends in a user error
            (:func:`~kempnerforge.cli_errors.is_user_error`: a missing or corrupt checkpoint, bad data).
    """
    from kempnerforge.console import filter_tool_warnings  # imports neither torch nor Lightning

    filter_tool_warnings()  # before the tool's imports: torchao's and torch's import-time notices go too
    module_name, func = TOOLS[name][1].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"kforge: error: {name}: this installation has no {module_name}", file=sys.stderr)
        raise SystemExit(2) from err
    try:
        getattr(module, func)(argv)
    except Exception as err:
        from kempnerforge.cli_errors import error_line, is_user_error

        if not is_user_error(err, during_setup=False):
            raise
        # A missing or corrupt checkpoint, bad data: one line, exit 2; the tools call fit's ckpt_path --ckpt.
        line = error_line(err)
        if "--ckpt" in argv and line.startswith("kforge: error: ckpt_path: "):
            line = "kforge: error: --ckpt: " + line.removeprefix("kforge: error: ckpt_path: ")
        field = getattr(err, "field", None)
        if isinstance(field, str) and f"--{field}" in " ".join(argv):  # a library field that is this tool's option
            line = line.replace(f"kforge: error: {field}: ", f"kforge: error: --{field}: ", 1)
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(2) from err


def run_without_lightning(args: list[str]) -> bool:
    """Handle ``args`` if they need no LightningCLI: help (:func:`print_help`) or a tool (:func:`run_tool`).

    Args:
        args: arguments without the program name.

    Returns:
        True when handled (the caller returns), False for a training command (``fit``, ``validate``, ...).

    Raises:
        SystemExit: as :func:`print_help` and :func:`run_tool`.
    """
    if not args or args[0] in ("-h", "--help"):
        print_help(args)
        return True
    if args[0] in TOOLS:
        run_tool(args[0], args[1:])
        return True
    if not args[0].startswith("-") and args[0] not in LIGHTNING_COMMANDS:
        refuse_unknown_command(args[0])
    return False


def refuse_unknown_command(name: str) -> NoReturn:
    """One line naming every command (the tools too; Lightning's parser lists only its own), before any import.

    Raises:
        SystemExit: code 2, always.
    """
    import difflib

    names = [*LIGHTNING_COMMANDS, *TOOLS]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    print(f"kforge: error: {name}: unknown command; {hint}choose one of {', '.join(names)}", file=sys.stderr)
    raise SystemExit(2)
