"""Issue 18, check 5 (a full disk explains itself and leaves no .partial) and the file checks behind check 4's
fallback (a truncated shard, a truncated meta.pt, a deleted shard, a damaged shard are named)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from kempnerforge.checkpoint.dcp_io import LATEST_FILE, CheckpointSpaceError, DCPCheckpointIO
from kempnerforge.checkpoint.disk import format_bytes
from kempnerforge.checkpoint.verify import CorruptCheckpointError, verify_checkpoint
from kempnerforge.resilience.auto_resume import AutoResume, find_resume_checkpoint
from tests.tmpfs import mounted_tmpfs

MIB = 1 << 20


def _state(n: int = 1024) -> dict:
    return {"state_dict": {"w": torch.arange(float(n)), "b": torch.ones(7)}, "lr_schedulers": [], "global_step": 3}


class _FullDisk(io.RawIOBase):
    """A file on a full filesystem: every write fails with ENOSPC, as write(2) does."""

    def __init__(self, path: str) -> None:
        self.path, self.pos = path, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)


@pytest.fixture
def full_disk(monkeypatch):
    """DCP's shard writes hit a full disk (its reads and every other file are untouched)."""
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            yield _FullDisk(str(path))
        else:
            with original(self, path, mode) as stream:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_names_path_needed_and_free_bytes_and_removes_the_partial(tmp_path, full_disk, async_save):
    io_ = DCPCheckpointIO(async_save=async_save)
    path = tmp_path / "step=000003.ckpt"
    with pytest.raises(CheckpointSpaceError) as caught:
        io_.save_checkpoint(_state(), path)
        io_.wait()  # async: the upload's failure surfaces at the next wait (the next save, or teardown)
    io_.teardown() if not async_save else io_.abandon()
    err = caught.value
    assert err.errno == errno.ENOSPC
    message = str(err)
    assert "no space left on device: saving checkpoint" in message and str(path) in message
    assert f"needs about {format_bytes((1024 + 7) * 4)}" in message  # this rank's shard bytes x world size 1
    free = shutil.disk_usage(tmp_path).free
    shown = int(message.split(" has ")[1].split(" bytes")[0])
    assert abs(shown - free) < 64 * MIB, (shown, free)  # the filesystem's free bytes (others write meanwhile)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .partial, no latest
    assert not (tmp_path / LATEST_FILE).exists()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs; skipped where it cannot be mounted."""
    with mounted_tmpfs(tmp_path / "tmpfs", "size=1m") as mnt:
        yield mnt


def test_a_save_into_a_full_tmpfs_says_so_and_leaves_nothing(tiny_tmpfs):
    """The real failure (PyTorch's zip writer and DCP on a full filesystem), not a patched one."""
    path = tiny_tmpfs / "step=000003.ckpt"
    with pytest.raises(CheckpointSpaceError, match="no space left on device") as caught:
        DCPCheckpointIO().save_checkpoint(_state(1 << 19), path)  # 2 MiB of shards into 1 MiB
    message = str(caught.value)
    assert str(path) in message and f"needs about {format_bytes((1 << 19) * 4 + 28)}" in message
    free = shutil.disk_usage(tiny_tmpfs).free
    assert f"has {format_bytes(free)} free" in message and free > 0.9 * MIB  # the .partial was removed first
    assert list(tiny_tmpfs.iterdir()) == []


def _checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"step={step:06d}.ckpt"
    DCPCheckpointIO().save_checkpoint(_state(), path)
    os.utime(path, (step, step))
    return path


def _shard(path: Path) -> Path:
    """The first of the rank's shard files (it writes WRITER_THREADS of them)."""
    return sorted(path.glob("*.distcp"))[0]


CORRUPTIONS = {
    "truncated_shard": (lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:100]), "distcp is truncated"),
    "deleted_shard": (lambda p: _shard(p).unlink(), "distcp is missing"),
    "truncated_meta": (
        lambda p: (p / "meta.pt").write_bytes((p / "meta.pt").read_bytes()[:30]),
        "meta.pt has 30 bytes",
    ),
    "deleted_rank_file": (lambda p: (p / "rank_00000.pt").unlink(), "rank_00000.pt is missing"),
    "truncated_rank_file": (
        lambda p: (p / "rank_00000.pt").write_bytes((p / "rank_00000.pt").read_bytes()[:-40]),
        "rank_00000.pt is not a whole",
    ),
}


