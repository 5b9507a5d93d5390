"""Sharding-invariant, RNG-state-independent parameter initialization.

Every parameter draws from its own CPU ``torch.Generator`` seeded from (seed, canonical FQN), so the
values depend only on the seed and the parameter's name: not on the global RNG, the device, the
order modules are visited, or how the parameter is sharded. The full tensor is generated on CPU
in fp32 and each rank copies in only its own shard, so an FSDP2/TP model initialized on N ranks
equals the same model initialized on one process.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrapper modules insert these components into FQNs (activation checkpointing, torch.compile,
# FSDP1); dropping them keeps the seed of a parameter the same with or without the wrapper.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without wrapper components, e.g. ``layers.0._checkpoint_wrapped_module.attention.wq.weight``
    -> ``layers.0.attention.wq.weight``."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS)


def param_seed(seed: int, fqn: str) -> int:
    """Deterministic 63-bit seed for one parameter from the run seed and its canonical FQN.

    Uses BLAKE2b (stable across processes and Python versions, unlike ``hash``).
    """
    digest = hashlib.blake2b(f"{seed}:{canonical_fqn(fqn)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (global-shape) tensor into ``param``, in place.

    If ``param`` is a DTensor (FSDP2 / TP sharded), only this rank's shard is copied:
    ``distribute_tensor(..., src_data_rank=None)`` slices ``full`` locally (no communication,
    uneven ``Shard(0)`` included) with the same chunking DTensor uses.

    Args:
        param: plain tensor or DTensor of global shape S (any dtype; ``full`` is cast).
        full: tensor of shape S, identical on every rank.

    Raises:
        ValueError: if the global shapes differ.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"copy_full_: full tensor shape {tuple(full.shape)} != param shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def trunc_normal_init_(param: torch.Tensor, fqn: str, seed: int, std: float) -> None:
    """Fill ``param`` from N(0, std**2) truncated at +-3 std, drawn from (seed, fqn) only.

    The full tensor is generated on CPU in fp32 with a private generator, then copied (shard-wise
    for DTensors) by :func:`copy_full_`.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, fqn))
    full = torch.empty(tuple(param.shape), dtype=torch.float32)
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    copy_full_(param, full)


@torch.no_grad()
def ones_init_(param: torch.Tensor) -> None:
    """Fill ``param`` (plain or DTensor) with ones; fill_ works on the local shard of a DTensor."""
    param.fill_(1.0)
