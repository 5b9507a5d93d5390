"""DCP's read step for a local checkpoint, with each tensor read straight into the tensor it restores.

DCP's ``FileSystemReader.read_data`` ``torch.load``-s every stored item into a new tensor and copies the requested
region into its target: per byte restored, a fresh page (allocated and faulted in) and a second copy. On a CPU
that is most of a restore: 1.07 GB of fp32 model and AdamW state took 0.85 s with a warm or a cold page cache
alike, against 0.36 s for the disk to deliver it (``benchmarks/checkpoint_io.py``). :func:`read_plan` reads the
item's zip archive for its layout only (``torch.load(map_location="meta")``: dtype, shape, strides and where the
storage bytes start), and when the region the plan asks for is contiguous in the file and its target is a
contiguous CPU tensor of the same dtype and shape (every unsharded or FSDP2 ``Shard(0)`` restore), reads those
bytes with one ``readinto`` into the target's memory. Anything else (another dtype, a strided region or target,
a CUDA target, items with stream transforms, non-tensor items) is read as DCP reads it. Items are read in file
order, so each file is read front to back.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP's own reader narrows with
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from kempnerforge.checkpoint.errors import CorruptCheckpointError


def read_plan(reader: FileSystemReader, plan: LoadPlan, planner: LoadPlanner) -> None:
    """Fill ``planner``'s targets with the items of ``plan`` from ``reader``'s files (``reader.fs`` opens them,
    so its error naming and verification apply), in the order the plan lists them.

    Raises:
        CorruptCheckpointError: a file ends before a region the metadata places in it (names it); or whatever
            ``reader.fs``'s streams and ``torch.load`` raise.
    """
    per_file: dict[str, list[ReadItem]] = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for relative_path, items in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            layouts: dict[Any, tuple[torch.Tensor, int | None]] = {}  # per stored item: a meta tensor, its data
            for item in items:
                info = reader.storage_data[item.storage_index]
                direct = item.type == LoadItemType.TENSOR and not info.transform_descriptors
                if not (direct and _read_direct(stream, path, item, info, planner, layouts)):
                    _read_like_dcp(reader, stream, item, info, planner)


def _read_like_dcp(reader: FileSystemReader, stream: Any, item: ReadItem, info: Any, planner: LoadPlanner) -> None:
    """One item exactly as ``FileSystemReader.read_data`` reads it."""
    view = reader._slice_file(stream, info)
    source = reader.transforms.transform_load_stream(item, info.transform_descriptors or (), view)
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(source.read(-1)))
        return
    seekable = source if source.seekable() else io.BytesIO(source.read(-1))
    tensor = torch.load(seekable, map_location="cpu", weights_only=True)
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _read_direct(
    stream: Any, path: Any, item: ReadItem, info: Any, planner: LoadPlanner, layouts: dict[Any, Any]
) -> bool:
    """Read ``item`` into its target without an intermediate tensor; False (nothing read) when it cannot be."""
    if sys.byteorder != "little":  # torch.save writes native order; a big-endian reader byteswaps in torch.load
        return False
    if item.storage_index not in layouts:
        from torch.distributed.checkpoint.utils import _create_file_view

        meta = torch.load(_create_file_view(stream, info.offset, info.length), map_location="meta", weights_only=True)
        storage = meta.untyped_storage() if isinstance(meta, torch.Tensor) else None
        layouts[item.storage_index] = (meta, getattr(storage, "_checkpoint_offset", None))
    meta, data_offset = layouts[item.storage_index]
    if data_offset is None:
        return False
    source = narrow_tensor_by_index(meta, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    fits = target.device.type == "cpu" and target.dtype == source.dtype and target.shape == source.shape
    if not (fits and source.is_contiguous() and target.is_contiguous()):
        return False
    nbytes = source.numel() * source.element_size()
    if nbytes:
        start = info.offset + data_offset + source.storage_offset() * source.element_size()
        stream.seek(start)
        out = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < nbytes:
            n = stream.readinto(out[done:])
            if not n:
                raise CorruptCheckpointError(f"{path} ends at byte {start + done}; the DCP metadata reads on", path)
            done += n
    planner.commit_tensor(item, target)
    return True
