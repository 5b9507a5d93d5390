"""The generated configuration reference: every field a recipe or a ``--a.b.c=`` override can set, with its type,
default and help, read from the parsers ``kforge fit`` builds (their help is the config classes' docstrings)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from fields import fields, markdown_help, table
from parsers import class_parser, fit_parser

INTRO = """# Configuration reference

Generated from the parsers `kforge fit` builds (`scripts/docs/config_reference.py`): the help of each field is the
docstring of the dataclass field or constructor argument it sets, the default is the code's. A recipe's YAML sets the
same fields by their dotted path (`model.config.dim: 128` is `--model.config.dim=128`); a recipe's own value wins over
the default shown here.

Text recipes (`configs/debug.yaml`, `llama3_8b.yaml`, ...) build `CausalLM` and `TokenDataModule` directly, so their
fields are `--model.*` and `--data.*`. A recipe whose `model:` or `data:` names a `class_path` (the VLM recipes, chat
data) sets that class's constructor arguments under `init_args` (`--model.init_args.vlm.arch`,
`--data.init_args.packing`). Classes named by `class_path` elsewhere (the strategy, callbacks, loggers) take theirs
the same way.
"""


def _section(title: str, parser, under: str, note: str = "") -> list[str]:
    rows = fields(parser, under)
    return [f"## {title}", "", *([note, ""] if note else []), table(rows), ""] if rows else []


def _class_section(cls: type, prefix: str, level: str = "##") -> list[str]:
    doc = markdown_help((inspect.getdoc(cls) or "").split("\n\n")[0])
    path = f"{cls.__module__}.{cls.__qualname__}"
    parser = class_parser(cls, prefix)
    return [f"{level} `{cls.__qualname__}`", "", f"`class_path: {path}`. {doc}", "",
            table(fields(parser, prefix + ".")), ""]  # fmt: skip


def _data_modules() -> list[type]:
    """Every concrete LightningDataModule of ``kempnerforge.data`` but ``TokenDataModule`` (the text recipes')."""
    import lightning.pytorch as pl

    import kempnerforge.data as data_pkg
    from kempnerforge.data.datamodule import TokenDataModule

    found = {}
    for info in pkgutil.iter_modules(data_pkg.__path__):
        module = importlib.import_module(f"kempnerforge.data.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, pl.LightningDataModule) and cls.__module__ == module.__name__
                    and not inspect.isabstract(cls) and cls is not TokenDataModule):  # fmt: skip
                found[cls.__qualname__] = cls
    return [found[name] for name in sorted(found)]


def config_markdown() -> str:
    """The page ``reference/config.md``."""
    import kempnerforge.callbacks as callbacks
    from kempnerforge.module import VisionLanguage
    from kempnerforge.strategies import KempnerStrategy

    fit = fit_parser("fit")
    out = [INTRO]
    out += _section("Model: `model.config` (the decoder's shape)", fit, "model.config.")
    out += _section("Model: `model.optimizer`", fit, "model.optimizer.")
    out += _section("Model: `model.scheduler`", fit, "model.scheduler.")
    model_own = [f for f in fields(fit, "model.") if f.name.count(".") == 1]
    out += ["## Model: `CausalLM` arguments", "", table(model_own), ""]
    out += _section("Data: `TokenDataModule` (text recipes)", fit, "data.")
    out += ["## Strategy: `trainer.strategy.init_args`", ""]
    out += _class_section(KempnerStrategy, "trainer.strategy.init_args", "###")
    out += _section(
        "Trainer: `trainer.*` (Lightning's `Trainer`)",
        fit,
        "trainer.",
        "Lightning's own arguments; kempnerforge refuses `trainer.gradient_clip_val` and the precisions listed under "
        "[Precision](../how-to/precision.md).",
    )
    out += ["## Vision-language: `model.init_args` (`class_path: kempnerforge.module.VisionLanguage`)", ""]
    out += _class_section(VisionLanguage, "model.init_args", "###")
    out += ["## Other data modules: `data.init_args`", ""]
    for cls in _data_modules():
        out += _class_section(cls, "data.init_args", "###")
    out += ["## Callbacks: `trainer.callbacks[*].init_args`", ""]
    for name in callbacks.__all__:
        out += _class_section(getattr(callbacks, name), "init_args", "###")
    return "\n".join(out)
