"""What a GPU holds besides the tensors the tracker counts: the verdict's allowance, as a stated model.

The tracker counts every tensor of the simulated step (parameters, gradients, optimizer states, activations,
temporaries, collective buffers FSDP2 allocates as tensors). A CUDA rank also holds, outside those tensors:

- **CUDA context** (:data:`GPU_KINDS`): the driver's per-process state, the kernel images loaded on first use
  and the local memory reserved for every resident thread (which grows with the SM count). PyTorch's
  maintainers measure about 0.3-0.4 GB with lazy module loading (CUDA >= 11.7, PyTorch's default):
  pytorch/pytorch#107667 and #109888. A training step loads NCCL's, cuBLAS's and the attention kernels' images
  too, so we take 0.5 GB on A100 (108 SMs) and 0.6 GB on H100 / H200 (132 SMs) and B200 (148 SMs).
  Measure yours with ``torch.cuda.mem_get_info`` after a step minus ``torch.cuda.memory_reserved``.
- **NCCL buffers**, per communicator: NCCL gives every channel of a communicator one FIFO per connection and
  protocol (``src/init.cc``): Simple ``NCCL_BUFFSIZE`` = 4 MiB, LL128 4,915,200 B (120 elements x 640 threads
  x 8 steps x 8 B) and LL 512 KiB (8 lines x 512 threads x 8 steps x 16 B), 9,633,792 B per connection
  (:data:`NCCL_CONNECTION_BYTES`). A ring connects each rank to its two neighbours, whatever the group size
  (NVIDIA/nccl#986); an all-to-all (the ``ep`` group) connects it to every other rank of the group, both
  directions (NVIDIA/nccl#1685: 32 channels per peer on 8 x H100, 3.3 GB after the first all-to-all). H100 /
  H800 nodes run 16 collective channels (NCCL's log line ``16 coll channels``, NVIDIA/nccl#892), up to 32.
  The communicators are the process groups of more than one rank that the strategy's mesh creates on the rank
  (:func:`mesh_communicators`): its axes, the flattened ``dp`` / ``dp_shard_cp`` / ``dp_cp`` groups, the expert
  groups, and the world. NCCL >= 2.22 connects on first use (``NCCL_RUNTIME_CONNECT=1``): a communicator that
  never runs a collective holds no buffers, so counting every one errs on the safe side.
- **Kernel workspaces** (:data:`GPU_KINDS`): PyTorch gives each cuBLAS handle a workspace per stream from the
  caching allocator (``CublasHandlePool.cpp``: 32 MiB on sm90 (H100 / H200), ``:4096:2:16:8`` = 8,519,680 B
  otherwise; cuBLASLt shares it). Forward runs on the main thread's handle, backward on the autograd device
  thread's: two workspaces on the compute stream.
- **Fragmentation** (:data:`FRAGMENTATION`): the caching allocator's reserved-but-unused blocks, a fraction of
  the tracked peak. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` grows segments in place instead of
  rounding each large block up, which keeps this small; raise it (``--allowance.fragmentation``) without it.

Each term can be overridden from ``kforge estimate`` (``--allowance.*``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

#: NCCL FIFO bytes per channel and connection: Simple (NCCL_BUFFSIZE) + LL128 + LL defaults (NCCL ``src/init.cc``).
NCCL_CONNECTION_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
#: Collective channels per communicator (H100 / H800 nodes over NVLink: NVIDIA/nccl#892).
NCCL_CHANNELS = 16
#: Share of the tracked peak lost to the caching allocator's fragmentation.
FRAGMENTATION = 0.05
#: PyTorch's default cuBLAS workspace per handle and stream: 32 MiB on sm90, ``:4096:2:16:8`` elsewhere.
_CUBLAS_SM90 = 4096 * 8 * 1024
_CUBLAS_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class GpuKind:
    """One GPU model: its memory (GB = 1e9 bytes, the datasheet's figure), CUDA context and kernel workspaces
    (bytes), and SMs (for the record)."""

    memory_gb: float
    cuda_context_bytes: int
    workspace_bytes: int
    sms: int


#: The GPU kinds ``kforge estimate --gpu`` knows (A100 SXM 80 GB, H100 SXM, H200, B200 as in a DGX B200).
GPU_KINDS: dict[str, GpuKind] = {
    "a100": GpuKind(80.0, 500_000_000, 2 * _CUBLAS_OTHER, 108),
    "h100": GpuKind(80.0, 600_000_000, 2 * _CUBLAS_SM90, 132),
    "h200": GpuKind(141.0, 600_000_000, 2 * _CUBLAS_SM90, 132),
    "b200": GpuKind(180.0, 600_000_000, 2 * _CUBLAS_OTHER, 148),
}


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator on the rank: the mesh axis it serves (``tp``, ``dp_shard``, ``ep``, ``world``, ...)
    and its ranks."""

    axis: str
    ranks: int

    @property
    def connections(self) -> int:
        """Connections per channel: a ring's two neighbours, or both directions to every peer for ``ep``'s
        all-to-all."""
        return 2 * (self.ranks - 1) if self.axis == "ep" else 2


@dataclass(frozen=True)
class Allowance:
    """The allowance model: bytes a rank holds outside the tracked tensors.

    Attributes:
        gpu: the GPU kind (a key of :data:`GPU_KINDS`).
        cuda_context_bytes: the CUDA context.
        workspace_bytes: kernel workspaces (cuBLAS / cuBLASLt).
        nccl_channels: channels per communicator.
        nccl_connection_bytes: NCCL FIFO bytes per channel and connection (all protocols).
        fragmentation: share of the tracked peak lost to fragmentation.
    """

    gpu: str = "h100"
    cuda_context_bytes: int = GPU_KINDS["h100"].cuda_context_bytes
    workspace_bytes: int = GPU_KINDS["h100"].workspace_bytes
    nccl_channels: int = NCCL_CHANNELS
    nccl_connection_bytes: int = NCCL_CONNECTION_BYTES
    fragmentation: float = FRAGMENTATION

    @classmethod
    def for_gpu(cls, gpu: str = "h100", **overrides: Any) -> Allowance:
        """The model for GPU kind ``gpu`` with ``overrides`` (field name -> value; None keeps the default).

        Raises:
            ValueError: an unknown kind (naming the known ones).
        """
        if gpu not in GPU_KINDS:
            raise ValueError(f"gpu={gpu!r}: one of {', '.join(GPU_KINDS)}")
        kind = GPU_KINDS[gpu]
        model = cls(gpu, kind.cuda_context_bytes, kind.workspace_bytes)
        return replace(model, **{k: v for k, v in overrides.items() if v is not None})

    def nccl_bytes(self, communicators: list[Communicator]) -> int:
        """NCCL FIFO bytes: channels x connections x bytes per connection, summed over ``communicators``."""
        return sum(self.nccl_channels * c.connections * self.nccl_connection_bytes for c in communicators)

    def terms(self, peak_bytes: int, communicators: list[Communicator]) -> dict[str, int]:
        """The allowance of a rank whose tracked peak is ``peak_bytes``, by term (bytes)."""
        return {
            "cuda_context": self.cuda_context_bytes,
            "nccl": self.nccl_bytes(communicators),
            "workspaces": self.workspace_bytes,
            "fragmentation": int(peak_bytes * self.fragmentation),
        }

    def needed(self, peak_bytes: int, communicators: list[Communicator]) -> int:
        """GPU memory a rank with tracked peak ``peak_bytes`` and these communicators needs (bytes)."""
        return peak_bytes + sum(self.terms(peak_bytes, communicators).values())

    def to_json(self) -> dict[str, Any]:
        """The model's parameters, JSON-serializable."""
        return asdict(self)


def mesh_communicators(parallel_mesh: Any) -> list[Communicator]:
    """The communicators of more than one rank that ``parallel_mesh`` (a
    :class:`~kempnerforge.parallel.mesh.ParallelMesh`) created on this rank, one per distinct process group
    (:func:`~kempnerforge.estimate.counters.mesh_groups`), world included."""
    import torch.distributed as dist

    from kempnerforge.estimate.counters import mesh_groups

    out = []
    for axis, group in mesh_groups(parallel_mesh).values():
        size = dist.get_world_size(group)
        if size > 1:
            out.append(Communicator(axis, size))
    return out


@lru_cache(maxsize=64)
def layout_communicators(
    pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int
) -> tuple[Communicator, ...]:
    """:func:`mesh_communicators` of rank 0 of the mesh with these degrees (every rank has as many, of the same
    sizes), built in a fake world of its own: what a layout costs in NCCL buffers, known before its step is
    simulated. Call outside any process group.

    Raises:
        MeshConfigError: degrees that do not lay out (an ``ep`` that does not divide its axis).
    """
    from kempnerforge.estimate.build import touch_meshes
    from kempnerforge.estimate.cluster import fake_world
    from kempnerforge.parallel.mesh import ParallelDims

    world = pp * dp_replicate * dp_shard * cp * tp
    with fake_world(world, 0):
        mesh = ParallelDims(dp_replicate, dp_shard, tp, pp, cp, ep, world).build_mesh("cpu")
        touch_meshes(mesh)
        return tuple(mesh_communicators(mesh))