def _restore(path: Path) -> None:
    """What every rank of a restore does at world size 1: its own files, then its DCP read plan's shards."""
    io_ = DCPCheckpointIO()
    io_.load_checkpoint(path)
    io_.load_sharded({"state_dict": {"w": torch.zeros(1024), "b": torch.zeros(7)}}, path)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_verify_names_the_bad_file_and_auto_resume_takes_the_previous_checkpoint(tmp_path, kind, caplog):
    from kempnerforge.checkpoint.verify import describe_failure

    older, newer = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    verify_checkpoint(newer)  # whole
    _restore(newer)
    corrupt, expected = CORRUPTIONS[kind]
    corrupt(newer)
    with pytest.raises(CorruptCheckpointError, match=expected) as caught:
        verify_checkpoint(newer)  # one process, every file (the tools)
    assert str(newer) in str(caught.value)
    bad = caught.value.file
    with pytest.raises(BaseException) as caught:  # a restore: the rank reading the file names it
        _restore(newer)
    assert str(bad) in describe_failure(caught.value), describe_failure(caught.value)
    assert find_resume_checkpoint(tmp_path) == newer  # COMPLETE is there: without verification it is taken
    auto = AutoResume(tmp_path)
    assert auto.choose() == newer  # files are checked by the ranks restoring it, not by the choice
    auto.reject(newer, describe_failure(caught.value))
    assert auto.choose() == older and list(auto.rejected) == [newer]
    with caplog.at_level("WARNING"):
        assert find_resume_checkpoint(tmp_path, verify=True) == older  # one process verifying every file
    assert f"Auto-resume: checkpoint {newer} is corrupt" in caplog.text and "falling back" in caplog.text


def test_a_damaged_shard_is_named_when_dcp_reads_it(tmp_path):
    """Bytes overwritten inside a shard (same size: only its checksum sees it) fail the read naming the file."""
    path = _checkpoint(tmp_path, 2)
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    data[:64] = bytes(64)
    shard.write_bytes(bytes(data))
    verify_checkpoint(path)
    state = {"state_dict": {"w": torch.zeros(1024), "b": torch.zeros(7)}}
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        DCPCheckpointIO().load_sharded(state, path)
    from kempnerforge.checkpoint.verify import describe_failure

    assert f"{shard} fails its checksum" in describe_failure(caught.value)


def test_every_checkpoint_rejected_means_no_choice(tmp_path):
    only = _checkpoint(tmp_path, 2)
    auto = AutoResume(tmp_path)
    assert auto.choose() == only
    auto.reject(only, "bad")
    assert auto.choose() is None and list(auto.rejected) == [only]
    assert AutoResume(tmp_path / "none").choose() is None and AutoResume(tmp_path / "none").rejected == {}


def test_binary_garbage_in_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, caplog, capsys):
    from kempnerforge.tools.check_ckpt import check_ckpt

    old, new = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    (tmp_path / LATEST_FILE).write_bytes(b"\xff\xfe\x00garbage\x81")
    with caplog.at_level("WARNING"):
        assert find_resume_checkpoint(tmp_path, verify=True) == new
    assert f"{tmp_path / LATEST_FILE} is damaged" in caplog.text and "newest complete checkpoint instead" in caplog.text
    assert check_ckpt(tmp_path) == 2
    out = capsys.readouterr().out
    assert f"BAD {tmp_path / LATEST_FILE}" in out and f"OK {old}" in out and f"OK {new}" in out


def test_a_checkpoint_from_before_checksums_is_unverified_but_loads(tmp_path, capsys):
    from kempnerforge.tools.check_ckpt import check_ckpt

    path = _checkpoint(tmp_path, 2)
    for record in path.glob("checksums_*.json"):
        record.unlink()
    (path / "COMPLETE").write_text("world_size=1\n")  # the marker an older kempnerforge wrote
    assert check_ckpt(path) == 0
    assert capsys.readouterr().out.startswith(f"UNVERIFIED {path}")
    state = {"state_dict": {"w": torch.zeros(1024), "b": torch.zeros(7)}}
    DCPCheckpointIO().load_sharded(state, path)
    assert torch.equal(state["state_dict"]["w"], torch.arange(1024.0))


def test_a_deleted_checksum_record_is_a_bad_checkpoint_not_an_old_one(tmp_path):
    path = _checkpoint(tmp_path, 2)
    (path / "checksums_00000.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="checksums_00000.json is missing"):
        verify_checkpoint(path)


def test_check_ckpt_refuses_a_path_without_checkpoints_in_one_line(tmp_path, capsys):
    from kempnerforge.tools.check_ckpt import check_ckpt

    assert check_ckpt(tmp_path / "nope") == 2
    assert capsys.readouterr().err == f"kforge: error: check-ckpt: {tmp_path / 'nope'} does not exist\n"
    assert check_ckpt(tmp_path) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
