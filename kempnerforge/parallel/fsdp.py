"""FSDP2 (``fully_shard``): the last step of the chain, one unit per piece that runs at its own time.

Follows torchtitan's ``apply_fsdp`` and the FSDP2 design (PyTorch RFC #114299). The units, inner
before outer:

- the units the model declares (``fsdp_units()``: a VLM's encoder layers, encoder, connector);
- untied decoders: the token embedding, and ``[final norm, output head]`` as one unit; tied ones:
  ``[embedding, final norm, head]`` as one unit (the shared weight is gathered once);
- each block of ``model.layers`` (with expert parallelism the MoE layer and its experts are units of
  their own, see :func:`apply_fsdp`);
- the root (whatever is left, e.g. a VLM backbone's extra parameters).

With the head in its own unit, its all-gathered weight (vocab x dim, the largest in a dense model)
and its unsharded gradient live from the final norm's forward to the end of the head's backward,
instead of the whole step as when the root unit held it.

Expert weights (``GroupedExperts.w1/w2/w3``, (experts, ., .)) are sharded on dim 0 only when this
rank's expert count divides evenly over the FSDP degree; otherwise on the first dim that does (dim 1:
``hidden`` or ``dim``), so no rank holds only padding (torchtitan: ``Shard(1)`` when the expert-FSDP
degree times ``ep`` exceeds ``num_experts``; 8 experts on 16 ranks would otherwise leave each rank
1/8 of the experts, half of the ranks padding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from kempnerforge.parallel.contract import DeclaresFSDPUnits, is_moe_layer
from kempnerforge.parallel.order import applied_steps, record_step

log = logging.getLogger(__name__)

#: dtype names accepted by the strategy's ``mixed_precision_param`` / ``mixed_precision_reduce``.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, field: str) -> torch.dtype:
    """Map a dtype name to ``torch.dtype``.

    Raises:
        ValueError: ``name`` is not one of :data:`DTYPES` (the message names ``field``).
    """
    if name not in DTYPES:
        raise ValueError(f"{field}={name!r} is not allowed; choose one of {sorted(DTYPES)}.")
    return DTYPES[name]


def expert_shard_dim(local_shape: tuple[int, ...], degree: int) -> int:
    """The dim FSDP2 shards one packed expert weight on over ``degree`` ranks.

    Dim 0 (experts) when its size divides by ``degree`` (contiguous shards, no copies around the
    collectives); else the first later dim that does (FSDP2 needs even shards off dim 0); else dim 0
    with FSDP2's padding (logged: some ranks then hold padding only).

    Args:
        local_shape: this rank's shape of the weight before FSDP2, e.g. (num_experts / ep, hidden, dim).
        degree: FSDP2 shard degree over which it is split (``dp_shard / ep``, or ``dp_shard`` at ep=1).

    Returns:
        The tensor dim to pass as ``Shard(dim)``.
    """
    for dim, size in enumerate(local_shape):
        if size % degree == 0:
            return dim
    log.warning("expert weight %s: no dim divides by the FSDP degree %d; sharding dim 0 with padding",
                tuple(local_shape), degree)  # fmt: skip
    return 0


def _expert_placements(root: nn.Module, degree: int) -> Callable[[nn.Parameter], Shard | None] | None:
    """``shard_placement_fn`` for ``fully_shard``: :func:`expert_shard_dim` for the packed expert weights
    under ``root``, FSDP2's default ``Shard(0)`` (None) for every other parameter; None without experts."""
    placement: dict[nn.Parameter, Shard] = {}
    for moe in (m for m in root.modules() if is_moe_layer(m)):
        placement.update(_expert_shards(moe.experts, degree))
    return placement.get if placement else None


def _expert_placements_of(experts: nn.Module, degree: int) -> Callable[[nn.Parameter], Shard | None]:
    """``shard_placement_fn`` for one MoE layer's ``experts`` unit (see :func:`_expert_placements`)."""
    return _expert_shards(experts, degree).get


def _expert_shards(experts: nn.Module, degree: int) -> dict[nn.Parameter, Shard]:
    placement = {}
    for p in experts.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placement[p] = Shard(expert_shard_dim(tuple(local.shape), degree))
    return placement


def block_inner_units(block: nn.Module, expert_parallel: bool) -> list[nn.Module]:
    """The submodules of one block that :func:`apply_fsdp` makes FSDP2 units of their own, inner before outer.

    With expert parallelism every MoE layer's ``experts`` (on the expert-FSDP mesh), then the MoE layer itself
    (router, shared experts); without it none (the block is one unit). Per-block compile
    (:func:`~kempnerforge.parallel.compile.apply_compile`) keeps these modules' calls out of compiled code:
    FSDP2's hooks run on them and cannot be traced.

    Args:
        block: one entry of ``model.layers`` (possibly wrapped by activation checkpointing).
        expert_parallel: ``ep > 1``.

    Returns:
        The modules, ``[experts_0, moe_0, experts_1, moe_1, ...]`` (empty without EP or MoE layers).
    """
    if not expert_parallel:
        return []
    return [unit for moe in block.modules() if is_moe_layer(moe) for unit in (moe.experts, moe)]


