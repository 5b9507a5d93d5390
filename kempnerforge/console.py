"""What ``kforge fit`` prints besides the metrics: its default progress and summary callbacks, and the
known-harmless third-party warnings it filters (by exact message) so that the ones left mean something.

Nothing here imports Lightning at module level (the CLI's start-up stays lazy).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Any

#: Python warnings filtered in every process: (category, exact message). Each is emitted by a dependency on
#: every run and asks nothing of the user.
HARMLESS_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.x deprecated (once per rank).
    (UserWarning, "'set_vital' is deprecated, please do not call"),
    # Lightning 2.6's utilities/_pytree.py returns LeafSpec(), deprecated by torch 2.10 (once per rank).
    (
        FutureWarning,
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
        "treespec.is_leaf()` instead.",
    ),
)

#: Python warnings filtered by pattern (``re.match`` of the whole message) where the message names modules.
#: torch 2.13's FSDP2 warns once per module class whose forward returns a view (an in-place op on it would skip
#: the pre-backward hook); kempnerforge's embedding, norms, head, MoE layers and experts return views, and no
#: kempnerforge module modifies another module's output in place (residuals are ``h = h + ...``). Modules of
#: other classes keep the warning.
HARMLESS_WARNING_PATTERNS: tuple[tuple[type[Warning], str], ...] = (
    (
        UserWarning,
        r"FSDP2-wrapped module \((FSDP(Embedding|RMSNorm|Linear|MoE|GroupedExperts)(, )?)+\) returned a view "
        r"tensor\. An in-place op on this view",
    ),
)

#: Python warnings filtered in the tools (``kforge generate / convert / eval``, :func:`filter_tool_warnings`): they
#: run in one process without a process group by design, and DCP says so on every load and save.
TOOL_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (
        UserWarning,
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single "
        "process.",
    ),
    (
        UserWarning,
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single "
        "process.",
    ),
)

#: Log records filtered: logger name -> patterns matched against the whole message (``re.fullmatch``).
HARMLESS_LOGS: dict[str, tuple[str, ...]] = {
    # Lightning's advertisement, printed by every Trainer that has no LitLogger.
    "lightning.pytorch.utilities.rank_zero": (
        # Lightning names the ckpt_path it was given; with --ckpt_path auto that is the word "auto", and the
        # "Auto-resume: ..." line says what was (or was not) restored.
        re.escape("Restoring states from the checkpoint path at auto"),
        re.escape("Restored all states from the checkpoint at auto"),
        re.escape(
            "💡 Tip: For seamless cloud logging and experiment tracking, try installing "
            "[litlogger](https://pypi.org/project/litlogger/) to enable LitLogger, which logs metrics and "
            "artifacts automatically to the Lightning Experiments platform."
        ),
        # kforge adds kempnerforge's summary itself; Lightning says so on every start.
        re.escape(
            "Trainer already configured with model summary callbacks: "
            "[<class 'kempnerforge.callbacks.model_summary.ModelSummary'>]. "
            "Skipping setting a default `ModelSummary` callback."
        ),
    ),
}
# The same two under the other name Lightning's rank_zero helpers may log through (import order decides).
HARMLESS_LOGS["lightning.fabric.utilities.rank_zero"] = HARMLESS_LOGS["lightning.pytorch.utilities.rank_zero"]
# torchao registers its enums (KernelPreference, ScaleCalculationMode, ...) with torch's pytree, which torch 2.13
# deprecates for enums: one line per enum on every import of torchao.float8, once per rank.
HARMLESS_LOGS["torch.utils._pytree"] = (
    r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile as an opaque value type\. "
    r"Calling register_constant\(\) on Enum subclasses is deprecated and will be an error in a future release\.",
)

#: Filtered only with a CPU-only torch build: torchao's CUDA kernel libraries cannot load (on every import of
#: torchao.float8); with a CUDA build a library that fails to load matters, and stays.
HARMLESS_LOGS_CPU_TORCH: dict[str, tuple[str, ...]] = {
    "torchao": (r"Failed to load \S+/torchao/_C[\w.-]*\.so: Could not load this library: \S+/torchao/_C[\w.-]*\.so",),
}

#: The warning ModelCheckpoint gives on every resume (the folder holds the checkpoint being resumed).
RESUME_WARNING = re.escape("Checkpoint directory ") + r".* exists and is not empty\."

#: Categories ranks > 0 do not print: they describe the code, which every rank runs alike, so global rank
#: 0 prints the same warning. Warnings about a rank's own data or state (UserWarning, RuntimeWarning, ...)
#: are still printed by the rank that has them.
CODE_WARNING_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


class MessageFilter(logging.Filter):
    """Drops log records whose whole message matches one of ``patterns`` (regular expressions); with
    ``cpu_torch_only``, only while the imported torch is a CPU-only build (``torch.version.cuda`` None)."""

    def __init__(self, patterns: tuple[str, ...], cpu_torch_only: bool = False) -> None:
        super().__init__()
        self.patterns = [re.compile(p, re.DOTALL) for p in patterns]
        self.cpu_torch_only = cpu_torch_only

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a matching record."""
        if self.cpu_torch_only:
            torch = sys.modules.get("torch")  # the loggers filtered this way log after torch is imported
            if torch is None or getattr(torch.version, "cuda", None) is not None:
                return True
        message = record.getMessage()
        return not any(p.fullmatch(message) for p in self.patterns)


