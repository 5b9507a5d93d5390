"""Read only this rank's shard of each tensor from a ``save_pretrained`` folder of safetensors files.

``safetensors.safe_open`` memory-maps a file and ``get_slice(key)[rows, cols, ...]`` reads just the requested
block, so a rank touches the bytes of the elements it keeps (FSDP2 ``Shard(0)`` / ``Shard(1)``, TP, uneven chunks:
one block; ``_StridedShard``: one block per stride) and never a whole file or state dict.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kempnerforge.parallel.dtensor import index_runs, local_part, shard_indices


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` files (``model.safetensors.index.json`` when present), by key.

    Use as a context manager; files are opened (memory-mapped, header only) on first use.

    Args:
        path: a ``save_pretrained`` folder.

    Raises:
        FileNotFoundError: the folder has no ``.safetensors`` file (names what it holds instead).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        files = (
            sorted({self.path / f for f in json.loads(index.read_text())["weight_map"].values()})
            if index.is_file()
            else sorted(self.path.glob("*.safetensors"))
        )
        if not files:
            held = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
            raise FileNotFoundError(
                f"{self.path} has no .safetensors weights (it holds {held}); save it with transformers' "
                "save_pretrained (safetensors is its default format)."
            )
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._where.clear()

    def keys(self) -> set[str]:
        """Every tensor key of the folder."""
        return set(self._where)

    @torch.no_grad()
    def read_shard_(self, tensor: torch.Tensor, key: str) -> None:
        """Fill ``tensor`` (plain or DTensor: this rank's shard only) with the folder's tensor ``key``, cast to its
        dtype, reading only the elements this rank stores.

        Raises:
            KeyError: no tensor ``key`` in the folder.
            ValueError: its shape differs from ``tensor``'s global shape (names both).
        """
        handle = self._where[key]
        source = handle.get_slice(key)
        shape = tuple(source.get_shape())
        if shape != tuple(tensor.shape):
            raise ValueError(f"{self.path}: tensor {key!r} has shape {shape}, the model expects {tuple(tensor.shape)}")
        local = local_part(tensor)
        if tensor.ndim == 0:
            local.copy_(handle.get_tensor(key))
            return
        if local.numel() == 0:
            return
        runs = [index_runs(i) for i in shard_indices(tensor)]
        for block in itertools.product(*runs):
            dst = tuple(slice(lo, lo + n) for lo, _, n in block)
            src = tuple(slice(g, g + n) for _, g, n in block)
            local[dst].copy_(source[src])
