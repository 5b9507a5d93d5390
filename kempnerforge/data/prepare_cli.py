"""``kforge prepare-data``: every :func:`~kempnerforge.data.prepare.prepare_data` argument as ``--name``, and
``--merge DIR...`` to join the folders of array parts.

Built with jsonargparse, so ``--help`` shows each argument's docstring and ``--config`` accepts a YAML file. A bad
argument or input is one line, ``kforge: error: --<argument>: <message>`` (exit 2).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from kempnerforge.data.prepare import prepare_data

_ARGS = (
    "source|tokenizer|output_dir|text_field|shard_size|batch_size|text_chunk_chars|num_proc|num_workers|num_shards|"
    "shard_index|shard_bytes|merge"
)


def _parser(prog: str, description: str) -> Any:
    from jsonargparse import ArgumentParser

    from kempnerforge.cli_errors import argparse_error_line

    class Parser(ArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            if not self.exit_on_error:  # jsonargparse's inner parsers raise instead
                super().error(message, ex)
            line = argparse_error_line(message)  # options are --name here ("format: ..." -> "--format: ...")
            prefix = "kforge: error: "
            if line.startswith(prefix) and not line.startswith(f"{prefix}-") and not line.startswith(f"{prefix}arg"):
                line = f"{prefix}--{line.removeprefix(prefix)}"
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(2)

    return Parser(prog=prog, description=description, allow_abbrev=False)


def prepare_main(argv: list[str] | None = None) -> None:
    """CLI for ``kforge prepare-data``; prints a one-line summary when done.

    ``kforge prepare-data --merge DIR [DIR ...] [--output_dir OUT]`` joins the parts of one preparation instead
    (:func:`~kempnerforge.data.prepare_merge.merge_prepared`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--merge" in argv or any(a.startswith("--merge=") for a in argv):
        _merge_main(argv)
        return
    from jsonargparse import ActionConfigFile

    parser = _parser("kforge prepare-data", prepare_data.__doc__.split("\n\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of the arguments below.")
    parser.add_function_arguments(prepare_data, as_group=False)
    parser.epilog = (
        "Array parts: kforge prepare-data ... --num_shards S --shard_index I (one per task), then "
        "kforge prepare-data --merge DIR [DIR ...] [--output_dir OUT] when they wrote separate folders."
    )
    cfg = parser.parse_args(argv).as_dict()
    cfg.pop("config", None)
    meta = _run(lambda: _checked_prepare(cfg))
    _summary(meta, cfg["output_dir"])


def _checked_prepare(cfg: dict[str, Any]) -> dict[str, Any]:
    from kempnerforge.data.input_checks import check_source, check_tokenizer, check_writable

    if isinstance(cfg.get("source"), str):  # before the tokenizer loads: nothing to read is named first
        check_source(cfg["source"], "source")
    check_tokenizer(cfg["tokenizer"], "tokenizer")
    check_writable(cfg["output_dir"], "output_dir")
    if cfg.get("format") == "chat":  # every record first (one JSON pass): a bad line is one line, no progress bar
        from kempnerforge.data.chat_prepare import check_chat_source

        check_chat_source(cfg["source"], cfg["tokenizer"], cfg["messages_field"])
    return prepare_data(**cfg)


def _merge_main(argv: list[str]) -> None:
    from kempnerforge.data.prepare_merge import merge_prepared

    parser = _parser(
        "kforge prepare-data",
        "Join the folders written by the array parts of one preparation (--num_shards / --shard_index) into one "
        "folder: shard files are hard-linked (symbolic links across filesystems), never copied; metadata.json last.",
    )
    parser.add_argument("--merge", nargs="+", required=True, help="the parts' output folders, in any order")
    parser.add_argument("--output_dir", default=None, help="folder to join them in (default: the only --merge folder)")
    parser.add_argument("--overwrite", type=bool, default=False, help="replace another preparation in --output_dir")
    cfg = parser.parse_args(argv)
    meta = _run(lambda: merge_prepared(cfg.merge, cfg.output_dir, cfg.overwrite))
    _summary(meta, cfg.output_dir or cfg.merge[0])


def _run(call: Any) -> dict[str, Any]:
    """``call()``, with a user error printed as one line naming the option (exit 2)."""
    from kempnerforge.errors import UserError

    try:
        return call()
    except UserError as err:  # chat data and paths name their argument (source, tokenizer, ...)
        print(f"kforge: error: --{err.field}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err
    except RuntimeError as err:  # a worker died: the command can be run again as it is
        print(f"kforge: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        raise SystemExit(1) from err
    except (FileNotFoundError, FileExistsError, NotADirectoryError, KeyError, TypeError, ValueError) as err:
        # prepare_data's messages about an argument start with its name: one line naming the option, exit 2.
        message = " ".join(str(err.args[0] if isinstance(err, KeyError) and err.args else err).split())
        arg = re.match(rf"({_ARGS})\b", message)
        if arg is None:
            raise
        message = message.removeprefix(f"{arg.group(1)}: ")  # "source: '/x' does not exist": named once
        print(f"kforge: error: --{arg.group(1)}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err


def _summary(meta: dict[str, Any], output_dir: str) -> None:
    out = Path(output_dir).resolve()
    if "part" in meta:
        print(
            f"part {meta['part']} of {meta['num_parts']}: {meta['num_tokens']:,} tokens in {len(meta['shards'])} shards "
            f"to {out}; {meta['finished']} of {meta['num_shards_total']} shards finished there. When every part has "
            f"finished: kforge prepare-data --merge {out} (or the parts' folders and --output_dir)"
        )
        return
    if meta.get("format") == "chat":
        print(
            f"wrote {meta['num_tokens']:,} tokens ({meta['num_conversations']:,} conversations, "
            f"{meta['num_target_tokens']:,} assistant tokens, {len(meta['shards'])} shards, {meta['dtype']}) to {out}"
        )
        return
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['num_documents']:,} documents, {len(meta['shards'])} shards, "
        f"{meta['dtype']}) to {out}"
    )
    if meta.get("num_records_without_text_field"):
        print(
            f"kforge: warning: --text_field: {meta['num_records_without_text_field']:,} records have no "
            f"{meta['text_field']!r} and were skipped",
            file=sys.stderr,
            flush=True,
        )
