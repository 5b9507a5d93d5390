"""Metric math the callbacks call: FLOPs per token and MFU, device peaks, memory statistics, perplexity.

Names are imported on first use: ``kempnerforge.config`` needs the FLOP counts, and importing the perplexity
metric would import torchmetrics (and with it scipy, matplotlib and transformers where they are installed) in every
process that only builds a model, ``kforge generate`` / ``convert`` / ``eval --help`` included.
"""

from kempnerforge.lazy_exports import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
