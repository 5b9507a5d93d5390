"""The ``kforge`` command: a LightningCLI for training plus the data tools on the same entry point.

``kforge fit --config configs/debug.yaml`` trains; ``kforge fit --help`` documents every
``--model.*``, ``--data.*`` and ``--trainer.*`` argument; ``kforge prepare-data --help`` tokenizes
text into shards. Under ``srun`` Lightning detects ``SLURMEnvironment`` itself.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import jsonargparse
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.module import CausalLM

#: Tools that are not Lightning subcommands, dispatched before LightningCLI parses ``argv``.
TOOLS = ("prepare-data",)

#: File in a WandbLogger's ``save_dir`` holding the run id that a resumed run continues.
WANDB_RUN_ID_FILE = "wandb_run_id"


def keep_wandb_run_id(trainer: Any, ckpt_path: str | None) -> None:
    """Give every ``WandbLogger`` without an explicit ``id`` a run id that survives resume.

    A fresh run (no ``ckpt_path``) gets a new id, written by rank 0 to
    ``<save_dir>/wandb_run_id``; a resumed run (``ckpt_path`` set) reads that file and continues the
    same W&B run (``resume="allow"``), online or offline. Runs before the logger's experiment exists
    (W&B is initialized lazily, in the trainer's setup), so no empty run is created.
    """
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - lightning always ships the class; wandb itself is optional
        return
    for logger in trainer.loggers:
        if not isinstance(logger, WandbLogger) or logger._id is not None or logger._experiment is not None:
            continue
        id_file = Path(logger.save_dir or ".") / WANDB_RUN_ID_FILE
        if ckpt_path is not None and id_file.is_file():
            run_id = id_file.read_text().strip()
            rank_zero_info(f"Resuming W&B run {run_id} (from {id_file})")
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B ids: up to 64 characters of [a-z0-9_-]
            rank_zero_only(_write_id)(id_file, run_id)
        logger._id = run_id
        logger._wandb_init.update(id=run_id, resume="allow")


def _write_id(path: Path, run_id: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")


class KForgeCLI(LightningCLI):
    """LightningCLI with kempnerforge's defaults and argument links.

    Links ``model.config.vocab_size`` into ``data.vocab_size`` so the data is checked against the
    model's vocabulary before anything is allocated; a W&B logger keeps its run id across resumes.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link the model's vocabulary size into the data module."""
        parser.link_arguments("model.config.vocab_size", "data.vocab_size")

    def before_fit(self) -> None:
        """Keep the W&B run id across resumes (:func:`keep_wandb_run_id`)."""
        keep_wandb_run_id(self.trainer, self.config_init["fit"].get("ckpt_path"))


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
