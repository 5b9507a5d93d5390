"""Lightning callbacks, one concern each, usable in any Lightning project (installed as kempnerforge.callbacks)."""

from kempnerforge.callbacks.activation_capture import ActivationCapture
from kempnerforge.callbacks.checkpoint_retention import CheckpointRetention
from kempnerforge.callbacks.freeze import FreezeSchedule
from kempnerforge.callbacks.health import HealthCheck
from kempnerforge.callbacks.memory import MemoryMonitor
from kempnerforge.callbacks.model_summary import ModelSummary
from kempnerforge.callbacks.nan_guard import NaNGuard
from kempnerforge.callbacks.preemption import Preemption
from kempnerforge.callbacks.profiler import StepProfiler
from kempnerforge.callbacks.progress import ProgressBar
from kempnerforge.callbacks.throughput import MFUMonitor

__all__ = [
    "ActivationCapture",
    "CheckpointRetention",
    "FreezeSchedule",
    "HealthCheck",
    "MFUMonitor",
    "MemoryMonitor",
    "ModelSummary",
    "NaNGuard",
    "Preemption",
    "ProgressBar",
    "StepProfiler",
]
