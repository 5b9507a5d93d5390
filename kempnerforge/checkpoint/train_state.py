"""Per-rank training state that Lightning's rank-0 ``meta.pt`` cannot hold: RNG streams and dataloader position.

Lightning writes loop state (which includes each stateful dataloader's position) from rank 0 only,
so every other data-parallel rank would resume from rank 0's position. Here each rank moves its own
dataloader state and RNG state into ``rank_state`` before saving, and puts them back on load.
Stored as plain tensors, ints, lists and strings so ``torch.load(weights_only=True)`` reads them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_LOADER_KEYS = ("loops", "fit_loop", "state_dict", "combined_loader")


class DataParallelMismatchError(RuntimeError):
    """A dataloader position saved under one data-parallel degree, resumed under another."""


def collect_rng_state() -> dict[str, Any]:
    """RNG state of torch (CPU and CUDA), numpy and Python's ``random`` for this process, pickle-free."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": [py_version, list(py_internal), py_gauss],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`collect_rng_state` (CUDA streams only when the device count matches)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("torch.cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))


def _loader_parent(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    node: Any = checkpoint
    for key in _LOADER_KEYS[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def split_rank_state(checkpoint: dict[str, Any], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """Move this rank's dataloader state out of ``checkpoint`` and return it with RNG state.

    Returns:
        ``{"rng", "dataloader", "dp_rank", "dp_size"}`` for ``rank_*.pt``.
    """
    parent = _loader_parent(checkpoint)
    loader = parent.pop(_LOADER_KEYS[-1], None) if parent is not None else None
    return {"rng": collect_rng_state(), "dataloader": loader, "dp_rank": dp_rank, "dp_size": dp_size}


def merge_rank_state(checkpoint: dict[str, Any], rank_state: dict[str, Any] | None, dp_rank: int, dp_size: int) -> None:
    """Restore RNG and put this rank's dataloader state back where Lightning's fit loop reads it.

    Raises:
        DataParallelMismatchError: the checkpoint's dataloader state was saved with another
            data-parallel degree, or this rank has no saved state; remapping sample positions across
            degrees is not exact, so it is refused rather than silently restarting the data.
    """
    if rank_state is None:
        raise DataParallelMismatchError(
            f"No per-rank state for this rank (dp_rank={dp_rank}) in the checkpoint: it was written by fewer "
            f"ranks (world_size={checkpoint.get('world_size')}). Resume with the same data-parallel degree, or "
            "load weights only."
        )
    saved = rank_state.get("dp_size")
    if rank_state.get("dataloader") is not None and saved != dp_size:
        raise DataParallelMismatchError(
            f"The dataloader position was saved with a data-parallel degree of {saved} but this run has "
            f"dp={dp_size}: the data order would change. Resume with dp_replicate*dp_shard={saved}."
        )
    restore_rng_state(rank_state["rng"])
    parent = _loader_parent(checkpoint)
    if parent is not None and rank_state.get("dataloader") is not None:
        parent[_LOADER_KEYS[-1]] = rank_state["dataloader"]
