"""Read only this rank's shard of each tensor from a ``save_pretrained`` folder of safetensors files.

Each file is opened once per reader, on first use (:class:`~kempnerforge.model.safetensors_file.SafetensorsFile`:
header parsed once, data memory-mapped), and each block a rank keeps (FSDP2 ``Shard(0)`` / ``Shard(1)``, TP, uneven
chunks: one block; ``_StridedShard``: one block per stride) is copied from a view of the mapping, whose pages are
then unmapped: a rank touches the bytes of the elements it keeps, never a whole file or state dict, and its
resident memory stays at its shard.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kempnerforge.model.safetensors_file import SafetensorsFile
from kempnerforge.parallel.dtensor import index_runs, local_part, shard_indices

if TYPE_CHECKING:
    from kempnerforge.checkpoint.hf_source import HFSource

_PIECE = 16 << 20  # bytes of the file mapped at a time by one copy (then unmapped)


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` files (``model.safetensors.index.json`` when present), by key.

    Use as a context manager: each file is opened at most once, when a tensor of it is first needed (with an index;
    without one every file's header is read up front, to learn its keys), and closed on exit. A pipeline stage or an
    expert-parallel rank opens only the files that hold its tensors.

    Args:
        path: a ``save_pretrained`` folder.

    Raises:
        FileNotFoundError: the folder has no ``.safetensors`` file (names what it holds instead).
        ValueError: without an index, a file whose header does not parse or does not cover its data
            (:class:`~kempnerforge.model.safetensors_file.SafetensorsFile`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        self._open: dict[Path, SafetensorsFile] = {}
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file = {key: self.path / name for key, name in weight_map.items()}
        else:
            self._file = {key: f for f in sorted(self.path.glob("*.safetensors")) for key in self._opened(f).keys()}
        if not self._file:
            held = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
            raise FileNotFoundError(
                f"{self.path} has no .safetensors weights (it holds {held}); save it with transformers' "
                "save_pretrained (safetensors is its default format)."
            )

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every file opened so far (a later read opens it again)."""
        for file in self._open.values():
            file.close()
        self._open.clear()

    def _opened(self, file: Path) -> SafetensorsFile:
        if file not in self._open:
            self._open[file] = SafetensorsFile(file)
        return self._open[file]

    def open_all(self) -> None:
        """Open every file and check that it holds the keys the index places in it (preflight: headers only).

        Raises:
            FileNotFoundError / OSError: a file the index names cannot be opened.
            ValueError: a file's header does not parse or does not cover its data.
            KeyError: a key of the index is not in the file it names.
        """
        for key, file in self._file.items():
            if key not in self._opened(file).keys():
                raise KeyError(f"{file} has no tensor {key!r} (the index places it there)")

    def _handle(self, key: str) -> SafetensorsFile:
        file = self._opened(self._file[key])
        if key not in file.keys():
            raise KeyError(f"{file.path} has no tensor {key!r} (the index places it there)")
        return file

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of the folder's tensor ``key`` (from its file's header; KeyError when absent)."""
        return self._handle(key).shape(key)

    def _copy_(self, dst: torch.Tensor, key: str, index: tuple, rows: torch.Tensor | None = None) -> None:
        """``dst.copy_(tensor[index])`` (``[index][rows]`` with a row selection) of the folder's tensor ``key``, cast to
        ``dst``'s dtype; the pages the block spans are unmapped afterwards."""
        file = self._handle(key)
        block = file.view(key)[index]
        if rows is not None or block.ndim == 0:
            dst.copy_(block if rows is None else block[rows])
            file.drop(block)
            return
        # Copied in pieces of at most _PIECE bytes of the file (whole rows of dim 0), each unmapped once copied: a
        # column block (TP's Shard(1)) spans every row of the tensor, and would otherwise map all of it at once.
        step = max(1, _PIECE // max(1, block.stride(0) * block.element_size()))
        for r in range(0, block.shape[0], step):
            piece = block[r : r + step]
            dst[r : r + step].copy_(piece)
            file.drop(piece)

    def keys(self) -> set[str]:
        """Every tensor key of the folder."""
        return set(self._file)

    @torch.no_grad()
    def read_shard_(self, tensor: torch.Tensor, key: str) -> None:
        """Fill ``tensor`` (plain or DTensor: this rank's shard only) with the folder's tensor ``key``, cast to its
        dtype, reading only the elements this rank stores.

        Raises:
            KeyError: no tensor ``key`` in the folder.
            ValueError: its shape differs from ``tensor``'s global shape (names both).
        """
        shape = self.shape(key)
        if shape != tuple(tensor.shape):
            raise ValueError(f"{self.path}: tensor {key!r} has shape {shape}, the model expects {tuple(tensor.shape)}")
        local = local_part(tensor)
        if tensor.ndim == 0:
            self._copy_(local, key, ())
            return
        if local.numel() == 0:
            return
        runs = [index_runs(i) for i in shard_indices(tensor)]
        for block in itertools.product(*runs):
            dst = tuple(slice(lo, lo + n) for lo, _, n in block)
            self._copy_(local[dst], key, tuple(slice(g, g + n) for _, g, n in block))

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
        missing = [key for key in source.keys if key not in self._file]
        if missing:
            raise KeyError(f"{self.path} has no tensor {missing[0]!r}")
        for key in source.keys:
            have = self.shape(key)
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
        missing = [key for key in source.keys if key not in self._file]
        if missing:
            raise KeyError(f"{self.path} has no tensor {missing[0]!r}")
        have = [self.shape(key) for key in source.keys]
        if any(h[1:] != tuple(shape[1:]) for h in have) or sum(h[0] for h in have) != shape[0]:
            raise ValueError(
                f"{self.path}: tensors {list(source.keys)} of shapes {have} cannot be concatenated into {tuple(shape)}"
            )
        if len(source.rows) != shape[0] or source.offset:
            raise ValueError(f"{self.path}: a concat source needs {shape[0]} rows and no offset")

    def _read_concat_(self, dst: torch.Tensor, want: list[int], source: HFSource, cols: tuple) -> None:
        """Fill ``dst`` (rows x ...) with the rows ``want`` of the concatenation of ``source.keys``: per key, the rows
        it contributes as strided runs (:func:`_strided_runs`), each copied view to view (no temporary copy)."""
        want_t = torch.tensor(want)
        start = 0
        for key in source.keys:
            n = self.shape(key)[0]
            sel = ((want_t >= start) & (want_t < start + n)).nonzero().flatten()
            for d0, d_step, s0, s_step, count in _strided_runs(sel, want_t[sel] - start):
                src = (slice(s0, s0 + s_step * (count - 1) + 1, s_step), *cols)
                self._copy_(dst[d0 : d0 + d_step * (count - 1) + 1 : d_step], key, src)
            start += n

    @torch.no_grad()
    def read_source_(self, tensor: torch.Tensor, source: HFSource) -> None:
        """Fill ``tensor`` (plain or DTensor: this rank's shard only) from ``source``: a block of one folder tensor
        or a stack of them along dim 0 (:class:`~kempnerforge.checkpoint.hf_source.HFSource`), cast to its dtype.

        Reads only the elements this rank stores: per run of its global indices one slice of the folder tensor
        (of each stacked key whose index this rank keeps: an expert-parallel rank reads only its own experts); with
        a row permutation (``source.rows``) the slice spans the rows the run's rows come from (their bounding range).
        Host memory beyond the shard itself: the file pages of one slice (unmapped once it is copied), and with a row
        permutation one slice buffer.

        Raises:
            KeyError: a key of ``source`` is not in the folder (names it).
            ValueError: the folder tensor cannot hold the block (names the key, both shapes and the offset), or
                ``source.rows`` is not a permutation of dim 0.
        """
        self.check_source(tuple(tensor.shape), source)
        local = local_part(tensor)
        rest = tuple(tensor.shape[1:]) if source.stacked else tuple(tensor.shape)
        offset = source.offset or (0,) * len(rest)
        if local.numel() == 0:
            return
        runs = [index_runs(i) for i in shard_indices(tensor)]
        for block in itertools.product(*runs):
            dst = tuple(slice(lo, lo + n) for lo, _, n in block)
            if source.concat:
                (_, g0, n0), tail = block[0], block[1:]
                cols = tuple(slice(g, g + n) for _, g, n in tail)
                self._read_concat_(local[dst], list(source.rows[g0 : g0 + n0]), source, cols)
                continue
            if not source.stacked:
                src = tuple(slice(g + o, g + o + n) for (_, g, n), o in zip(block, offset, strict=True))
                if source.rows:  # our rows [g, g + n) are the block rows rows[g: g + n]: read their bounding range
                    want = torch.tensor(source.rows[block[0][1] : block[0][1] + block[0][2]])
                    lo, hi = int(want.min()), int(want.max()) + 1
                    src = (slice(lo + offset[0], hi + offset[0]), *src[1:])
                    self._copy_(local[dst], source.key, src, rows=want - lo)
                    continue
                self._copy_(local[dst], source.key, src)
                continue
            (lo0, g0, n0), tail = block[0], block[1:]
            src = tuple(slice(g + o, g + o + n) for (_, g, n), o in zip(tail, offset, strict=True))
            for j in range(n0):
                self._copy_(local[(lo0 + j, *dst[1:])], source.keys[g0 + j], src)


def _strided_runs(dst_rows: torch.Tensor, src_rows: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
    """Split a row mapping ``dst_rows[i] <- src_rows[i]`` (``dst_rows`` increasing) into runs in which both advance
    by a constant positive step: ``(dst_start, dst_step, src_start, src_step, count)`` each, so every run is one
    strided view on each side (a fused ``w13`` shard: one run per key, the gate rows every other row of ours; a
    ``wqkv`` shard: one run per KV group and key)."""
    dst, src = dst_rows.tolist(), src_rows.tolist()
    steps = [(dst[k + 1] - dst[k], src[k + 1] - src[k]) for k in range(len(dst) - 1)]
    runs, i = [], 0
    while i < len(dst):
        count, step = 1, (1, 1)
        if i < len(steps) and steps[i][1] > 0:
            step, count = steps[i], 2
            while i + count - 1 < len(steps) and steps[i + count - 1] == step:
                count += 1
        runs.append((dst[i], step[0], src[i], step[1], count))
        i += count
    return runs
