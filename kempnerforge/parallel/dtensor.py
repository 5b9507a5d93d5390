"""Small DTensor helpers shared by the model wrapper, checks and tests."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def to_full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``t.full_tensor()`` for a DTensor (a collective on its mesh), else ``t`` itself.

    Under :class:`kempnerforge.strategies.KempnerStrategy` parameters are DTensors when FSDP2 or TP
    applied (any dp or tp degree > 1, or bf16 parameters) and plain tensors otherwise.
    """
    return t.full_tensor() if isinstance(t, DTensor) else t
