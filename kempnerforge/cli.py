"""The ``kforge`` command: a LightningCLI for training plus the data tools on the same entry point.

``kforge fit --config configs/debug.yaml`` trains (a recipe whose ``model`` has a ``class_path``,
e.g. ``configs/vlm_jd.yaml``, picks its LightningModule and DataModule by class path); ``kforge fit --help`` documents every
``--model.*``, ``--data.*`` and ``--trainer.*`` argument; ``kforge prepare-data --help`` tokenizes
text into shards. Under ``srun`` Lightning detects ``SLURMEnvironment`` itself.
"""

from __future__ import annotations

import contextvars
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, NoReturn

import jsonargparse
import yaml
from lightning.pytorch import Callback, LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from kempnerforge.callbacks import Preemption
from kempnerforge.cli_errors import HeldLogs, argparse_error_line, exit_with_error, is_user_error, name_this_launch
from kempnerforge.commands import run_without_lightning
from kempnerforge.console import add_default_callbacks, filter_harmless_warnings, filter_resume_warning
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.errors import PathError, UserError
from kempnerforge.exit_status import DIVERGED, SUCCESS
from kempnerforge.module import CausalLM
from kempnerforge.parallel.grad_clip import check_lightning_clipping
from kempnerforge.parallel.precision import trainer_precision_to_param
from kempnerforge.preflight import preflight
from kempnerforge.resilience.auto_resume import AUTO, AutoResume, checkpoint_dir, find_resume_checkpoint
from kempnerforge.resilience.nonfinite import NonFiniteError
from kempnerforge.strategies import KempnerStrategy

#: True once the pre-run checks passed and the Trainer runs: a plain ValueError from then on keeps its traceback.
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("kforge_running", default=False)
#: Lightning's log lines held back until the pre-run checks pass (:class:`~kempnerforge.cli_errors.HeldLogs`).
_HELD: contextvars.ContextVar[HeldLogs | None] = contextvars.ContextVar("kforge_held_logs", default=None)
#: Log folders (TensorBoard / CSV versions) this command will create, until its loop starts: a run refused after the
#: process group started (a resumed checkpoint's global batch) removes them, so exit 2 leaves nothing written.
_NEW_LOG_DIRS: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("kforge_new_log_dirs", default=())
#: Seconds after the pre-run checks that held log lines show even if the loop has not started (a rendezvous waiting
#: for other nodes, a large model's materialization): long enough for a start on one node, short against a hang.
HOLD_AFTER_CHECKS_S = 30.0
#: File in a WandbLogger's ``save_dir`` holding the run id that a resumed run continues.
WANDB_RUN_ID_FILE = "wandb_run_id"


def keep_wandb_run_id(trainer: Any, ckpt_path: str | None, logger_config: Any = None) -> None:
    """Give every ``WandbLogger`` without an explicit ``id`` a run id that survives resume.

    A fresh run (no ``ckpt_path``) gets a new id, written by rank 0 to
    ``<save_dir>/wandb_run_id``; a resumed run (``ckpt_path`` set) reads that file and continues the
    same W&B run (``resume="allow"``), online or offline. W&B takes a run id only at construction
    (``WandbLogger(id=...)``), so such a logger is built again from its config with the id and put in
    its place in ``trainer.loggers``. Runs before the logger's experiment exists (W&B is initialized
    lazily, in the trainer's setup), so no empty run is created.

    Args:
        trainer: the instantiated Trainer.
        ckpt_path: the resolved checkpoint to resume from (None: a fresh run).
        logger_config: the parsed ``trainer.logger`` of the CLI (a ``class_path`` / ``init_args``
            namespace or a list of them, in the order of ``trainer.loggers``). A ``WandbLogger`` without
            one (e.g. passed in from Python) keeps no id across resumes, with a warning.
    """
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - lightning always ships the class; wandb itself is optional
        return
    loggers = list(trainer.loggers)
    configs = logger_config if isinstance(logger_config, list) else [logger_config]
    if len(configs) != len(loggers):
        configs = [None] * len(loggers)
    replaced = False
    for i, (logger, config) in enumerate(zip(loggers, configs, strict=True)):
        if not isinstance(logger, WandbLogger) or logger.version is not None:  # version: the id, once known
            continue
        init_args = getattr(config, "init_args", None)
        if init_args is None or str(getattr(config, "class_path", "")).rsplit(".", 1)[-1] != type(logger).__name__:
            rank_zero_warn(f"{type(logger).__name__} not built from the config: its W&B run id is not kept on resume.")
            continue
        id_file = Path(logger.save_dir or ".") / WANDB_RUN_ID_FILE
        if _resumes(ckpt_path) and id_file.is_file():
            run_id = id_file.read_text().strip()
            rank_zero_info(f"Resuming W&B run {run_id} (from {id_file})")
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B ids: up to 64 characters of [a-z0-9_-]
            rank_zero_only(_write_id)(id_file, run_id)
        kwargs = {**init_args.as_dict(), **dict(getattr(config, "dict_kwargs", None) or {})}
        loggers[i] = type(logger)(**{**kwargs, "id": run_id, "resume": "allow"})
        replaced = True
    if replaced:
        trainer.loggers = loggers


