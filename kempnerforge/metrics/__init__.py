"""Metric math the callbacks call: FLOPs per token and MFU, device peaks, memory statistics, perplexity."""

from kempnerforge.metrics.flops import mfu, moe_active_params, sum_flops_per_token, transformer_flops_per_token
from kempnerforge.metrics.memory import memory_stats, peak_rss_bytes, process_rss_bytes
from kempnerforge.metrics.peak import (
    GPU_PEAK_BF16_FLOPS,
    cpu_peak_flops,
    device_peak_flops,
    gpu_peak_flops,
    matmul_peak,
    peak_cache_path,
)
from kempnerforge.metrics.perplexity import ExpMeanMetric

__all__ = [
    "GPU_PEAK_BF16_FLOPS",
    "ExpMeanMetric",
    "cpu_peak_flops",
    "device_peak_flops",
    "gpu_peak_flops",
    "matmul_peak",
    "memory_stats",
    "mfu",
    "moe_active_params",
    "peak_cache_path",
    "peak_rss_bytes",
    "process_rss_bytes",
    "sum_flops_per_token",
    "transformer_flops_per_token",
]
