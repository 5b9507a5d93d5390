"""Lightning callbacks, one concern each, usable in any Lightning project (installed as kempnerforge.callbacks)."""

from kempnerforge.callbacks.activation_capture import ActivationCapture
from kempnerforge.callbacks.health import HealthCheck
from kempnerforge.callbacks.memory import MemoryMonitor
from kempnerforge.callbacks.profiler import StepProfiler
from kempnerforge.callbacks.throughput import MFUMonitor

__all__ = ["ActivationCapture", "HealthCheck", "MFUMonitor", "MemoryMonitor", "StepProfiler"]
