"""Peak FLOP/s per device for MFU: a datasheet table for common GPUs and a measured CPU matmul peak.

The table holds dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendors' datasheets, in
FLOP/s. MFU against a bf16 peak is the usual convention (PaLM, arXiv:2204.02311; torchtitan). An
fp32 or FP8 run should pass its own peak (``peak_flops`` override) or have MFU omitted.
"""

from __future__ import annotations

import time

import torch

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


def device_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device for MFU: ``override`` if given, else the GPU table (CUDA), else a
    measured fp32 1024^3 matmul peak (CPU, best of 3). None for an unknown GPU or another device type.

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
        return matmul_peak(1024, reps=3, rounds=1)  # 5 products of 2 GFLOP: about 0.2 s at 50 GFLOP/s
    return None
