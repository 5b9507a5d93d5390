"""Device health checks (compute and memory sanity) and a collective liveness probe with a timeout."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class CollectiveTimeoutError(RuntimeError):
    """A liveness all-reduce did not complete within its timeout (a rank is stalled or gone)."""


@dataclass
class DeviceHealth:
    """Outcome of :func:`check_device`: ``ok`` and, when not, what failed."""

    ok: bool
    reason: str = ""


def check_device(device: torch.device, matmul_n: int = 256, memory_mb: int = 64) -> DeviceHealth:
    """Compute and memory sanity of one device; synchronizes it (call every N steps, not every step).

    Compute: an ``(n, n) @ (n, n)`` fp32 matmul of small integers (exact in fp32) must equal the
    float64 CPU product bit for bit. Memory: ``memory_mb`` MiB written with a byte pattern
    (``i % 251``) must read back with the exact analytic sum. A device error (e.g. CUDA
    "unspecified launch failure", out of memory) is reported as a failure, not raised.

    Raises:
        ValueError: ``matmul_n`` or ``memory_mb`` not a positive integer.
    """
    for name, value in (("matmul_n", matmul_n), ("memory_mb", memory_mb)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"check_device({name}={value!r}): must be a positive integer")
    try:
        idx = torch.arange(matmul_n * matmul_n, dtype=torch.float64).reshape(matmul_n, matmul_n)
        a, b = idx % 7 - 3, idx.T % 5 - 2  # |entries| <= 3: sums of n products stay exact in fp32
        expected = a @ b
        got = (a.float().to(device) @ b.float().to(device)).double().cpu()
        if not torch.equal(got, expected):
            bad = int((got != expected).sum())
            return DeviceHealth(False, f"matmul mismatch in {bad} of {matmul_n * matmul_n} entries on {device}")
        n_bytes = memory_mb * 1024 * 1024
        base = torch.arange(251, device=device, dtype=torch.uint8)
        buf = base.repeat(-(-n_bytes // 251))[:n_bytes]  # byte i holds i % 251: writes every byte once
        total = int(buf.sum(dtype=torch.int64).item())
        full, rest = divmod(n_bytes, 251)
        want = full * (250 * 251 // 2) + rest * (rest - 1) // 2
        if total != want:
            return DeviceHealth(False, f"memory pattern checksum {total} != {want} over {memory_mb} MiB on {device}")
        del buf
    except RuntimeError as err:  # CUDA errors and OOM surface as RuntimeError subclasses
        return DeviceHealth(False, f"{type(err).__name__} on {device}: {err}")
    return DeviceHealth(True)


def all_reduce_with_timeout(
    tensor: torch.Tensor, timeout_s: float, group: dist.ProcessGroup | None = None, poll_s: float = 0.001
) -> torch.Tensor:
    """Sum-all-reduce ``tensor`` in place, raising instead of hanging when it does not finish in time.

    The all-reduce is issued asynchronously and its ``Work`` is polled on the host until
    ``timeout_s``; the process-group timeout (minutes, NCCL watchdog) is not relied on. After a
    timeout the group must be considered broken: do not issue further collectives on it.

    Raises:
        CollectiveTimeoutError: not complete after ``timeout_s`` seconds (message names the rank).
        ValueError: ``timeout_s`` not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {dist.get_rank()}: liveness all-reduce did not complete within {timeout_s} s "
                "(a rank is stalled, dead or its network link is down)"
            )
        time.sleep(poll_s)
    work.wait()  # surfaces an error the collective ended with; orders the result on CUDA streams
    return tensor
