"""FSDP2 (``fully_shard``) per transformer block, then the root: the last step of the chain.

Follows torchtitan v0.2 ``apply_fsdp`` and the FSDP2 design (PyTorch RFC #114299): one unit per
block so all-gathers overlap the previous block's compute; the root unit holds the embedding,
final norm and output head, which keeps tied embedding and head in one unit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from kempnerforge.parallel.order import applied_steps, record_step

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


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``model`` with FSDP2 in place: the units ``model.fsdp_units()`` declares (if any), each
    block of ``model.layers``, then the root.

    On a one-rank mesh with fp32 parameters FSDP2 has nothing to shard or reduce and would only copy
    every parameter and gradient through its flat buffers (~10% of a CPU step at world size 1), so the
    step is recorded and the model left as is, as torchtitan does when ``dp_shard == 1``. With bf16
    parameters it still wraps, because its ``MixedPrecisionPolicy`` is what casts them.

    Args:
        model: a module with ``layers`` (``nn.ModuleDict`` or ``nn.ModuleList`` of blocks); may be on meta.
            Optionally ``fsdp_units()``: further submodules, each its own unit, listed inner before outer
            (e.g. a VLM's encoder layers, then the encoder, then the connector).
        mesh: 1-D ``dp_shard`` mesh, or 2-D ``(dp_replicate, dp_shard)`` for HSDP.
        param_dtype: compute dtype of unsharded parameters (bf16 for mixed precision).
        reduce_dtype: dtype of gradient reduce-scatter / all-reduce (keep fp32).
        reshard_after_forward: free unsharded parameters after forward (ZeRO-3); False keeps them
            until backward (ZeRO-2-like, more memory, one all-gather fewer).
        expert_mesh: with expert parallelism, the ``dp_shard_mod_ep`` mesh
            (``ParallelMesh.expert_fsdp``): each MoE layer's experts become their own unit on it, and
            the MoE layer (router, shared experts) another unit on ``mesh``, separate from the block's
            attention unit (one unit per block would interleave the EP all-to-alls with its
            reduce-scatter and deadlock).

    Raises:
        TransformOrderError: FSDP2 already applied (see :mod:`kempnerforge.parallel.order`).
    """
    record_step(model, "fsdp")
    if mesh.size() == 1 and param_dtype == torch.float32 and expert_mesh is None:
        return
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Other units the model declares (a VLM's encoder layers, encoder, connector), before its blocks.
    for unit in model.fsdp_units() if callable(getattr(model, "fsdp_units", None)) else []:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    for i, block in enumerate(blocks):
        # The last block's parameters are all-gathered again right away by the root's backward, so keep them.
        last = i == len(blocks) - 1
        if expert_mesh is not None:
            for moe in (m for m in block.modules() if getattr(m, "is_moe", False)):
                fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
                fully_shard(moe, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def is_fsdp_applied(model: nn.Module) -> bool:
    """True when the FSDP2 step already ran on ``model`` (so ``configure_model`` re-runs do not re-wrap)."""
    return isinstance(model, FSDPModule) or "fsdp" in applied_steps(model)