def _resumes(ckpt_path: str | None) -> bool:
    # --ckpt_path auto resumes only when there is a checkpoint (rank 0's pick is cached for the strategy).
    return ckpt_path.choose() is not None if isinstance(ckpt_path, AutoResume) else ckpt_path is not None


def _write_id(path: Path, run_id: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")


class KForgeArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with one-line errors (``kforge: error: <option>: <message>``, exit status 2) instead of
    the usage block, and no abbreviated options (``--model.config.n_layer`` is not ``n_layers``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print one line and exit 2 (parsers that raise instead, jsonargparse's inner ones, keep raising)."""
        if not self.exit_on_error:
            super().error(message, ex)
        print(argparse_error_line(message), file=sys.stderr, flush=True)
        raise SystemExit(2)


class KForgeCLI(LightningCLI):
    """LightningCLI with kempnerforge's defaults and argument links.

    Links ``model.config.vocab_size`` into ``data.vocab_size`` so the data is checked against the
    model's vocabulary before anything is allocated; a W&B logger keeps its run id across resumes.

    Auto-resume: ``--ckpt_path`` defaults to ``auto``, which resumes from the newest complete
    checkpoint in the checkpoint folder (a ``Preemption`` callback's ``dirpath``, else the
    ``ModelCheckpoint``'s) and starts fresh when there is none; ``--ckpt_path null`` forces a fresh start.
    """

    def __init__(self, *args: Any, parser_class: type = KForgeArgumentParser, **kwargs: Any) -> None:
        # What Lightning will parse: `args`, else sys.argv (`args` given by position, after 11 others: build all).
        if "args" in kwargs:
            argv = sys.argv[1:] if kwargs["args"] is None else kwargs["args"]
        else:
            argv = sys.argv[1:] if len(args) <= 2 else None
        self._requested = requested_subcommand(argv)
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override] - Lightning's is a staticmethod
        """Lightning's subcommands, only the one on the command line when it names one (:func:`requested_subcommand`):
        each subcommand's parser holds every Trainer, model and data argument, so building all four parsers made the
        parser build about four times as long as the one that runs needs."""
        every = LightningCLI.subcommands()
        return {self._requested: every[self._requested]} if self._requested in every else every

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link the model's vocabulary size into the data module (``init_args`` paths in subclass mode)."""
        if self.subclass_mode_model:
            parser.link_arguments("model.init_args.config.vocab_size", "data.init_args.vocab_size")
        elif self.subclass_mode_data:
            parser.link_arguments("model.config.vocab_size", "data.init_args.vocab_size")
        else:
            parser.link_arguments("model.config.vocab_size", "data.vocab_size")

    @override
    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        # `ckpt_path` only exists once Lightning added the Trainer method's arguments (after
        # add_arguments_to_parser), so its default is changed here: a private LightningCLI method, no public hook.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "fit":
            parser.set_defaults({"ckpt_path": AUTO})
        return parser

    @override
    def _parse_ckpt_path(self) -> None:
        """Lightning's read of a ``ckpt_path`` file's hyperparameters; a file that is no checkpoint (``--ckpt_path
        README.md``) is one line instead of torch.load's traceback (which advises ``weights_only=False``).

        Raises:
            PathError: ``ckpt_path`` is a file torch.load cannot read as a checkpoint.
        """
        try:
            super()._parse_ckpt_path()
        except Exception as err:  # UnpicklingError, RuntimeError (not a zip), EOFError, ...
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            raise PathError(
                "ckpt_path",
                f"{ckpt_path} is a file that is not a checkpoint; give a checkpoint folder (step=N.ckpt), the folder "
                "holding `latest`, or auto",
            ) from err

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse what the strategy and module would refuse once built, before any class is instantiated and
        before any process starts (:func:`check_trainer_config`).

        Raises:
            SystemExit: code 2, with ``kforge: error: <message>`` on stderr.
        """
        config = self.config[self.subcommand] if self.subcommand else self.config
        try:
            check_trainer_config(config.get("trainer"))
        except ValueError as err:
            print(f"kforge: error: {err}", file=sys.stderr)
            raise SystemExit(2) from err
        apply_init_from_defaults(config, "init_args." if self.subclass_mode_model else "")

    @override
    def instantiate_classes(self) -> None:
        """Lightning's instantiation; a component's own validation error (e.g. ``data.fps=0.0 must be ...``),
        which jsonargparse buries in a union-type report ending in the whole config, is raised alone.

        Raises:
            UserError: the component's message(s), for :func:`main` to print as one line.
        """
        try:
            super().instantiate_classes()
        except ValueError as err:
            reasons = component_errors(str(err))
            if not reasons:
                raise
            from kempnerforge.cli_errors import infer_field

            raise UserError(infer_field(reasons[0]), "; ".join(reasons)) from err

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Lightning's trainer, with kempnerforge's progress bar and model summary unless the configuration
        names its own or disables them (:func:`kempnerforge.console.add_default_callbacks`)."""
        config = self.config_init.get(self.subcommand, self.config_init) if self.subcommand else self.config_init
        add_default_callbacks(config.get("trainer"))
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """Resolve ``--ckpt_path auto`` (the ``fit`` default), keep the W&B run id of the run being resumed
        (:func:`keep_wandb_run_id`), then check paths, mesh and checkpoint folder (:func:`~kempnerforge.preflight.preflight`),
        before ``Trainer.fit`` starts any process."""
        config = self.config_init[self.subcommand]
        resolve_auto_ckpt_path(config, self.trainer)
        if rank_zero_only.rank == 0 and _resumes(config.get("ckpt_path")):
            filter_resume_warning()  # ModelCheckpoint's "directory exists and is not empty": the resumed run's
        keep_wandb_run_id(self.trainer, config.get("ckpt_path"), self.config[self.subcommand]["trainer"]["logger"])
        self._preflight()

    def before_validate(self) -> None:
        """:func:`~kempnerforge.preflight.preflight` before ``Trainer.validate``."""
        self._preflight()

    def before_test(self) -> None:
        """:func:`~kempnerforge.preflight.preflight` before ``Trainer.test``."""
        self._preflight()

    def before_predict(self) -> None:
        """:func:`~kempnerforge.preflight.preflight` before ``Trainer.predict``."""
        self._preflight()

    def _preflight(self) -> None:
        config = self.config_init[self.subcommand]
        precision = self.config[self.subcommand]["trainer"].get("precision")
        preflight(self.trainer, self.model, self.datamodule, config.get("ckpt_path"), self.subcommand, precision)
        _RUNNING.set(True)
        held = _HELD.get()
        _NEW_LOG_DIRS.set(tuple(new_log_dirs(self.trainer)))
        if held is not None:  # shown when the loop starts: a check that needs the process group refuses in one line
            held.release_after(HOLD_AFTER_CHECKS_S)
            self.trainer.callbacks.append(ShowHeldLogs(held))


def new_log_dirs(trainer: Any) -> list[Path]:
    """The local log folders of ``trainer``'s loggers (``log_dir``: TensorBoard, CSV) that do not exist yet, each as
    its outermost missing folder (``runs/`` of ``runs/debug/version_0`` in a fresh directory): what this run will
    create (resolving the version now fixes the one the run then uses)."""
    found = []
    for logger in getattr(trainer, "loggers", []):
        log_dir = getattr(logger, "log_dir", None)
        if not isinstance(log_dir, str) or "://" in log_dir or Path(log_dir).exists():
            continue
        top = Path(log_dir).absolute()
        while not top.parent.exists():
            top = top.parent
        found.append(top)
    return found


def remove_new_log_dirs() -> None:
    """Remove the log folders :func:`new_log_dirs` found, when the run is refused before its loop started (only
    TensorBoard's events, ``config.yaml`` and ``hparams.yaml`` are in them then)."""
    for path in _NEW_LOG_DIRS.get():
        shutil.rmtree(path, ignore_errors=True)
    _NEW_LOG_DIRS.set(())


class ShowHeldLogs(Callback):
    """Prints the log lines :class:`~kempnerforge.cli_errors.HeldLogs` kept back (the distributed banner, the model
    summary) when the loop starts, after the checks that need the process group (the restored checkpoint's global
    batch and checksums) have passed. Internal to ``kforge``; holds no state."""

    def __init__(self, held: HeldLogs) -> None:
        self.held = held

    def _started(self) -> None:
        self.held.show()
        _NEW_LOG_DIRS.set(())  # the loop ran: its logs are the run's

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._started()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._started()  # validate; in fit, the sanity check runs before on_train_start

    @override
    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._started()

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._started()


def requested_subcommand(args: Any) -> str | None:
    """The Lightning subcommand a command line starts with (``fit`` for ``fit --config ...``); None when it starts
    otherwise (``--print_config``, a main-level ``--config`` first) or ``args`` is a parsed config (dict, Namespace),
    and then every subcommand's parser is built, as Lightning does."""
    if not isinstance(args, (list, tuple)) or not args or not isinstance(args[0], str):
        return None
    return args[0] if args[0] in LightningCLI.subcommands() else None


def apply_init_from_defaults(config: Any, prefix: str = "") -> None:
    """With ``model.init_from`` (a Hugging Face folder), the data follows the checkpoint: ``data.vocab_size`` is
    the folder's vocabulary (the parse-time link copied ``model.config.vocab_size``, which the folder overrides) and an
    unset ``data.tokenizer`` is the folder itself, when the data module tokenizes (it has no ``source`` field, or
    ``data.source`` is set). An explicit ``data.tokenizer`` is kept: a tokenizer with the same ids (e.g. with a chat
    template added); the data's vocabulary check still refuses ids beyond the checkpoint's.

    Raises:
        UserError: ``model.init_from`` missing, without ``config.json``, or unsupported
            (:func:`~kempnerforge.checkpoint.init_from.model_config_from_folder`).
    """
    init_from = config.get(f"model.{prefix}init_from")
    if not init_from:
        return
    from kempnerforge.checkpoint.init_from import read_hf_config

    hf_config = read_hf_config(init_from)
    data = f"data.{'init_args.' if prefix or config.get('data.init_args') is not None else ''}"
    if config.get(f"{data}vocab_size", False) is not False and getattr(hf_config, "vocab_size", None):
        config[f"{data}vocab_size"] = int(hf_config.vocab_size)
    tokenizes = config.get(f"{data}source", False) is False or config.get(f"{data}source") is not None
    if config.get(f"{data}tokenizer", False) is None and tokenizes:
        config[f"{data}tokenizer"] = str(init_from)


def check_trainer_config(trainer: Any) -> None:
    """The Trainer settings kempnerforge refuses, checked on the parsed config.

    ``trainer.gradient_clip_val`` (the modules clip themselves: ``model.grad_clip``) for any strategy, and with
    ``KempnerStrategy`` (or a subclass) a ``trainer.precision`` that does not map onto its
    ``mixed_precision_param`` (:func:`kempnerforge.parallel.precision.trainer_precision_to_param`).

    Raises:
        ValueError: one line naming the field and what to set instead.
    """
    if trainer is None:
        return
    check_trainer_counts(trainer)
    check_lightning_clipping(trainer.get("gradient_clip_val"))
    strategy = trainer.get("strategy")
    class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
    if not isinstance(class_path, str) or not _is_kempner_strategy(class_path):
        return
    init_args = strategy.get("init_args") or {}
    trainer_precision_to_param(trainer.get("precision") or "32-true", init_args.get("mixed_precision_param", "auto"))


def check_trainer_counts(trainer: Any) -> None:
    """``trainer.max_steps``, ``trainer.devices`` and ``trainer.accumulate_grad_batches`` as Lightning accepts them,
    checked before the Trainer exists (Lightning raises a traceback for the first two, and divides by zero at the
    first step for the third).

    Raises:
        ValueError: ``trainer.<field>: <what is allowed>``.
    """
    max_steps = trainer.get("max_steps")
    if isinstance(max_steps, int) and max_steps < -1:
        raise ValueError(f"trainer.max_steps: {max_steps} is not allowed; give a step count >= 0, or -1 (no limit)")
    accumulate = trainer.get("accumulate_grad_batches")
    if isinstance(accumulate, int) and accumulate < 1:
        raise ValueError(f"trainer.accumulate_grad_batches: {accumulate} is not allowed; give an integer >= 1")
    devices = trainer.get("devices")
    count = devices if isinstance(devices, int) else int(devices) if str(devices).lstrip("-").isdigit() else None
    if count is not None and (count == 0 or count < -1):
        raise ValueError(
            f"trainer.devices: {devices} is not allowed; give a device count >= 1, -1 (every device), 'auto' or a list "
            "of device indices"
        )


def _is_kempner_strategy(class_path: str) -> bool:
    from kempnerforge.strategies import KempnerStrategy

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):
        return False  # jsonargparse reports a class it cannot import itself
    return isinstance(cls, type) and issubclass(cls, KempnerStrategy)


def component_errors(report: str) -> list[str]:
    """The messages a class raised inside jsonargparse's "Does not validate against any of the Union subtypes"
    report (an optional ``model`` / ``data`` is ``Union[cls, None]``), without the ``Expected a NoneType`` line;
    empty for any other error text."""
    if "Does not validate against any of the Union subtypes" not in report or "\nErrors:\n" not in report:
        return []
    block = report.split("\nErrors:\n", 1)[1].split("\nGiven value", 1)[0]
    lines = [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("- ")]
    # "Expected a <class 'NoneType'>" / "<class 'str'>": the other members of the union, not what the class said.
    return [line for line in lines if not re.match(r"Expected a <class '(NoneType|str)'>", line)]


def resolve_auto_ckpt_path(config: Any, trainer: Any) -> None:
    """Replace ``ckpt_path == "auto"`` in a subcommand's config by what resumes from the checkpoint folder.

    With ``KempnerStrategy``: an :class:`~kempnerforge.resilience.auto_resume.AutoResume` of the folder, which
    the strategy resolves on global rank 0 once the process group exists and broadcasts (this runs before
    there is one). With any other strategy: this process's own pick, the newest complete checkpoint or None.
    """
    if str(config.get("ckpt_path")) != AUTO:
        return
    preemption = [cb for cb in trainer.callbacks if isinstance(cb, Preemption) and cb.dirpath is not None]
    folder = checkpoint_dir(trainer, preemption[0].dirpath if preemption else None)
    if isinstance(trainer.strategy, KempnerStrategy):
        config["ckpt_path"] = AutoResume(folder)
        return
    found = find_resume_checkpoint(folder)
    if found is None:
        rank_zero_info(f"Auto-resume: no complete checkpoint in {folder}; starting fresh.")
    else:
        rank_zero_info(f"Auto-resume: resuming from {found}.")
    config["ckpt_path"] = str(found) if found is not None else None


def _config_paths(args: list[str]) -> list[str]:
    paths = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    return paths + [a.split("=", 1)[1] for a in args if a.startswith("--config=")]


def uses_class_paths(args: list[str], section: str = "model") -> bool:
    """True when the recipe names its LightningModule by ``class_path`` (``model: {class_path: ...}``,
    as the VLM recipes do) in a ``--config`` file or on the command line; ``section="data"``: its data module
    (``data: {class_path: ...ChatDataModule}``).

    Raises:
        PathError: a ``--config`` file that does not exist.
        UserError: a ``--config`` file that is not YAML.
    """
    if any(a.startswith((f"--{section}.class_path", f"--{section}=")) for a in args):
        return True
    for path in _config_paths(args):
        if not Path(path).is_file():
            raise PathError("--config", f"{path} does not exist (a recipe YAML, e.g. configs/debug.yaml)")
        try:
            with open(path) as f:
                config = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise UserError("--config", f"{path} is not valid YAML: {' '.join(str(err).split())}") from err
        if isinstance(config, dict) and isinstance(config.get(section), dict) and "class_path" in config[section]:
            return True
    return False


def check_data_blocks(args: list[str]) -> None:
    """With a data module named by ``class_path``, no ``--config`` file before the one that names it may hold a
    plain ``data:`` block (the ``TokenDataModule`` arguments of a text recipe such as
    ``configs/finetune_debug.yaml``): jsonargparse cannot tell which class it belongs to, and merging it into the
    named module would carry over fields it never meant (a text ``data.source`` read as chat records). A plain
    block after it (``data: {seq_len: 256}`` overriding a chat recipe) sets that module's arguments, as usual.

    Raises:
        UserError: ``--config``, naming the file with the plain block and the one that names the class.
    """
    plain, named = None, None
    for path in _config_paths(args):
        with open(path) as f:
            data = (yaml.safe_load(f) or {}).get("data")
        if isinstance(data, dict) and "class_path" in data:
            named = named or f"{path} ({data['class_path']})"
        elif isinstance(data, dict) and named is None:
            plain = plain or path
    if plain is not None:
        by = named or "--data.class_path"
        raise UserError(
            "--config",
            f"{plain} has a plain data: block (TokenDataModule arguments) and {by} names another data module; "
            f"allowed: one data: block per run: copy {plain} and replace its data: block",
        )


def cli_classes(args: list[str]) -> dict[str, Any]:
    """LightningCLI class arguments for ``args``: ``CausalLM`` + ``TokenDataModule`` for plain recipes,
    or subclass mode (any ``CausalLM`` subclass such as ``VisionLanguage``, any LightningDataModule,
    both chosen by ``class_path``) when :func:`uses_class_paths`; a plain ``CausalLM`` with any LightningDataModule
    (``data: {class_path: ...}``, e.g. ``ChatDataModule``) when only the data module is named so."""
    if uses_class_paths(args):
        return {
            "model_class": CausalLM,
            "datamodule_class": LightningDataModule,
            "subclass_mode_model": True,
            "subclass_mode_data": True,
        }
    if uses_class_paths(args, "data"):  # a plain CausalLM with another data module (chat data, mixtures)
        check_data_blocks(args)
        return {"model_class": CausalLM, "datamodule_class": LightningDataModule, "subclass_mode_data": True}
    return {"model_class": CausalLM, "datamodule_class": TokenDataModule}


def shows_help_text(args: list[str]) -> bool:
    """Whether ``args`` print argument descriptions: ``-h`` / ``--help``, or a class help in subclass mode
    such as ``--model.help VisionLanguage`` (``--print_config`` writes no descriptions)."""
    return any(a in ("-h", "--help") or a.split("=")[0].endswith(".help") for a in args)


def main(argv: list[str] | None = None) -> None:
    """``kforge`` with the training commands (the console script is :func:`kempnerforge.entry.main`, which
    comes here for them); tools are dispatched through :data:`~kempnerforge.commands.TOOLS`.

    A user error (:func:`~kempnerforge.cli_errors.is_user_error`) ends the process with one line on stderr,
    ``kforge: error: <field>: <message>``, and exit status 2; a diverged run (NaNGuard) one line and status 3; a
    run stopped by a signal status 75 (76: requeued), see :mod:`kempnerforge.exit_status`; any other exception
    keeps its traceback (status 1).

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).
    """
    args = sys.argv[1:] if argv is None else argv
    filter_harmless_warnings()  # known-harmless third-party warnings, by exact message (kempnerforge.console)
    # Per-field docstrings of the config dataclasses become the `--help` text of each argument. Reading them
    # tokenizes the source of every class in every subcommand's signature (the Trainer's too): 5-10 s of CPU
    # per process, each rank of a multi-process run included, so only when the text is shown.
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=shows_help_text(args))
    if run_without_lightning(args):
        return
    name_this_launch()  # its ranks say an error they share once (cli_errors.said_by_another_rank)
    token, held = _RUNNING.set(False), HeldLogs().hold()
    held_token = _HELD.set(held)
    try:
        cli = _run_cli(args, argv)
    except NonFiniteError as err:  # NaNGuard: the run diverged; one line, the status a script can tell apart
        held.drop()
        print(f"kforge: {err}", file=sys.stderr, flush=True)
        raise SystemExit(DIVERGED) from None
    except Exception as err:
        if is_user_error(err, during_setup=not _RUNNING.get()):
            held.drop()
            remove_new_log_dirs()
            exit_with_error(err)
        raise
    finally:
        held.show()  # whatever is still held (an error that keeps its traceback, a --help exit)
        _RUNNING.reset(token)
        _HELD.reset(held_token)
    status = run_exit_status(cli.trainer)
    line = already_complete_line(cli.trainer)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    if status != SUCCESS:
        raise SystemExit(status)


