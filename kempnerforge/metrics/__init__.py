"""Metric math the callbacks call: FLOPs per token and MFU, device peaks, memory statistics, perplexity.

Names are imported on first use: ``kempnerforge.config`` needs the FLOP counts, and importing the perplexity
metric would import torchmetrics (and with it scipy, matplotlib and transformers where they are installed) in every
process that only builds a model, ``kforge generate`` / ``convert`` / ``eval --help`` included.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "GPU_PEAK_BF16_FLOPS": "peak",
    "ExpMeanMetric": "perplexity",
    "cpu_peak_flops": "peak",
    "device_peak_flops": "peak",
    "gpu_peak_flops": "peak",
    "matmul_peak": "peak",
    "memory_stats": "memory",
    "mfu": "flops",
    "moe_active_params": "flops",
    "peak_cache_path": "peak",
    "peak_rss_bytes": "memory",
    "process_rss_bytes": "memory",
    "sum_flops_per_token": "flops",
    "transformer_flops_per_token": "flops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
