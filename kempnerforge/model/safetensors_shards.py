"""Read only this rank's shard of each tensor from a ``save_pretrained`` folder of safetensors files.

``safetensors.safe_open`` memory-maps a file and ``get_slice(key)[rows, cols, ...]`` reads just the requested
block, so a rank touches the bytes of the elements it keeps (FSDP2 ``Shard(0)`` / ``Shard(1)``, TP, uneven chunks:
one block; ``_StridedShard``: one block per stride) and never a whole file or state dict.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kempnerforge.parallel.dtensor import index_runs, local_part, shard_indices

if TYPE_CHECKING:
    from kempnerforge.checkpoint.hf_source import HFSource


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
        self._file = {key: f for f, h in zip(files, self._handles, strict=True) for key in h.keys()}

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

    def check_source(self, shape: tuple[int, ...], source: HFSource) -> None:
        """``source`` can fill a tensor of global ``shape``: its keys are in the folder and their shapes (read from the
        file headers only, no tensor data) hold the block. What :meth:`read_source_` checks before it reads.

        Raises:
            KeyError: a key of ``source`` is not in the folder (names it).
            ValueError: a folder tensor cannot hold the block (names the key, both shapes and the offset), or a
                stack has another number of keys than ``shape[0]``, or ``source.rows`` is not a permutation of dim 0.
        """
        if source.concat:
            self._check_concat(shape, source)
            return
        rest = tuple(shape[1:]) if source.stacked else tuple(shape)
        offset = source.offset or (0,) * len(rest)
        if source.stacked and len(source.keys) != shape[0]:
            raise ValueError(f"{self.path}: {len(source.keys)} stacked keys for dim 0 of size {shape[0]}")
        if source.rows and (source.stacked or sorted(source.rows) != list(range(shape[0]))):
            raise ValueError(f"{self.path}: rows of {source.key!r} are not a permutation of dim 0 ({shape[0]})")
        missing = [key for key in source.keys if key not in self._where]
        if missing:
            raise KeyError(f"{self.path} has no tensor {missing[0]!r}")
        for key in source.keys:
            have = tuple(self._where[key].get_slice(key).get_shape())
            exact = not source.offset  # a rename: the same shape; a block: inside the folder tensor
            fits = len(have) == len(rest) and all(o + n <= s for o, n, s in zip(offset, rest, have, strict=True))
            if not fits or (exact and have != rest):
                raise ValueError(
                    f"{self.path}: tensor {key!r} has shape {have}, which cannot hold a block of shape {rest} "
                    f"at offset {offset}"
                )

    def _check_concat(self, shape: tuple[int, ...], source: HFSource) -> None:
        """A ``concat`` source: every key present, the same trailing dims as ``shape``, dim 0 sizes summing to
        ``shape[0]``, ``rows`` of that length."""
        missing = [key for key in source.keys if key not in self._where]
        if missing:
            raise KeyError(f"{self.path} has no tensor {missing[0]!r}")
        have = [tuple(self._where[key].get_slice(key).get_shape()) for key in source.keys]
        if any(h[1:] != tuple(shape[1:]) for h in have) or sum(h[0] for h in have) != shape[0]:
            raise ValueError(
                f"{self.path}: tensors {list(source.keys)} of shapes {have} cannot be concatenated into {tuple(shape)}"
            )
        if len(source.rows) != shape[0] or source.offset:
            raise ValueError(f"{self.path}: a concat source needs {shape[0]} rows and no offset")

    def _read_concat_(self, dst: torch.Tensor, want: list[int], source: HFSource, block_of, cols: tuple) -> None:
        """Fill ``dst`` (rows x ...) with the rows ``want`` of the concatenation of ``source.keys``: per key one slice
        over the bounding range of the rows it contributes."""
        want_t = torch.tensor(want)
        start = 0
        for key in source.keys:
            n = self._where[key].get_slice(key).get_shape()[0]
            sel = ((want_t >= start) & (want_t < start + n)).nonzero().flatten()
            if sel.numel():
                local_rows = want_t[sel] - start
                lo, hi = int(local_rows.min()), int(local_rows.max()) + 1
                dst[sel] = block_of(key)[(slice(lo, hi), *cols)][local_rows - lo].to(dst.dtype)
            start += n

    @torch.no_grad()
    def read_source_(self, tensor: torch.Tensor, source: HFSource) -> None:
        """Fill ``tensor`` (plain or DTensor: this rank's shard only) from ``source``: a block of one folder tensor
        or a stack of them along dim 0 (:class:`~kempnerforge.checkpoint.hf_source.HFSource`), cast to its dtype.

        Reads only the elements this rank stores: per run of its global indices one slice of the folder tensor
        (of each stacked key whose index this rank keeps: an expert-parallel rank opens only its own experts); with
        a row permutation (``source.rows``) the slice spans the rows the run's rows come from (their bounding range). Host
        memory beyond the shard itself: one slice buffer and the file pages of one tensor's slices at a time.

        Raises:
            KeyError: a key of ``source`` is not in the folder (names it).
            ValueError: the folder tensor cannot hold the block (names the key, both shapes and the offset), or
                ``source.rows`` is not a permutation of dim 0.
        """
        self.check_source(tuple(tensor.shape), source)
        local = local_part(tensor)
        rest = tuple(tensor.shape[1:]) if source.stacked else tuple(tensor.shape)
        offset = source.offset or (0,) * len(rest)
        slices: dict[str, object] = {}
        if local.numel() == 0:
            return
        runs = [index_runs(i) for i in shard_indices(tensor)]

        def block_of(key: str) -> object:
            if key not in slices:
                # A handle of its own, dropped on return: the file pages this read maps leave the rank's RSS with it
                # (the folder's long-lived handles would keep every page read so far resident: as much again as
                # the rank's shard).
                slices[key] = safe_open(str(self._file[key]), framework="pt").get_slice(key)
            return slices[key]

        for block in itertools.product(*runs):
            dst = tuple(slice(lo, lo + n) for lo, _, n in block)
            if source.concat:
                (_, g0, n0), tail = block[0], block[1:]
                cols = tuple(slice(g, g + n) for _, g, n in tail)
                self._read_concat_(local[dst], list(source.rows[g0 : g0 + n0]), source, block_of, cols)
                continue
            if not source.stacked:
                src = tuple(slice(g + o, g + o + n) for (_, g, n), o in zip(block, offset, strict=True))
                if source.rows:  # our rows [g, g + n) are the block rows rows[g: g + n]: read their bounding range
                    want = torch.tensor(source.rows[block[0][1] : block[0][1] + block[0][2]])
                    lo, hi = int(want.min()), int(want.max()) + 1
                    src = (slice(lo + offset[0], hi + offset[0]), *src[1:])
                    local[dst].copy_(block_of(source.key)[src][want - lo])
                    continue
                local[dst].copy_(block_of(source.key)[src])
                continue
            (lo0, g0, n0), tail = block[0], block[1:]
            src = tuple(slice(g + o, g + o + n) for (_, g, n), o in zip(tail, offset, strict=True))
            for j in range(n0):
                local[(lo0 + j, *dst[1:])].copy_(block_of(source.keys[g0 + j])[src])
