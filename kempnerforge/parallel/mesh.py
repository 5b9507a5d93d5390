"""One world DeviceMesh with named parallel axes, its validation, and the sub-meshes consumers ask for.

Follows torchtitan v0.2 (``ParallelDims``): the world is factored as
``pp x dp_replicate x dp_shard x cp x tp`` (outermost to innermost, so TP ranks are neighbours
and share the fastest links); ``dp_shard=-1`` takes whatever the other degrees leave.
Expert parallelism (``ep``) borrows ranks from ``dp_shard`` as in torchtitan and is therefore
not a separate factor of the world size; with HSDP (``dp_replicate > 1``) the experts are replicated
over ``dp_replicate`` like every other parameter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)

#: Mesh axes from outermost to innermost; every axis exists in the mesh, degree-1 axes included.
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class MeshConfigError(ValueError):
    """A parallel degree that cannot be laid out on this world or this model."""


def validate_degrees(dp_replicate: int, dp_shard: int, tp: int, pp: int, cp: int, ep: int) -> None:
    """Check each degree on its own (no world size needed), so bad input fails before any process starts.

    Raises:
        MeshConfigError: a degree < 1 (``dp_shard`` may be -1), or an axis whose transform is not
            implemented yet (an axis that exists must run; it is never a silent no-op).
    """
    for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise MeshConfigError(f"{name}={value!r} is not allowed: parallel degrees are integers >= 1.")
    if not isinstance(dp_shard, int) or (dp_shard < 1 and dp_shard != -1):
        raise MeshConfigError(
            f"dp_shard={dp_shard!r} is not allowed: use an integer >= 1, or -1 to infer it from the world size."
        )


@dataclass
class ParallelDims:
    """Parallel degrees of one run, validated against the world size before anything is allocated.

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's replicate dimension; plain DDP-style copies).
        dp_shard: FSDP2 shard degree; ``-1`` infers ``world_size / (pp * dp_replicate * cp * tp)``.
        tp: tensor-parallel degree (Megatron-LM, arXiv:1909.08053).
        pp: pipeline-parallel degree.
        cp: context-parallel degree (:mod:`kempnerforge.parallel.context_parallel`): every sequence split over
            ``cp`` ranks that see the same batch; parameters are FSDP2-sharded over ``dp_shard x cp``.
        ep: expert-parallel degree (borrows ranks from ``dp_shard``, or from ``dp_shard x cp`` with context
            parallelism, as torchtitan's ``dp_shard_cp``; experts are replicated over ``dp_replicate``).
        world_size: number of ranks.

    Raises:
        MeshConfigError: a degree < 1 (other than ``dp_shard=-1``), degrees whose product is not
            the world size (the message shows the arithmetic), or an axis this build cannot run yet.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        validate_degrees(self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp, self.ep)
        if self.world_size < 1:
            raise MeshConfigError(f"world_size={self.world_size} must be >= 1.")
        self._resolve()

    def _resolve(self) -> None:
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise MeshConfigError(
                    f"dp_shard=-1 cannot be inferred: world_size={self.world_size} is not divisible by "
                    f"pp*dp_replicate*cp*tp = {self.pp}*{self.dp_replicate}*{self.cp}*{self.tp} = {others}."
                )
            self.dp_shard = self.world_size // others
        lenders = self.dp_shard * self.cp  # the ranks that hold different shards of the same weights
        if self.ep > 1 and lenders % self.ep:
            axes = "dp_shard" if self.cp == 1 else "dp_shard x cp"
            what = f"dp_shard={self.dp_shard}" if self.cp == 1 else f"{axes} = {self.dp_shard} x {self.cp} = {lenders}"
            raise MeshConfigError(
                f"ep={self.ep} must divide {what}: expert parallelism borrows its ranks from {axes}; allowed ep: "
                f"{[d for d in range(1, lenders + 1) if lenders % d == 0]}."
            )
        product = others * self.dp_shard
        if product != self.world_size:
            raise MeshConfigError(
                f"Parallel degrees do not multiply to the world size: pp*dp_replicate*dp_shard*cp*tp = "
                f"{self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp} = {product}, "
                f"but world_size={self.world_size}. Set dp_shard=-1 to infer it."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: number of distinct data shards (``dp_replicate * dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_AXES` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """Create the world DeviceMesh (process group must be initialized) and its sub-meshes."""
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
        return ParallelMesh(self, mesh)


class ParallelMesh:
    """The world mesh plus the derived sub-meshes every consumer asks for instead of recomputing.

    Args:
        dims: the validated degrees.
        world: the world DeviceMesh with axes :data:`MESH_AXES`.
    """

    def __init__(self, dims: ParallelDims, world: DeviceMesh) -> None:
        self.dims = dims
        self.world = world
        #: With EP + HSDP, ``(dp_shard_mod_ep, ep)`` flattened (set by :attr:`expert`; the same ranks as ``dp_shard``).
        self.expert_shard: DeviceMesh | None = None

    @cached_property
    def dp(self) -> DeviceMesh:
        """Data-loading / loss mesh (``dp_replicate x dp_shard`` flattened): sampler rank and size."""
        # DeviceMesh has no public flatten / unflatten in torch 2.13 (torchtitan uses the same two calls).
        return self.world["dp_replicate", "dp_shard"]._flatten("dp")

    @cached_property
    def dp_cp(self) -> DeviceMesh:
        """Loss / gradient mesh: every rank that saw other tokens of the step (``dp_replicate x dp_shard x cp``
        flattened; the :attr:`dp` mesh itself when ``cp = 1``). The step's target tokens are counted over it."""
        if self.dims.cp == 1:
            return self.dp
        return self.world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    @cached_property
    def cp(self) -> DeviceMesh:
        """1-D context-parallel mesh (``cp`` axis): the ranks splitting one sequence (K/V all-gathered over it)."""
        return self.world["cp"]

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """Dense-parameter mesh for FSDP2: 1-D ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)`` for HSDP; with
        ``cp > 1`` the shard axis is ``dp_shard x cp`` flattened (torchtitan's ``dp_shard_cp``): cp ranks hold
        different shards and their gradients are reduce-scattered together."""
        if self.dims.cp > 1:
            if self.dims.dp_replicate == 1:
                return self.world["dp_shard", "cp"]._flatten("dp_shard_cp")
            # The flattened (replicate, shard x cp) pair from the world, not sliced out of the root by its flattened
            # name (torch deprecates that): the same ranks, bookkept here.
            split = (self.dims.dp_replicate, self.dims.dp_shard * self.dims.cp)
            return self.dp_cp._unflatten(0, split, ("dp_replicate", "dp_shard_cp"))
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard"]
        return self.world["dp_shard"]

    @cached_property
    def pp(self) -> DeviceMesh:
        """1-D pipeline-parallel mesh (``pp`` axis): the ranks holding the stages of one model replica."""
        return self.world["pp"]

    @cached_property
    def tp(self) -> DeviceMesh:
        """1-D tensor-parallel mesh (``tp`` axis): the mesh :func:`~kempnerforge.parallel.tensor_parallel.apply_tp` shards over."""
        return self.world["tp"]

    @cached_property
    def expert(self) -> DeviceMesh:
        """Expert mesh: ``dp_shard`` (with ``cp > 1`` the flattened ``dp_shard x cp`` of :attr:`fsdp`, as torchtitan's
        ``dp_shard_cp``) unflattened into ``(dp_shard_mod_ep, ep)`` with ``ep`` innermost (EP ranks are
        neighbours), as torchtitan v0.2; with HSDP the ``dp_replicate`` axis stays in front, giving the 3-D
        ``(dp_replicate, dp_shard_mod_ep, ep)``. All axes share the world mesh as root, so FSDP2 over
        :attr:`expert_fsdp` composes with expert DTensors on :attr:`ep`.

        Rank layout (``pp = cp = tp = 1``): global rank ``r * dp_shard + s * ep + e`` sits at ``dp_replicate=r``,
        ``dp_shard_mod_ep=s``, ``ep=e``; it holds the experts ``[e * E / ep, (e + 1) * E / ep)``, FSDP-shard ``s``
        of them, and so do the ``dp_replicate`` ranks that differ from it in ``r`` only (its replicas).
        """
        ep, cp = self.dims.ep, self.dims.cp
        split = (self.dims.dp_shard * cp // ep, ep)
        # Private DeviceMesh API, as in `dp`: no public unflatten in torch 2.13. With cp > 1 the lent axis is the
        # flattened dp_shard x cp of `fsdp` (cp ranks route their own tokens: an all-to-all peer like any other).
        if self.dims.dp_replicate > 1:
            lent = self.fsdp if cp > 1 else self.world["dp_replicate", "dp_shard"]
            expert = lent._unflatten(1, split, ("dp_shard_mod_ep", "ep"))
            # Registered on the root so DTensor reduces an expert weight's norm over (dp_shard_mod_ep, ep) in one
            # collective, not two in sequence (torch warns otherwise).
            self.expert_shard = expert["dp_shard_mod_ep", "ep"]._flatten("dp_shard_ep")
            return expert
        return (self.fsdp if cp > 1 else self.world["dp_shard"])._unflatten(0, split, ("dp_shard_mod_ep", "ep"))

    @cached_property
    def ep(self) -> DeviceMesh:
        """1-D expert-parallel mesh: the ranks that split one MoE layer's experts and exchange tokens."""
        return self.expert["ep"]

    @cached_property
    def expert_fsdp(self) -> DeviceMesh:
        """Mesh FSDP2 shards expert weights over: 1-D ``dp_shard_mod_ep`` (the ``dp_shard / ep`` ranks holding the
        same experts), or with HSDP the 2-D ``(dp_replicate, dp_shard_mod_ep)``: expert gradients are then
        reduce-scattered over ``dp_shard_mod_ep`` and all-reduced over ``dp_replicate``, like the dense ones."""
        if self.dims.dp_replicate > 1:
            return self.expert["dp_replicate", "dp_shard_mod_ep"]
        return self.expert["dp_shard_mod_ep"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data shards."""
        return self.dp.get_local_rank()

    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate on every axis, e.g. ``{"pp": 0, "dp_replicate": 0, "dp_shard": 1, ...}``."""
        coords = self.world.get_coordinate() or [0] * len(MESH_AXES)
        return dict(zip(MESH_AXES, coords, strict=True))

    def describe(self) -> str:
        """One line for the startup log: axis degrees and this rank's coordinates."""
        degrees = " x ".join(f"{n}={d}" for n, d in zip(MESH_AXES, self.dims.shape, strict=True))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return f"DeviceMesh [{degrees}] rank {rank} at {self.coordinates()}"
