"""How ``kforge`` turns a user error into one line: ``kforge: error: <field>: <message>`` on stderr, exit status 2.

What counts as a user error:

- :class:`~kempnerforge.errors.UserError` (it carries its field) and the library's typed errors that only ever
  describe input (:data:`USER_ERROR_TYPES`, matched by class name so this module imports nothing heavy),
  wherever they are raised;
- a ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` raised while the command line is parsed, the
  classes are instantiated or the run is checked before any process group exists (the config's own
  validation: ``ModelConfig.n_heads=3 ...``), and jsonargparse's own parse errors.

Anything else (an error inside training, a bug) keeps its traceback. For errors that do not carry a field,
:func:`infer_field` reads it from the message: a dotted path (``data.seq_len``), a config class attribute
(``ModelConfig.dim`` -> ``model.config.dim``) or a strategy degree (``tp=3`` -> ``trainer.strategy.init_args.tp``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
import zlib
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

#: Typed errors of the library that only describe the user's input (class names, any module).
USER_ERROR_TYPES = frozenset(
    {
        "MeshConfigError",
        "Float8ConfigError",
        "CheckpointError",
        "CorruptCheckpointError",
        "DataParallelMismatchError",
        "TokenDataError",
        "ImageDataError",
        "VideoDataError",
        "AllClipsFailedError",
    }
)
#: Exception types that are user errors when raised while parsing / instantiating / checking the config.
SETUP_ERROR_TYPES = (ValueError, TypeError, FileNotFoundError, NotADirectoryError)

#: Config classes whose messages name ``Class.field``, and where their fields live on the command line.
_CLASS_FIELDS = {
    "ModelConfig": "model.config",
    "OptimizerConfig": "model.optimizer",
    "SchedulerConfig": "model.scheduler",
    "VisionEncoderConfig": "model.encoder",
    "ConnectorConfig": "model.connector",
    "VLMConfig": "model.vlm",
    "FreezeSpec": "model.freeze",
    "DCPCheckpointIO": "trainer.strategy.init_args",
    "Preemption": "trainer.callbacks.Preemption",
    "FreezeSchedule": "trainer.callbacks.FreezeSchedule",
}
#: First words of a dotted path that belong under ``model.`` on the command line.
_MODEL_PARTS = ("config", "optimizer", "scheduler", "encoder", "connector", "vlm", "freeze")
#: ``KempnerStrategy`` arguments that messages name bare (``tp=3``, ``dp_shard=-1``).
_STRATEGY_ARGS = (
    "dp_replicate",
    "dp_shard",
    "tp",
    "pp",
    "cp",
    "cp_attention",
    "ep",
    "sequence_parallel",
    "loss_parallel",
    "float8_recipe",
    "float8_all_gather",
    "activation_checkpointing",
    "ac_every_n",
    "compile",
    "mixed_precision_param",
    "mixed_precision_reduce",
    "pp_schedule",
    "pp_microbatches",
    "pp_virtual_stages",
    "pp_split_points",
    "rendezvous_timeout_s",
)
_DOTTED = re.compile(r"(?<![\w/.-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)\b")
_CLASS_ATTR = re.compile(r"\b(" + "|".join(_CLASS_FIELDS) + r")\.([a-z_][a-z0-9_]*)")
_BARE_ARG = re.compile(r"\b(" + "|".join(_STRATEGY_ARGS) + r")=")
#: ``CausalLM`` / ``VisionLanguage`` arguments that messages name bare (``grad_clip=-1.0 must be >= 0``).
_MODULE_ARG = re.compile(r"\b(grad_clip|loss_impl|init_from|seed)=")
_FILE_SUFFIXES = ("yaml", "yml", "json", "jsonl", "csv", "txt", "pt", "ckpt", "py", "parquet", "npy", "partial")


def is_user_error(exc: BaseException, during_setup: bool) -> bool:
    """Whether ``exc`` is printed as one line (see the module docstring)."""
    from kempnerforge.errors import UserError

    if isinstance(exc, UserError) or any(t.__name__ in USER_ERROR_TYPES for t in type(exc).__mro__):
        return True
    if type(exc).__name__ == "ArgumentError":  # jsonargparse / argparse: a bad option or value
        return True
    return during_setup and isinstance(exc, SETUP_ERROR_TYPES)


def _qualify(path: str) -> str:
    head = path.split(".", 1)[0]
    return f"model.{path}" if head in _MODEL_PARTS else path


def infer_field(message: str, default: str = "config") -> str:
    """The config field a message is about (see the module docstring); ``default`` when it names none."""
    found = _CLASS_ATTR.search(message)
    candidates = []
    if found:
        candidates.append((found.start(), f"{_CLASS_FIELDS[found.group(1)]}.{found.group(2)}"))
    for match in _DOTTED.finditer(message):
        if match.group(1).rsplit(".", 1)[-1] not in _FILE_SUFFIXES and not match.group(1).startswith("torch."):
            candidates.append((match.start(), _qualify(match.group(1))))
            break
    module_arg = _MODULE_ARG.search(message)
    if module_arg:
        candidates.append((module_arg.start(), f"model.{module_arg.group(1)}"))
    bare = _BARE_ARG.search(message)
    if bare:
        candidates.append((bare.start(), f"trainer.strategy.init_args.{bare.group(1)}"))
    return min(candidates)[1] if candidates else default


def _argparse_line(message: str) -> tuple[str, str]:
    """(field, message) of a jsonargparse parse error (``Parser key "x.y":\\n  Expected ...``)."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    key = re.match(r'Parser key "([^"]+)":\s*(.*)', text)
    option = re.search(r"Problem with given class_path '([\w.]+)': Option '(\w+)' is not accepted", text)
    if key and option:  # an init_args key the class does not take: jsonargparse reports the whole union
        return _unknown_init_arg(key.group(1), option.group(1), option.group(2))
    # A value of the wrong type for a class's init_arg (``--trainer.strategy.init_args.cp=abc``): jsonargparse reports
    # the whole union again; the class's own line names the argument and what it expected.
    bad_value = re.search(r"Problem with given class_path '[\w.]+': Parser key \"(\w+)\": (.+?)(?: - |$)", text)
    if key and bad_value:
        said = bad_value.group(2).strip()
        typed = re.match(r"Expected a <class '(\w+)'>\. Got value: (.*?) Given value type:", said)
        if typed:
            said = f"expected {typed.group(1)}, got {typed.group(2)}"
        return f"{key.group(1)}.init_args.{bad_value.group(1)}", said
    if key:
        return key.group(1), key.group(2)
    if text.startswith("Unexpected config"):  # an empty --config file (YAML null), or one that is no mapping
        return "--config", "a config file is empty or is not a YAML mapping of fields (e.g. trainer: {max_steps: 10})"
    unknown = re.match(r"[Uu]nrecognized arguments: (\S+)", text)
    if unknown:
        option = unknown.group(1).split("=", 1)[0]
        return option, f"unknown option {text.split(': ', 1)[1]!s} (kforge <command> --help lists every option)"
    extra = re.match(r"Subcommand '(\w[\w-]*)' does not accept option '([^']+)'", text)
    if extra:  # a key of a --config file (or a nested option) that is no field: name the key, not "arguments"
        command, key = extra.groups()
        return key, f"not a field of kforge {command} (in a --config file?); kforge {command} --help lists every field"
    return "arguments", text


def _unknown_init_arg(key: str, class_path: str, name: str) -> tuple[str, str]:
    """(``key.init_args.name``, ``unknown; did you mean X?``) for an option ``class_path`` does not take."""
    import difflib
    import importlib
    import inspect

    module, _, cls_name = class_path.rpartition(".")
    try:
        accepted = list(inspect.signature(getattr(importlib.import_module(module), cls_name)).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        accepted = []
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"did you mean {close[0]}?" if close else f"{cls_name} takes: {', '.join(accepted[:30])}"
    return f"{key}.init_args.{name}", f"unknown; {hint}"


def argparse_error_line(message: str) -> str:
    """``kforge: error: <option>: <message>`` for a jsonargparse / argparse error message (any number of lines)."""
    field, text = _argparse_line(message)
    return f"kforge: error: {field}: {text}"


def tool_error_line(message: str, command: str) -> str:
    """``kforge: error: <option>: <message>`` for an error of a tool's argparse parser (:class:`ToolArgumentParser`):
    the option argparse names (``argument --dtype: ...``), the first missing required one, an unknown option, an
    option the tool's own check names first (``--seq_len is needed``, ``SamplingConfig.top_p=2.0 ...`` ->
    ``--top_p``); else ``command``."""
    text = " ".join(message.split())
    named = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", text)
    if named:
        return f"kforge: error: {named.group(1)}: {named.group(2)}"
    required = re.match(r"the following arguments are required: ([^,\s]+)", text)
    unknown = re.match(r"unrecognized arguments: (\S+)", text)
    own = re.match(r"(--\w+)\b", text) or re.match(r"[A-Z]\w*\.(\w+)=", text)
    if required:
        return f"kforge: error: {required.group(1)}: {text}"
    if unknown:
        return f"kforge: error: {unknown.group(1)}: unknown option {text.split(': ', 1)[1]} (kforge {command} --help)"
    if own:
        option = own.group(1) if own.group(1).startswith("--") else f"--{own.group(1)}"
        return f"kforge: error: {option}: {text}"
    return f"kforge: error: {command}: {text}"


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse for the ``kforge`` tools: errors are one line (:func:`tool_error_line`) and exit status 2, without
    the usage block; no abbreviated options. Sub-parsers (``kforge convert dcp-to-hf``) inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print one line and exit 2."""
        command = self.prog.removeprefix("kforge ").split(" ")[0]
        print(tool_error_line(message, command), file=sys.stderr, flush=True)
        raise SystemExit(2)


def error_line(exc: BaseException) -> str:
    """``kforge: error: <field>: <message>`` for ``exc``, on one line."""
    from kempnerforge.errors import UserError

    if type(exc).__name__ == "ArgumentError":
        return argparse_error_line(str(exc))
    else:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        field = exc.field if isinstance(exc, UserError) else infer_field(message, default=_default_field(exc))
    return f"kforge: error: {field}: {message.removeprefix(f'{field}: ')}"  # a message that starts with its field


def _default_field(exc: BaseException) -> str:
    name = type(exc).__name__
    if name in ("CheckpointError", "CorruptCheckpointError"):
        return "ckpt_path"
    if name in ("MeshConfigError", "Float8ConfigError"):
        return "trainer.strategy"
    if name in ("TokenDataError", "ImageDataError", "VideoDataError", "AllClipsFailedError"):
        return "data"
    return "config"


def exit_with_error(exc: BaseException) -> None:
    """Print :func:`error_line` to stderr and exit with status 2.

    Raises:
        SystemExit: always, code 2 (chained to ``exc``, so ``python -X dev`` users can still see it).
    """
    line = error_line(exc)
    if not said_by_another_rank(line):
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2) from exc


def said_by_another_rank(line: str) -> bool:
    """Whether another process of this multi-process run, on this node, printed ``line`` already: the ranks of a
    run usually refuse the same input at the same check, and the run should say it once (once per node: nodes
    share no folder we may assume). A rank whose line differs (its own file is corrupt) still prints it. The
    marker is an empty file in the temp folder named by the run (:func:`_run_key`) and a checksum of the line;
    False (print) for a process that runs alone or when the folder cannot be written."""
    run = _run_key()
    if run is None:
        return False
    marker = Path(tempfile.gettempdir()) / f"kforge-said-{run}-{zlib.crc32(line.encode()):08x}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return True
    except OSError:
        return False
    return False


#: A name for one ``kforge`` command and the processes Lightning's launcher starts for it (they inherit it).
LAUNCH_ID_ENV = "KFORGE_LAUNCH_ID"


def name_this_launch() -> None:
    """Give this command a fresh :data:`LAUNCH_ID_ENV`, unless it is a rank that Lightning's launcher started for
    one (local rank > 0, the name inherited): every command in one Python process (tests, notebooks) is its own."""
    env = os.environ
    if LAUNCH_ID_ENV not in env or env.get("LOCAL_RANK", "0") in ("", "0"):
        env[LAUNCH_ID_ENV] = os.urandom(8).hex()


def _run_key() -> str | None:
    """One name per run for the processes of a node: under ``srun`` / ``torchrun`` the ranks' parent, the job
    (SLURM's job and step, ``torchrun``'s run id) and the rendezvous port; under Lightning's own launcher the name
    :func:`name_this_launch` gave the command. None for a process no launcher started (it runs alone)."""
    env = os.environ
    if "MASTER_PORT" not in env:  # set by every launcher
        return None
    if "SLURM_PROCID" in env or "TORCHELASTIC_RUN_ID" in env:
        job = env.get("TORCHELASTIC_RUN_ID") or f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        parts: tuple[object, ...] = (os.getppid(), env["MASTER_PORT"], job)
    elif LAUNCH_ID_ENV in env:
        parts = (env[LAUNCH_ID_ENV],)
    else:
        return None
    return "-".join(re.sub(r"[^\w.]", "_", str(part)) for part in parts)


class _HeldWarning(NamedTuple):
    """A Python warning held back: the arguments ``warnings.showwarning`` got."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class HeldLogs(logging.Handler):
    """Log lines from the start of a command (Lightning's ``Seed set to``, ``GPU available``, ``Initializing
    distributed``, the model summary; warnings of libraries that log through the root logger; Python warnings,
    Lightning's ``rank_zero_warn`` among them), held back until the
    run's checks pass, those after the process group starts included (the restored checkpoint's global batch, its
    checksums), and dropped when the command ends in a user error, so a refused command prints its one
    ``kforge: error`` line and nothing else.

    :meth:`hold` at the start, then :meth:`show` (the loop starts, or any other ending) or :meth:`drop`;
    :meth:`release_after` shows them anyway once a slow start (a rendezvous waiting for other nodes, a large
    model's materialization) has taken that long, so a hang never hides its last lines.
    """

    #: The root logger (libraries without handlers of their own, e.g. torchao's missing-kernel warning on CPU)
    #: and Lightning's two, which do not propagate.
    LOGGERS = ("", "lightning.pytorch", "lightning.fabric")

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.records: list[logging.LogRecord | _HeldWarning] = []
        self._saved: dict[str, tuple[list[logging.Handler], bool]] = {}
        self._showwarning: Any = None  # warnings.showwarning while held
        self._guard = threading.RLock()  # the release timer's thread and the main thread
        self._timer: threading.Timer | None = None

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:
            if self._saved:
                self.records.append(record)
                return
        logging.getLogger(record.name).handle(record)  # shown meanwhile: a logger still pointing here passes it on

    def _hold_warning(self, *args: Any, **kwargs: Any) -> None:
        with self._guard:
            if self._saved:
                self.records.append(_HeldWarning(args, kwargs))
                return
        warnings.showwarning(*args, **kwargs)

    def hold(self) -> HeldLogs:
        """Replace the handlers of Lightning's loggers and ``warnings.showwarning`` by this one (until :meth:`show` /
        :meth:`drop`)."""
        with self._guard:
            for name in self.LOGGERS:
                logger = logging.getLogger(name)
                self._saved[name] = (list(logger.handlers), logger.propagate)
                logger.handlers, logger.propagate = [self], False
            self._showwarning, warnings.showwarning = warnings.showwarning, self._hold_warning
        return self

    def release_after(self, seconds: float) -> None:
        """:meth:`show` from a daemon thread in ``seconds`` unless shown or dropped before (re-arming restarts it)."""
        with self._guard:
            self._cancel()
            if self._saved:
                self._timer = threading.Timer(seconds, self.show)
                self._timer.daemon = True
                self._timer.start()

    def _cancel(self) -> None:
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        self._timer = None

    def _restore(self) -> None:
        self._cancel()
        for name, (handlers, propagate) in self._saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        if self._saved and warnings.showwarning == self._hold_warning:  # not replaced since (a library, pytest)
            warnings.showwarning = self._showwarning
        self._saved = {}

    def show(self) -> None:
        """Put Lightning's handlers back and print what was held, in order (idempotent)."""
        with self._guard:
            self._restore()
            records, self.records = self.records, []
            for record in records:
                if isinstance(record, _HeldWarning):
                    warnings.showwarning(*record.args, **record.kwargs)
                else:
                    logging.getLogger(record.name).handle(record)

    def drop(self) -> None:
        """Put Lightning's handlers back and forget what was held."""
        with self._guard:
            self._restore()
            self.records = []