def already_complete_line(trainer: Any) -> str | None:
    """The line for a ``fit`` that resumed a checkpoint already at ``trainer.max_steps`` and trained nothing (global
    rank 0; None otherwise): which checkpoint, and how to train further without changing the LR curve."""
    restored = getattr(getattr(trainer, "strategy", None), "restored", None)
    if restored is None or getattr(trainer, "global_rank", 0) != 0:
        return None
    path, step = restored
    max_steps = getattr(trainer, "max_steps", -1)
    if step is None or max_steps is None or max_steps < 0 or step < max_steps or trainer.global_step != step:
        return None
    return (
        f"kforge: the run is already complete: {path} is at step {step} and trainer.max_steps={max_steps}, so "
        f"nothing was trained. To train further, raise --trainer.max_steps and keep the LR schedule with "
        f"--model.scheduler.total_steps={step} (later steps stay at its final LR), or start fresh with "
        "--ckpt_path null."
    )


def run_exit_status(trainer: Any) -> int:
    """The exit status of a finished ``kforge fit`` / ``validate`` (:mod:`kempnerforge.exit_status`): ``STOPPED_EARLY``
    or ``REQUEUED`` when a signal stopped it (:class:`~kempnerforge.callbacks.Preemption`), else ``SUCCESS``."""
    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, Preemption) and cb.stop_status is not None:
            return cb.stop_status
    return SUCCESS


