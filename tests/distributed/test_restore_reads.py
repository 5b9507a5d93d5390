"""Issue 30, check 5 (second half): restore verification reads no other rank's files (``restore_reads_script.py``,
one launch on 4 gloo ranks).

Under ``--ckpt_path auto`` the newest checkpoint has bytes overwritten in rank 3's shard. Every rank checks only
the files it reads: rank 3 finds the damage (its shard's blocks, hashed as they are read), the ranks agree (one
all-reduce before DCP, DCP's own agreement on a failed read), the checkpoint is rejected naming the file, and the
previous one is restored. Over both attempts rank ``r`` opened only ``.metadata``, ``meta.pt``, ``COMPLETE`` and
rank 0's checksum record (which holds ``.metadata`` and ``meta.pt``), its own state file, checksum record and
shard files (two: one per writer thread), and rank 0's shard files, which hold the small items every rank reads (per-parameter ``param_groups`` and
``step``: :mod:`kempnerforge.checkpoint.save_planner`); of those a rank other than 0 verifies only the blocks it
reads, not the files. (A resharded restore reads the shards that hold a rank's elements, whichever rank wrote
them, and verifies exactly what it reads; a rank beyond the saved world reads rank 0's state file.)
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import HERE, launch

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "restore_reads_script.py"
SHARED = {".metadata", "meta.pt", "COMPLETE", "checksums_00000.json", "__0_0.distcp", "__0_1.distcp"}


def _own(rank: int) -> set[str]:
    """Its state file, checksum record and shard files (one per writer thread: WRITER_THREADS = 2)."""
    return {f"rank_{rank:05d}.pt", f"checksums_{rank:05d}.json", f"__{rank}_0.distcp", f"__{rank}_1.distcp"}


def test_each_rank_verifies_and_reads_only_its_own_files_at_four_ranks(tmp_path, shakespeare_tokens):
    out = tmp_path / "record.json"
    launch(4, SCRIPT, ["--data", str(shakespeare_tokens), "--root", str(tmp_path), "--out", str(out)], timeout=400)
    record = json.loads(out.read_text())
    bad = tmp_path / "ckpt" / "step=3.ckpt"
    assert list(record["rejected"]) == [str(bad)], record["rejected"]
    assert str(bad / "__3_0.distcp") in record["rejected"][str(bad)], record["rejected"]
    assert record["resumed_from"] == str(tmp_path / "ckpt" / "step=2.ckpt") and record["resumed_step"] == 2
    for rank, opened in enumerate(record["opened"]):
        by_ckpt: dict[str, set[str]] = {}
        for rel in opened:
            ckpt, _, name = rel.partition("/")
            by_ckpt.setdefault(ckpt, set()).add(name)
        assert set(by_ckpt) <= {"step=3.ckpt", "step=2.ckpt", "latest"}, (rank, opened)
        for ckpt in ("step=3.ckpt", "step=2.ckpt"):
            names = by_ckpt.get(ckpt, set())
            assert names <= SHARED | _own(rank), (rank, ckpt, sorted(names - SHARED - _own(rank)))
            # It read its own files: all of the restored one; of the damaged one at least its state file and first
            # shard (rank 3 stops at the damaged block of __3_0, before __3_1).
            need = _own(rank) if ckpt == "step=2.ckpt" else {f"rank_{rank:05d}.pt", f"__{rank}_0.distcp"}
            assert need <= names, (rank, ckpt, sorted(names))
        # Verifying rank 0's shards, another rank read the few blocks holding the small items, not the files.
        read, sizes = record["bytes"][rank], record["sizes"]
        for i in (0, 1):
            own = f"step=2.ckpt/__{rank}_{i}.distcp"
            assert read[own] >= sizes[own], (rank, read)  # its own shards: every byte
        if rank:
            zero = [f"step=2.ckpt/__0_{i}.distcp" for i in (0, 1)]
            assert sum(read.get(f, 0) for f in zero) < 0.3 * sum(sizes[f] for f in zero), (rank, read, sizes)
