"""Lightning strategies of kempnerforge (installed as ``kempnerforge.strategies``)."""

from kempnerforge.strategies.kempner import KempnerStrategy

__all__ = ["KempnerStrategy"]