def make_cli(args: list[str], from_argv: bool = False, run: bool = True) -> KForgeCLI:
    """The ``KForgeCLI`` that ``kforge <subcommand> *args`` runs; with ``run=False``, ``args`` are a ``fit``
    command line without the subcommand and only the Trainer, LightningModule and DataModule are built
    (``kforge estimate`` builds exactly what ``kforge fit`` would, this way).

    Args:
        args: the command line after the program name.
        from_argv: let Lightning read ``sys.argv`` itself (the console script; no "args and argv" warning).
        run: run the subcommand (False: parse and instantiate only).
    """
    return KForgeCLI(
        **cli_classes(args),
        args=None if from_argv else args,
        run=run,
        trainer_defaults={"precision": "32-true"},
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,  # the module builds AdamW + schedule from --model.optimizer/scheduler
        parser_kwargs={"description": "kempnerforge: Lightning trainer for decoder LLMs on N-D parallel meshes."},
    )


def _run_cli(args: list[str], argv: list[str] | None) -> KForgeCLI:
    try:
        # None: Lightning reads sys.argv itself (no "args and argv" warning)
        return make_cli(args, from_argv=argv is None or args == sys.argv[1:])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            _HELD.get().drop()  # a parse error: its one line is printed; the held lines would only follow it
        raise


if __name__ == "__main__":
    main()
