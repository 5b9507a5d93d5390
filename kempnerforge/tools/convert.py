"""``kforge convert``: DCP checkpoint <-> Hugging Face ``transformers`` directory.

    kforge convert dcp-to-hf --ckpt checkpoints/debug --output_dir hf/debug [--dtype bfloat16] [--max_shard_size 2GB]
    kforge convert hf-to-dcp --hf_dir hf/debug --output_dir imported/debug
    kforge fit --config configs/debug.yaml --config imported/debug/model.yaml --ckpt_path imported/debug

See :mod:`kempnerforge.checkpoint.convert` for what is supported and what is refused.
"""

from __future__ import annotations

import argparse
import sys

from kempnerforge.cli_errors import ToolArgumentParser

#: The names of :data:`kempnerforge.checkpoint.convert.DTYPES`, which imports torch and Lightning: `--help` and
#: argument errors answer without them (a unit test keeps the two equal).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``kforge convert`` (two subcommands)."""
    p = ToolArgumentParser(prog="kforge convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="direction", required=True)
    out = sub.add_parser("dcp-to-hf", help="checkpoint -> transformers directory (safetensors)")
    out.add_argument("--ckpt", required=True, help="checkpoint directory, or the folder holding `latest`")
    out.add_argument("--output_dir", required=True)
    out.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weight dtype written")
    out.add_argument("--max_shard_size", default="5GB", help="split safetensors files above this size")
    out.add_argument("--tokenizer", default=None, help="tokenizer dir to copy (default: the one recorded)")
    out.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir (the whole folder)")
    inp = sub.add_parser("hf-to-dcp", help="transformers directory -> weights-only DCP checkpoint")
    inp.add_argument("--hf_dir", required=True, help="local transformers model directory")
    inp.add_argument("--output_dir", required=True)
    return p


def convert_main(argv: list[str] | None = None) -> None:
    """Entry point of ``kforge convert``; prints where the result is."""
    args = build_parser().parse_args(argv)
    from kempnerforge.checkpoint.convert import dcp_to_hf, hf_to_dcp

    if args.direction == "dcp-to-hf":
        try:
            out = dcp_to_hf(args.ckpt, args.output_dir, args.dtype, args.max_shard_size, args.tokenizer,
                            overwrite=args.overwrite)  # fmt: skip
        except FileExistsError as err:  # a file, or a folder that holds something, without --overwrite
            print(f"kforge: error: --output_dir: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err
        except FileNotFoundError as err:  # --tokenizer is no folder
            print(f"kforge: error: --tokenizer: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err
        print(f"wrote transformers directory {out.resolve()}")
    else:
        try:
            out = hf_to_dcp(args.hf_dir, args.output_dir)
        except FileExistsError as err:  # the output folder already holds checkpoints
            print(f"kforge: error: --output_dir: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err
        except (ValueError, KeyError) as err:  # the folder, its config or its weights: one line naming --hf_dir
            message = " ".join(str(err.args[0] if err.args else err).split())
            if not message.startswith(str(args.hf_dir)):  # a config-level refusal: say which folder
                message = f"{args.hf_dir}: {message}"
            print(f"kforge: error: --hf_dir: {message}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err
        print(f"wrote checkpoint {out.resolve()}; train from it with --config {out.parent / 'model.yaml'} "
              f"--ckpt_path {out.parent}")  # fmt: skip
