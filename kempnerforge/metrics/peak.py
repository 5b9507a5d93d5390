"""Peak FLOP/s per device for MFU: a datasheet table for common GPUs and a measured CPU matmul peak.

The table holds dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendors' datasheets, in
FLOP/s. MFU against a bf16 peak is the usual convention (PaLM, arXiv:2204.02311; torchtitan). An
fp32 or FP8 run should pass its own peak (``peak_flops`` override) or have MFU omitted.

A CPU has no datasheet peak that its GEMM reaches, so its peak is measured, once per process, and the highest
measurement seen is kept in ``<cache dir>/cpu_peak_flops.json`` (:func:`peak_cache_path`), keyed by CPU model,
torch version, thread count and dtype: a measurement taken on a busy machine never lowers it.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

#: Environment variable naming kempnerforge's cache folder (default: ``$XDG_CACHE_HOME/kempnerforge``,
#: else ``~/.cache/kempnerforge``).
CACHE_DIR_ENV = "KFORGE_CACHE_DIR"
#: File of :func:`cpu_peak_flops`'s cached measurements inside the cache folder.
CPU_PEAK_CACHE_FILE = "cpu_peak_flops.json"

#: Dense bf16 tensor-core peak, FLOP/s, keyed by a lower-case substring of ``torch.cuda.get_device_name``.
#: Longer keys are tried first ("h100 pcie" before "h100"). Sources: NVIDIA H200/H100/A100/L40S/L4/A10
#: datasheets, AMD MI300X/MI250X datasheets; the sparse figures on the datasheets are twice these.
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "b200": 2250e12,
    "gh200": 989e12,
    "h200": 989e12,
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h100": 989e12,  # SXM
    "a100": 312e12,
    "l40s": 362e12,
    "a10g": 70e12,
    "a10": 125e12,
    "l4": 121e12,
    "rtx 4090": 165e12,
    "rtx a6000": 155e12,
    "mi300x": 1307e12,
    "mi250x": 383e12,
}


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its name (``torch.cuda.get_device_name()``), or None when
    the name matches no entry of :data:`GPU_PEAK_BF16_FLOPS` (pass an explicit peak then)."""
    name = device_name.lower()
    for key in sorted(GPU_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return GPU_PEAK_BF16_FLOPS[key]
    return None


def matmul_peak(n: int = 1024, reps: int = 5, rounds: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """Best measured FLOP/s of an ``(n, n) @ (n, n)`` CPU matmul over ``rounds * reps`` products.

    A practical CPU peak for MFU (what this machine's GEMM reaches with the current thread count),
    not a datasheet number; takes about ``15 * 2 n^3 / peak`` seconds (0.5 s at n=1024 on 2 cores).

    Raises:
        ValueError: ``n``, ``reps`` or ``rounds`` not positive.
    """
    for name, value in (("n", n), ("reps", reps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"matmul_peak({name}={value!r}): must be a positive integer")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):  # warm the allocator and the BLAS thread pool
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(rounds * reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def cache_dir() -> Path:
    """kempnerforge's per-user cache folder: ``$KFORGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kempnerforge``,
    else ``~/.cache/kempnerforge`` (XDG Base Directory specification). Not created here."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kempnerforge"


def peak_cache_path() -> Path:
    """The JSON file holding measured CPU peaks (:data:`CPU_PEAK_CACHE_FILE` in :func:`cache_dir`)."""
    return cache_dir() / CPU_PEAK_CACHE_FILE


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` "model name" on Linux, else :func:`platform.processor`,
    else the machine type such as ``arm64``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_peak_key(dtype: torch.dtype = torch.float32) -> str:
    """The cache key of a CPU peak: CPU model, torch version, torch's intra-op thread count and dtype
    (each changes what the GEMM reaches)."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {dtype}"


#: This process's measurement per cache key: one measurement per process (about 0.3 s), not one per call.
_MEASURED: dict[str, float] = {}


def cpu_peak_flops(cache: bool = True, dtype: torch.dtype = torch.float32) -> float:
    """Practical peak FLOP/s of this CPU: the best of :func:`matmul_peak` (1024^3, best of 15 products) measured
    by this process and of the measurements cached in :func:`peak_cache_path` under :func:`cpu_peak_key`.

    Every process measures once (about 0.3 s at 100 GFLOP/s): a peak measured while the machine was busy (e.g.
    another run, or the other ranks of this one starting) is low, and a cached low peak made MFU read over
    100% in every later run (111-119% after a resume). The cache keeps the highest value seen, so a busy
    measurement never lowers it and the next quiet one raises it; the file is written atomically (ranks on one
    machine may race). An unreadable or unwritable cache is measured around, never an error. A run's
    ``MFUMonitor(peak_flops=...)`` overrides the value.

    Args:
        cache: read and write the cache (False: this process's measurement only).
        dtype: matmul dtype (MFU on CPU counts fp32 by default).
    """
    key, path = cpu_peak_key(dtype), peak_cache_path()
    if key not in _MEASURED:
        _MEASURED[key] = matmul_peak(1024, reps=5, rounds=3, dtype=dtype)
    peak = _MEASURED[key]
    if not cache:
        return peak
    entries = _read_cache(path)
    found = entries.get(key, {}).get("flops")
    if isinstance(found, int | float) and found >= peak:
        return float(found)
    entries[key] = {"flops": peak, "matmul": f"1024^3 {dtype}, best of 15", "measured": time.strftime("%Y-%m-%d")}
    _write_cache(path, entries)
    return peak


def _read_cache(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict) -> None:
    # Atomic: a reader (another rank, another run) sees the old file or the new one, never a partial one.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_peak_flops.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure again next run


def device_peak_flops(device: torch.device, override: float | None = None, cache: bool = True) -> float | None:
    """Peak FLOP/s of one device for MFU: ``override`` if given, else the GPU table (CUDA), else this
    machine's cached fp32 CPU matmul peak (:func:`cpu_peak_flops`). None for an unknown GPU or another
    device type.

    Raises:
        ValueError: ``override`` given but not positive.
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak_flops={override!r} must be > 0 (FLOP/s per device)")
        return float(override)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        return cpu_peak_flops(cache=cache)
    return None
