"""A checkpoint file read and verified in one pass: every block a read touches is hashed from the bytes read and
compared with its writer's record before the bytes are handed on.

DCP reads a storage item by seeking to it and letting ``torch.load`` read its zip archive (the directory at its
end, then its header and data records; the tensor data with one ``readinto`` into the new tensor's storage). A
:class:`VerifiedFile` serves those reads: blocks that a read covers whole go straight from the file into the
caller's buffer and are hashed there; a block that a read covers in part (an item's first and last block, shared
with its neighbours) is read once, verified, and kept in a small cache, so with items read in file order every
byte is read and hashed once (sequential reads: the kernel's own readahead keeps the disk busy; asking for more
with ``posix_fadvise(POSIX_FADV_WILLNEED)`` measured slower here).
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kempnerforge.checkpoint.checksum import block_reason, new_hasher
from kempnerforge.checkpoint.errors import CorruptCheckpointError

_CACHED_BLOCKS = 4  # partially read blocks kept (an item's first and last, the next item's first)
_DIRECT = 256 << 20  # most bytes one direct read asks the file for


class VerifiedFile(io.RawIOBase):
    """A seekable binary reader of ``path`` whose every byte handed out was verified against its record.

    Args:
        path: the file (already checked to have the recorded size).
        entry: its record: ``{"size", "block_size", "blocks": [hex digest per block]}``.
        algorithm: the record's hash algorithm.
        corrupt: builds the error for a file and a reason (the caller's wording).

    Raises:
        CorruptCheckpointError: from a read, when a block fails its checksum or the file ends early (names the
            file and the block's bytes).
    """

    def __init__(
        self, path: Path, entry: dict[str, Any], algorithm: str, corrupt: Callable[[Path, str], CorruptCheckpointError]
    ) -> None:
        super().__init__()
        self.path = path
        self.entry, self.algorithm, self._corrupt = entry, algorithm, corrupt
        self.size, self.block = int(entry["size"]), int(entry["block_size"])
        self._fd = os.open(path, os.O_RDONLY)
        self._pos = 0
        self._cache: OrderedDict[int, memoryview] = OrderedDict()  # block index -> its bytes (a reused buffer)

    # -- io.RawIOBase --------------------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        done = 0
        while done < n:
            pos = self._pos + done
            index, start = divmod(pos, self.block)
            whole = 0 if start else min(n - done, self.size - pos) // self.block
            whole = min(whole, _DIRECT // self.block)
            if whole and index not in self._cache:
                self._read_blocks(index, whole, out[done : done + whole * self.block])
                done += whole * self.block
                continue
            block = self._cached(index)
            take = min(len(block) - start, n - done)
            out[done : done + take] = block[start : start + take]
            done += take
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
            self._cache.clear()
        super().close()

    # -- blocks --------------------------------------------------------------------------------------

    def _span(self, index: int) -> tuple[int, int]:
        lo = index * self.block
        return lo, min(lo + self.block, self.size)

    def _read_exact(self, offset: int, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n == 0:
                raise self._corrupt(self.path, f"ends at byte {offset + got}; {self.size} were written")
            got += n

    def _verify(self, index: int, data: memoryview) -> None:
        hasher = new_hasher(self.algorithm)
        hasher.update(data)
        digest = hasher.hexdigest()
        blocks = self.entry["blocks"]
        if index >= len(blocks) or digest != blocks[index]:
            raise self._corrupt(self.path, block_reason(self.entry, index, digest, self.algorithm))

    def _read_blocks(self, index: int, count: int, view: memoryview) -> None:
        """Blocks ``index .. index + count - 1`` (whole ones) straight into ``view``, each verified there."""
        self._read_exact(index * self.block, view)
        for k in range(count):
            self._verify(index + k, view[k * self.block : (k + 1) * self.block])

    def _cached(self, index: int) -> memoryview:
        """Block ``index``, read and verified once while it stays among the last few partly read blocks (their
        buffers are reused: no allocation, no page faults, per block)."""
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        lo, hi = self._span(index)
        if len(self._cache) >= _CACHED_BLOCKS:
            _, old = self._cache.popitem(last=False)
            buffer = old.obj
        else:
            buffer = bytearray(self.block)
        view = memoryview(buffer)[: hi - lo]
        self._read_exact(lo, view)
        self._verify(index, view)
        self._cache[index] = view
        return view
