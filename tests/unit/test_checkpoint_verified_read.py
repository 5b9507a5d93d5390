"""Issue 30, item 3b: checkpoint files are hashed in blocks while written and verified while read, each rank
checking only the blocks it reads (``VerifiedFile``), and the small replicated items every rank reads are written
by rank 0 (``small_replicas_to_lowest_rank``). Oracles: ``xxhash`` over the file's bytes, the file's own bytes,
DCP's default planner."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from kempnerforge.checkpoint import checksum
from kempnerforge.checkpoint.checksum import BLOCK, Manifests, Record, new_hasher, write_manifest
from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
from kempnerforge.checkpoint.errors import CorruptCheckpointError
from kempnerforge.checkpoint.save_planner import SMALL, small_replicas_to_lowest_rank
from kempnerforge.checkpoint.verified_read import VerifiedFile
from kempnerforge.checkpoint.verify import describe_failure, verify_rank_files


def _blocks(data: bytes, block: int = BLOCK) -> list[str]:
    out = []
    for lo in range(0, len(data), block):
        h = new_hasher()
        h.update(data[lo : lo + block])
        out.append(h.hexdigest())
    return out


def _written(tmp_path: Path, data: bytes, name: str = "f.bin") -> tuple[Path, dict]:
    """``data`` written through a HashingStream in uneven pieces; the file and its record entry."""
    path, record = tmp_path / name, Record()
    with open(path, "wb") as raw, checksum.hashed(raw, path, record) as stream:
        rng = random.Random(0)
        pos = 0
        while pos < len(data):
            n = rng.choice([1, 7, 4096, BLOCK - 3, BLOCK + 5, 3 * BLOCK])
            stream.write(data[pos : pos + n])
            pos += n
    return path, record.files[name]


def test_blocks_written_equal_xxh3_of_each_block(tmp_path):
    data = os.urandom(3 * BLOCK + 12345)
    path, entry = _written(tmp_path, data)
    assert entry == {"size": len(data), "block_size": BLOCK, "blocks": _blocks(data)}
    assert checksum.file_blocks(path) == (len(data), _blocks(data))
    assert _written(tmp_path, b"", "empty.bin")[1]["blocks"] == []


def _corrupt(path: Path, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path} {reason}", path)


def test_reads_return_the_files_bytes_and_read_each_block_once_in_file_order(tmp_path, monkeypatch):
    data = os.urandom(5 * BLOCK + 777)
    path, entry = _written(tmp_path, data)
    reads: list[tuple[int, int]] = []
    preadv = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, bufs, off: (reads.append((off, len(bufs[0]))), preadv(fd, bufs, off))[1]
    )
    # Items back to back, read as torch.load reads a zip: the tail first, then the head, then the body in one readinto.
    cuts = [0, 100, BLOCK + 50, BLOCK + 60, 3 * BLOCK, 5 * BLOCK + 700, len(data)]
    with VerifiedFile(path, entry, checksum.ALGORITHM, _corrupt) as f:
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            f.seek(hi - min(20, hi - lo))
            assert f.read(min(20, hi - lo)) == data[hi - min(20, hi - lo) : hi]
            f.seek(lo)
            buf = bytearray(hi - lo)
            assert f.readinto(buf) == hi - lo and bytes(buf) == data[lo:hi]
    covered = sorted(reads)
    assert sum(n for _, n in covered) == len(data)  # every byte read once, verified
    assert all(a + n <= b for (a, n), (b, _) in zip(covered, covered[1:], strict=False))
    with VerifiedFile(path, entry, checksum.ALGORITHM, _corrupt) as f:  # random access reads the right bytes too
        rng = random.Random(1)
        for _ in range(50):
            lo = rng.randrange(len(data))
            n = rng.randrange(3 * BLOCK)
            f.seek(lo)
            assert f.read(n) == data[lo : lo + n]


def test_a_damaged_block_fails_only_the_reads_that_touch_it_naming_its_bytes(tmp_path):
    data = bytearray(os.urandom(4 * BLOCK))
    path, entry = _written(tmp_path, bytes(data))
    data[2 * BLOCK + 10] ^= 0x01
    path.write_bytes(bytes(data))
    with VerifiedFile(path, entry, checksum.ALGORITHM, _corrupt) as f:
        f.seek(0)
        assert f.read(2 * BLOCK) == bytes(data[: 2 * BLOCK])  # blocks 0 and 1 are whole
        f.seek(3 * BLOCK)
        assert f.read(BLOCK) == bytes(data[3 * BLOCK :])
        f.seek(2 * BLOCK + 5)
        with pytest.raises(
            CorruptCheckpointError, match=rf"f.bin fails its checksum in bytes \[{2 * BLOCK}, {3 * BLOCK}\)"
        ):
            f.read(10)
    path.write_bytes(bytes(data[: 3 * BLOCK]))  # truncated: the record's size is no longer there
    with VerifiedFile(path, entry, checksum.ALGORITHM, _corrupt) as f:
        f.seek(3 * BLOCK)
        with pytest.raises(CorruptCheckpointError, match=f"ends at byte {3 * BLOCK}; {4 * BLOCK} were written"):
            f.read(1)


def _item(fqn: str, size: int | None) -> WriteItem:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData

    if size is None:
        return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([size // 4]))
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([size // 4]))
    return WriteItem(index=MetadataIndex(fqn, torch.Size([0])), type=WriteItemType.TENSOR, tensor_data=data)


def test_small_replicated_items_go_to_the_lowest_rank_large_ones_stay_for_dcp(tmp_path):
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    def plan(rank: int) -> SavePlan:
        own = [_item(f"shard.{rank}", 8 * SMALL)]
        shared = [_item("param_groups.lr", None), _item("state.step", 4), _item("replica.chunk", 2 * SMALL)]
        return SavePlan(items=own + shared)

    plans = small_replicas_to_lowest_rank([plan(r) for r in range(4)])
    names = [sorted(i.index.fqn for i in p.items) for p in plans]
    assert names[0] == ["param_groups.lr", "replica.chunk", "shard.0", "state.step"]
    for rank in (1, 2, 3):
        assert names[rank] == ["replica.chunk", f"shard.{rank}"]  # the large replica is left to DCP's balancing
    final = [sorted(i.index.fqn for i in p.items) for p in dedup_save_plans(plans)]
    assert sum("replica.chunk" in n for n in final) == 1 and "replica.chunk" not in final[0]  # balanced off rank 0
    assert all("state.step" not in n and "param_groups.lr" not in n for n in final[1:])


def test_rank_files_and_the_restore_read_plan_are_verified_old_records_too(tmp_path):
    io_ = DCPCheckpointIO()
    path = tmp_path / "step=1.ckpt"
    state = {"state_dict": {"w": torch.arange(float(3 * BLOCK // 4)), "b": torch.ones(7)}, "global_step": 1}
    io_.save_checkpoint(state, path)
    meta = verify_rank_files(path, 0)
    assert meta["world_size"] == 1 and meta["global_step"] == 1 and "rank_state" in meta
    assert verify_rank_files(path, 3)["rank_state"] == meta["rank_state"]  # beyond the saved world: rank 0's file
    target = {"state_dict": {"w": torch.zeros(3 * BLOCK // 4), "b": torch.zeros(7)}}
    io_.load_checkpoint(path)
    io_.load_sharded(target, path)
    assert torch.equal(target["state_dict"]["w"], torch.arange(float(3 * BLOCK // 4)))
    # A record from before block digests (one digest per file) is still checked, file by file.
    record = checksum.manifest_file(path, 0)
    body = json.loads(record.read_text())
    old = Record()
    for name in body["files"]:
        size, digest = checksum.file_digest(path / name)
        old.files[name] = {"size": size, "digest": digest}
    write_manifest(path, 0, old)
    shard = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)  # the one holding "w"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(BaseException) as caught:
        DCPCheckpointIO().load_sharded({"state_dict": {"w": torch.zeros(3 * BLOCK // 4), "b": torch.zeros(7)}}, path)
    assert f"{shard} fails its checksum (" in describe_failure(caught.value)
    assert Manifests(path).enabled


class _Targets:
    """A LoadPlanner's two calls ``read_plan`` makes for tensors: the target of an item, and its commit."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets, self.committed = targets, []

    def resolve_tensor(self, item):
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item, tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def test_read_plan_reads_regions_straight_into_targets_and_the_rest_as_dcp(tmp_path, monkeypatch):
    """Rows of a stored tensor into a contiguous target: one read into it, no tensor loaded; columns (strided),
    another dtype or a strided target: DCP's load-and-copy. Every target equals the stored tensor's region."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from kempnerforge.checkpoint import dcp_read
    from kempnerforge.checkpoint.verify import NamingFileSystemReader

    stored = torch.randn(16, 12)
    path = tmp_path / "ckpt"
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": stored}}, path)
    reader = NamingFileSystemReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
    (index,) = [i for i in reader.storage_data if i.fqn == "state_dict.w"]

    def item(name: str, offsets: tuple[int, int], lengths: tuple[int, int]) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(name), torch.Size([0, 0]), index, torch.Size(offsets),
                        torch.Size(lengths))  # fmt: skip

    wide = torch.zeros(5, 8)
    targets = {
        "rows": torch.zeros(5, 12),  # contiguous rows 3..7: direct
        "cols": torch.zeros(16, 4),  # columns 2..5: strided in the file
        "bf16": torch.zeros(5, 12, dtype=torch.bfloat16),  # another dtype
        "strided": wide[:, :4],  # a strided target
    }
    regions = {
        "rows": ((3, 0), (5, 12)),
        "cols": ((0, 2), (16, 4)),
        "bf16": ((3, 0), (5, 12)),
        "strided": ((3, 2), (5, 4)),
    }
    loads = []
    real_load = dcp_read.torch.load
    monkeypatch.setattr(
        dcp_read.torch, "load", lambda *a, **k: (loads.append(k.get("map_location")), real_load(*a, **k))[1]
    )
    planner = _Targets(targets)
    plan = LoadPlan([item(name, *regions[name]) for name in targets])
    reader.read_data(plan, planner).wait()
    for name, ((r, c), (h, w)) in regions.items():
        want = stored[r : r + h, c : c + w].to(targets[name].dtype)
        assert torch.equal(targets[name], want), name
    assert sorted(planner.committed) == sorted(targets)
    assert loads.count("meta") == 1 and loads.count("cpu") == 3  # the layout once; three fallbacks load the item