def _decoder_ends(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None]:
    """(token embedding, final norm, output head) of a decoder, a VLM's backbone or a pipeline stage
    (None where the module is absent: a middle stage has none of them)."""
    owner = getattr(model, "backbone", model)
    return tuple(getattr(owner, name, None) for name in ("tok_embeddings", "norm", "output"))


def _is_tied(embedding: nn.Module | None, head: nn.Module | None) -> bool:
    return embedding is not None and head is not None and head.weight is embedding.weight


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``model`` with FSDP2 in place, unit by unit (see the module docstring for the layout).

    On a one-rank mesh with fp32 parameters FSDP2 has nothing to shard or reduce and would only copy
    every parameter and gradient through its flat buffers (~10% of a CPU step at world size 1), so the
    step is recorded and the model left as is, as torchtitan does when ``dp_shard == 1``. With bf16
    parameters it still wraps, because its ``MixedPrecisionPolicy`` is what casts them.

    Args:
        model: a module with ``layers`` (``nn.ModuleDict`` or ``nn.ModuleList`` of blocks); may be on meta.
            Its ``tok_embeddings``, ``norm`` and ``output`` (on the model, or on its ``backbone``; any may
            be None, as on pipeline stages) become the units above; tied when ``output.weight is
            tok_embeddings.weight``. Optionally ``fsdp_units()``: further submodules, each its own unit,
            listed inner before outer (e.g. a VLM's encoder layers, then the encoder, then the connector).
        mesh: 1-D ``dp_shard`` mesh, or 2-D ``(dp_replicate, dp_shard)`` for HSDP.
        param_dtype: compute dtype of unsharded parameters (bf16 for mixed precision).
        reduce_dtype: dtype of gradient reduce-scatter / all-reduce (keep fp32).
        reshard_after_forward: free unsharded parameters after forward (ZeRO-3); False keeps them
            until backward (ZeRO-2-like, more memory, one all-gather fewer).
        expert_mesh: with expert parallelism, the ``dp_shard_mod_ep`` mesh, or ``(dp_replicate,
            dp_shard_mod_ep)`` with HSDP (``ParallelMesh.expert_fsdp``; experts replicated over
            ``dp_replicate``): each MoE layer's experts become their own unit on it, and
            the MoE layer (router, shared experts) another unit on ``mesh``, separate from the block's
            attention unit (one unit per block would interleave the EP all-to-alls with its
            reduce-scatter and deadlock). Without it, expert weights are sharded with the block over
            ``mesh``. Either way on the dim :func:`expert_shard_dim` picks.

    Raises:
        TransformOrderError: FSDP2 already applied (see :mod:`kempnerforge.parallel.order`).
    """
    record_step(model, "fsdp")
    if mesh.size() == 1 and param_dtype == torch.float32 and expert_mesh is None:
        return
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def shard(unit: nn.Module | list[nn.Module], on: DeviceMesh = mesh, reshard: bool = reshard_after_forward,
              **kw) -> None:  # fmt: skip
        fully_shard(unit, mesh=on, mp_policy=mp, reshard_after_forward=reshard, **kw)

    # Other units the model declares (a VLM's encoder layers, encoder, connector), before its blocks.
    for unit in model.fsdp_units() if isinstance(model, DeclaresFSDPUnits) else []:
        shard(unit)
    embedding, norm, head = _decoder_ends(model)
    if _is_tied(embedding, head):
        # Used first and last in forward: resharding at the group's post-forward (the end of forward)
        # would only all-gather it again for the head's backward.
        shard([m for m in (embedding, norm, head) if m is not None], reshard=False)
    else:
        if embedding is not None:
            # First in forward, last in backward: freed for the whole step in between.
            shard(embedding)
        if head is not None:
            # Last in forward, first in backward: resharding would only all-gather it again at once.
            shard([m for m in (norm, head) if m is not None], reshard=False)
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    dense_degree = mesh.size(mesh.ndim - 1)  # HSDP shards over the last (dp_shard) dim
    for i, block in enumerate(blocks):
        # The last block's parameters are all-gathered again right away by the head's backward, so keep them.
        reshard = reshard_after_forward and i < len(blocks) - 1
        if expert_mesh is None:
            shard(block, reshard=reshard, shard_placement_fn=_expert_placements(block, dense_degree))
            continue
        for unit in block_inner_units(block, expert_parallel=True):
            if is_moe_layer(unit):
                shard(unit)
                continue
            placements = _expert_placements_of(unit, expert_mesh.size(expert_mesh.ndim - 1))  # HSDP: dp_shard_mod_ep
            shard(unit, on=expert_mesh, shard_placement_fn=placements)
        shard(block, reshard=reshard)
    shard(model)


def is_fsdp_applied(model: nn.Module) -> bool:
    """True when the FSDP2 step already ran on ``model`` (so ``configure_model`` re-runs do not re-wrap)."""
    return isinstance(model, FSDPModule) or "fsdp" in applied_steps(model)
