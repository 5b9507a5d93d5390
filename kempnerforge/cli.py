"""The ``kforge`` command: a LightningCLI for training plus the data tools on the same entry point.

``kforge fit --config configs/debug.yaml`` trains; ``kforge fit --help`` documents every
``--model.*``, ``--data.*`` and ``--trainer.*`` argument; ``kforge prepare-data --help`` tokenizes
text into shards. Under ``srun`` Lightning detects ``SLURMEnvironment`` itself.
"""

from __future__ import annotations

import sys

import jsonargparse
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM

#: Tools that are not Lightning subcommands, dispatched before LightningCLI parses ``argv``.
TOOLS = ("prepare-data",)


class KForgeCLI(LightningCLI):
    """LightningCLI with kempnerforge's defaults and argument links.

    Links ``model.config.vocab_size`` into ``data.vocab_size`` so the data is checked against the
    model's vocabulary before anything is allocated.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link the model's vocabulary size into the data module."""
        parser.link_arguments("model.config.vocab_size", "data.vocab_size")


def _run_tool(name: str, argv: list[str]) -> None:
    if name == "prepare-data":
        from kempnerforge.data.prepare import prepare_main

        prepare_main(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kforge`` console script.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).
    """
    args = sys.argv[1:] if argv is None else argv
    # Per-field docstrings of the config dataclasses become the `--help` text of each argument.
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    if args and args[0] in TOOLS:
        _run_tool(args[0], args[1:])
        return
    KForgeCLI(
        CausalLM,
        TokenDataModule,
        args=args,
        trainer_defaults={"precision": "32-true"},
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the module builds AdamW + schedule from --model.optimizer/scheduler
        parser_kwargs={"description": "kempnerforge: Lightning trainer for decoder LLMs on N-D parallel meshes."},
    )


if __name__ == "__main__":
    main()
