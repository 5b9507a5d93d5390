"""Memory statistics of one device: CUDA caching-allocator counters, or process RSS on CPU.

Reading these counters does not synchronize the device (they are host-side bookkeeping).
"""

from __future__ import annotations

import os
import resource
import sys

import torch

_GB = 1024**3


def process_rss_bytes() -> int:
    """Resident set size of this process now, bytes (``/proc/self/statm``; falls back to the peak
    where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started, bytes (``getrusage``; KiB on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory of ``device`` in GiB (keys without units; values are GiB).

    CUDA: ``allocated`` (tensors now), ``reserved`` (held by the caching allocator), ``peak``
    (max allocated since the last :func:`reset_peak`). CPU and other devices: ``rss`` (process
    resident memory now) and ``peak`` (process peak RSS, never reset by the OS).
    """
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated(device) / _GB,
            "reserved": torch.cuda.memory_reserved(device) / _GB,
            "peak": torch.cuda.max_memory_allocated(device) / _GB,
        }
    return {"rss": process_rss_bytes() / _GB, "peak": peak_rss_bytes() / _GB}


def reset_peak(device: torch.device) -> None:
    """Start a new peak window on CUDA (``reset_peak_memory_stats``); the CPU peak cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
