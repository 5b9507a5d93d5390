"""Lightning callbacks, one concern each, usable in any Lightning project."""

from kempnerforge.callbacks.checkpoint_retention import CheckpointRetention
from kempnerforge.callbacks.nan_guard import NaNGuard
from kempnerforge.callbacks.preemption import Preemption

__all__ = ["CheckpointRetention", "NaNGuard", "Preemption"]
