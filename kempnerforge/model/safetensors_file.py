"""One safetensors file opened once: its header parsed, its data memory-mapped, its tensors zero-copy views.

``safetensors.safe_open`` keeps every page a read touched mapped (resident) for the handle's lifetime, so a rank
that reads its shard of every tensor through one long-lived handle ends up holding the file's pages besides its
shard, and a handle per key re-reads and re-parses the header per key (1 ms per key for a 600-tensor file, 51 ms
for a 20,000-tensor one). :class:`SafetensorsFile` opens the file once per reader and hands out views of the
mapping; :meth:`SafetensorsFile.drop` unmaps the pages under a view once its elements are copied
(``madvise(MADV_DONTNEED)``), so resident memory stays at what the caller keeps. The pages stay in the kernel's
page cache, shared by the ranks of a node that read the same file.

Format (https://github.com/huggingface/safetensors, "Format"): an unsigned little-endian 64-bit header size ``N``,
``N`` bytes of JSON ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data buffer, which the tensors' byte ranges cover exactly (validated here as safetensors validates it).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path

import torch

#: safetensors dtype names -> torch dtypes (the ones torch has; sub-byte floats are refused by name).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header (100 MB)
_ALIGN = 2 << 20  # bytes: pages are unmapped in aligned 2 MiB ranges (a PMD-sized folio), see SafetensorsFile.drop


class SafetensorsFile:
    """A safetensors file: its keys, shapes and dtypes from the header, its tensors as views of one read-only mapping.

    One ``open`` per instance (the header is read with ``pread`` on that descriptor, the data mapped from it);
    :meth:`close` lets the mapping go.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        OSError: the file cannot be opened (FileNotFoundError names it).
        ValueError: the header does not parse, names an unknown dtype, or its tensors do not cover the data buffer
            exactly (a truncated or grown file; names the file).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self._entries, self._data_start = self._read_header(fd, size)
            # ACCESS_COPY (MAP_PRIVATE): a writable buffer for torch.frombuffer; nothing ever writes to it. The
            # mapping holds the file by itself (mmap keeps a duplicate of the descriptor), so ours closes now.
            self._map: mmap.mmap | None = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)  # its data_ptr locates a view's pages
        self._size = size

    def _read_header(self, fd: int, size: int) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
        """``{key: (dtype, shape, begin, end)}`` (offsets into the data buffer) and the data buffer's file offset."""
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{self.path} is not a safetensors file: {size} bytes, the header size alone needs 8")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{self.path} has a header of {n} bytes in a file of {size} (truncated or not safetensors)"
            )
        try:
            header = json.loads(os.pread(fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{self.path}: its safetensors header does not parse ({err})") from err
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: its safetensors header does not parse (a JSON object is needed)")
        header.pop("__metadata__", None)
        entries = {}
        for key, info in header.items():
            try:
                name, shape, (begin, end) = info["dtype"], tuple(int(n) for n in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"{self.path}: its safetensors header does not parse (tensor {key!r}: {err!r})"
                ) from err
            dtype = DTYPES.get(name)
            if dtype is None:
                raise ValueError(f"{self.path}: tensor {key!r} has dtype {name!r}, not one of {sorted(DTYPES)}")
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{self.path}: tensor {key!r} of shape {shape} ({dtype}) spans {end - begin} bytes")
            entries[key] = (dtype, shape, begin, end)
        spans = sorted((b, e) for _, _, b, e in entries.values())
        covered = 0
        for begin, end in spans:
            if begin != covered:
                raise ValueError(f"{self.path}: its tensors' data overlap or leave a gap at byte {covered}")
            covered = end
        if 8 + n + covered != size:
            raise ValueError(
                f"{self.path}: the data buffer is not fully covered: the header places {covered} bytes of tensor "
                f"data, the file holds {size - 8 - n} (truncated or grown)"
            )
        return entries, 8 + n

    def keys(self) -> list[str]:
        """The file's tensor keys, in header order."""
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of tensor ``key`` (from the header; KeyError when absent)."""
        return self._entries[key][1]

    def view(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as a view of the mapping, of its own dtype and shape (no data read until it is used).

        Raises:
            KeyError: no tensor ``key`` in the file.
        """
        dtype, shape, begin, _ = self._entries[key]
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        count = math.prod(shape)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + begin).view(shape)

    def drop(self, view: torch.Tensor) -> None:
        """Unmap the pages under ``view`` (a view, or a view of a view, from :meth:`view`): resident memory falls by
        what reading it mapped; the next access re-reads them from the page cache. Safe on pages a neighbouring
        tensor shares (they are mapped again on use)."""
        if view.numel() == 0 or self._map is None:
            return
        start = view.data_ptr() - self._base.data_ptr()
        extent = sum((s - 1) * st for s, st in zip(view.shape, view.stride(), strict=True)) + 1
        # Widened to _ALIGN boundaries: a page fault maps the pages around it too (the kernel's fault-around, and
        # whole large folios of the page cache), which would otherwise stay resident, a little per view.
        lo = start - start % _ALIGN
        hi = min(-(-(start + extent * view.element_size()) // _ALIGN) * _ALIGN, self._size)
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Let go of the mapping: it is unmapped (and the file closed) once no view of it is left. Never unmapped
        under a view a caller kept (``torch.frombuffer`` holds the mapping object, not a lock on it)."""
        self._map = None
        self._base = None