def env_rank() -> int:
    """This process's global rank before any process group exists, read as Lightning reads it for
    ``rank_zero_only`` (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``; 0 when none is set)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def filter_harmless_warnings(rank: int | None = None) -> None:
    """Install the filters of :data:`HARMLESS_WARNINGS`, :data:`HARMLESS_LOGS` and (effective with a CPU-only
    torch) :data:`HARMLESS_LOGS_CPU_TORCH`, and on global ranks > 0 ignore :data:`CODE_WARNING_CATEGORIES`.
    Idempotent and cheap (imports neither torch nor Lightning); errors and all other warnings are untouched.

    Args:
        rank: this process's global rank (None: :func:`env_rank`).
    """
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=category)
    for category, pattern in HARMLESS_WARNING_PATTERNS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for logs, cpu_only in ((HARMLESS_LOGS, False), (HARMLESS_LOGS_CPU_TORCH, True)):
        for name, patterns in logs.items():
            logger = logging.getLogger(name)
            if not any(isinstance(f, MessageFilter) and f.patterns[0].pattern == patterns[0] for f in logger.filters):
                logger.addFilter(MessageFilter(patterns, cpu_torch_only=cpu_only))
    if (env_rank() if rank is None else rank) > 0:
        for category in CODE_WARNING_CATEGORIES:
            warnings.filterwarnings("ignore", category=category)


def filter_tool_warnings() -> None:
    """:func:`filter_harmless_warnings` plus :data:`TOOL_WARNINGS`, for the one-process tools (no process group)."""
    filter_harmless_warnings()
    for category, message in TOOL_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z", category=category)


def filter_resume_warning() -> None:
    """Ignore ModelCheckpoint's "Checkpoint directory ... exists and is not empty." (:data:`RESUME_WARNING`):
    call it when the run resumes from that folder (a fresh run into a full folder keeps the warning)."""
    warnings.filterwarnings("ignore", message=RESUME_WARNING)


def add_default_callbacks(trainer_config: Any) -> None:
    """Append kempnerforge's :class:`~kempnerforge.callbacks.ProgressBar`,
    :class:`~kempnerforge.callbacks.ModelSummary` and :class:`~kempnerforge.callbacks.NaNGuard` to
    ``trainer_config["callbacks"]`` (instantiated callbacks), each unless the configuration has one of its kind
    or disables it (``enable_progress_bar`` / ``enable_model_summary: false``; a NaNGuard of your own replaces the
    default one, e.g. ``action: raise``). Lightning's own bars read their metrics from the device at every
    refresh (a host sync per step) and draw bars into batch logs; its summary prints a FLOPs column of 0."""
    from lightning.pytorch.callbacks import ModelSummary as ModelSummaryBase
    from lightning.pytorch.callbacks.progress import ProgressBar as ProgressBarBase

    from kempnerforge.callbacks import ModelSummary, NaNGuard, ProgressBar

    if trainer_config is None:
        return
    callbacks = trainer_config.get("callbacks")
    callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, list) else [callbacks]
    added = False
    if not any(isinstance(cb, NaNGuard) for cb in callbacks):
        # A diverged run stops (exit 3) instead of training on NaN to the end and writing NaN checkpoints.
        callbacks.append(NaNGuard())
        added = True
    for base, default, switch in (
        (ProgressBarBase, ProgressBar, "enable_progress_bar"),
        (ModelSummaryBase, ModelSummary, "enable_model_summary"),
    ):
        if trainer_config.get(switch) is not False and not any(isinstance(cb, base) for cb in callbacks):
            callbacks.append(default())
            added = True
    if added:
        trainer_config["callbacks"] = callbacks
