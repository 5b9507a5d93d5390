"""DCP checkpoint layout: atomic saves, the `latest` pointer, clear errors for incomplete checkpoints."""

from __future__ import annotations

import copy
import random
import threading
import time

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.staging import StagingOptions

from kempnerforge.checkpoint.dcp_io import LATEST_FILE, CheckpointError, DCPCheckpointIO, staging_options
from kempnerforge.checkpoint.train_state import (
    DataParallelMismatchError,
    collect_rng_state,
    merge_rank_state,
    restore_rng_state,
    split_rank_state,
)


def _checkpoint(loader_state):
    return {
        "state_dict": {"w": torch.arange(6.0)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}],
        "global_step": 7,
        "loops": {"fit_loop": {"state_dict": {"combined_loader": loader_state}}},
    }


def test_save_is_atomic_and_moves_latest(tmp_path, gloo_world_1):
    io = DCPCheckpointIO()
    ckpt = _checkpoint([{"samples_yielded": 12}])
    ckpt["rank_state"] = split_rank_state(ckpt, dp_rank=0, dp_size=1)
    io.save_checkpoint(ckpt, tmp_path / "step=7.ckpt")
    assert (tmp_path / "latest").read_text().strip() == "step=7.ckpt"
    assert not (tmp_path / "step=7.ckpt.partial").exists()
    assert {p.name for p in (tmp_path / "step=7.ckpt").iterdir()} >= {".metadata", "meta.pt", "rank_00000.pt"}
    meta = io.load_checkpoint(tmp_path)  # a folder with `latest` resolves to the newest checkpoint
    assert meta["global_step"] == 7 and meta["world_size"] == 1
    assert "combined_loader" not in meta["loops"]["fit_loop"]["state_dict"]  # per-rank, not rank 0's
    assert meta["rank_state"]["dataloader"] == [{"samples_yielded": 12}]
    state = {"state_dict": {"w": torch.zeros(6)}}
    io.load_sharded(state, tmp_path / "step=7.ckpt")
    assert torch.equal(state["state_dict"]["w"], torch.arange(6.0))


def test_partial_and_incomplete_checkpoints_are_refused(tmp_path):
    io = DCPCheckpointIO()
    with pytest.raises(CheckpointError, match="does not exist"):
        io.resolve(tmp_path / "nope")
    partial = tmp_path / "step=9.ckpt.partial"
    partial.mkdir()
    with pytest.raises(CheckpointError, match="is a partial checkpoint"):
        io.resolve(partial)
    broken = tmp_path / "step=8.ckpt"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"")
    with pytest.raises(
        CheckpointError, match=r"not a complete kempnerforge checkpoint: missing meta.pt.*folder holding"
    ):
        io.resolve(broken)  # no `latest` beside it: the hint does not name one
    (tmp_path / "latest").write_text("step=7.ckpt\n")
    with pytest.raises(CheckpointError, match=r"missing meta.pt.*newest complete checkpoint is named in .*latest"):
        io.resolve(broken)
    hf = tmp_path / "hf"  # a Hugging Face folder given where a checkpoint goes: import it first
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"Hugging Face folder: import it with `kforge convert hf-to-dcp"):
        io.resolve(hf)


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = collect_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_rank_state_goes_back_where_lightning_reads_it():
    ckpt = _checkpoint([{"pos": 3}])
    rank_state = split_rank_state(ckpt, dp_rank=1, dp_size=2)
    assert "combined_loader" not in ckpt["loops"]["fit_loop"]["state_dict"]
    merge_rank_state(ckpt, rank_state, dp_rank=1, dp_size=2)
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"pos": 3}]


def test_dataloader_state_under_another_dp_degree_without_sampler_position_is_refused():
    ckpt = _checkpoint([{"pos": 3}])
    rank_state = split_rank_state(ckpt, dp_rank=0, dp_size=2)
    with pytest.raises(
        DataParallelMismatchError,
        match=r"Cannot remap the dataloader position from dp=2 to dp=1: the saved loader state has no sampler position",
    ):
        merge_rank_state(ckpt, rank_state, dp_rank=0, dp_size=1)
    with pytest.raises(DataParallelMismatchError, match="No per-rank state for this rank"):
        merge_rank_state(ckpt, None, dp_rank=3, dp_size=4)


def _loader_state(batches: int, micro_batch: int) -> list[dict]:
    """What a StatefulDataLoader over ResumableDistributedSampler saves after ``batches`` batches (num_workers=0)."""
    yielded = batches * micro_batch
    return [
        {
            "_index_sampler_state": None,
            "_sampler_iter_state": {
                "samples_yielded": yielded,
                "sampler_state": {"yielded": yielded, "epoch": 0},
            },
            "_sampler_iter_yielded": batches,
            "_num_yielded": batches,
            "_iterator_finished": False,
        }
    ]


@pytest.mark.parametrize(("saved_dp", "micro", "dp", "new_micro"), [(2, 4, 1, 8), (2, 4, 4, 2), (1, 8, 2, 4)])
def test_dataloader_position_is_remapped_exactly_across_dp_degrees(saved_dp, micro, dp, new_micro):
    """k batches of b on d ranks = the first k*b*d samples of the epoch: k*b*d/d' per rank at degree d'."""
    ckpt = _checkpoint(_loader_state(batches=5, micro_batch=micro))
    rank_state = split_rank_state(ckpt, dp_rank=0, dp_size=saved_dp)
    merge_rank_state(ckpt, rank_state, dp_rank=0, dp_size=dp, micro_batch_size=new_micro)
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    expected = 5 * micro * saved_dp // dp
    assert state["_sampler_iter_state"] == {
        "samples_yielded": expected,
        "sampler_state": {"yielded": expected, "epoch": 0},
    }
    assert state["_num_yielded"] == 5  # batches (and the global step) are unchanged


def test_a_position_past_the_samplers_first_epoch_keeps_its_batch_size():
    """The sampler's count restarts each epoch while the loader's run on (one iterator over the cycling sampler): 4
    batches of 4 in epoch 1 of a 12-sample rank shard. The global batch is the loader's 16 / 4, not 8 / 4 (which
    refused every same-batch resume after the first epoch); both counts are remapped."""
    (state,) = _loader_state(batches=4, micro_batch=4)
    state["_sampler_iter_state"]["sampler_state"] = {"yielded": 4, "epoch": 1}
    ckpt = _checkpoint([state])
    merge_rank_state(ckpt, split_rank_state(ckpt, dp_rank=0, dp_size=2), dp_rank=0, dp_size=2, micro_batch_size=4)
    ckpt = _checkpoint([copy.deepcopy(state)])
    merge_rank_state(ckpt, split_rank_state(ckpt, dp_rank=0, dp_size=2), dp_rank=0, dp_size=1, micro_batch_size=8)
    (moved,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert moved["_sampler_iter_state"] == {"samples_yielded": 32, "sampler_state": {"yielded": 8, "epoch": 1}}
    ckpt = _checkpoint([copy.deepcopy(state)])
    with pytest.raises(DataParallelMismatchError, match=r"saved micro_batch_size\*dp = 4\*2 = 8, this run has 2\*2"):
        merge_rank_state(ckpt, split_rank_state(ckpt, dp_rank=0, dp_size=2), dp_rank=0, dp_size=2, micro_batch_size=2)


def test_remapped_position_resumes_the_same_samples():
    """The sampler at dp=1 with the remapped position yields exactly what the 2 ranks would have yielded next."""
    from kempnerforge.checkpoint.train_state import remap_loader_state
    from kempnerforge.data.datamodule import ResumableDistributedSampler

    data = list(range(103))
    two = [list(ResumableDistributedSampler(data, num_replicas=2, rank=r, seed=5, drop_last=True)) for r in range(2)]
    (state,) = remap_loader_state(_loader_state(batches=3, micro_batch=4), saved_dp=2, dp=1, micro_batch_size=8)
    one = ResumableDistributedSampler(data, num_replicas=1, rank=0, seed=5, drop_last=True)
    one.load_state_dict(state["_sampler_iter_state"]["sampler_state"])
    next_global = sorted(two[0][12:16] + two[1][12:16])  # step 4 at dp=2: 4 samples on each rank
    assert sorted(list(one)[:8]) == next_global


def test_remap_refuses_indivisible_positions_and_a_changed_global_batch():
    with pytest.raises(
        DataParallelMismatchError,
        match=r"consumed 3 samples per rank x 1 ranks = 3 samples, not divisible by dp=2",
    ):
        merge_rank_state(
            _ck := _checkpoint(_loader_state(batches=1, micro_batch=3)),
            split_rank_state(_ck, dp_rank=0, dp_size=1),
            dp_rank=0,
            dp_size=2,
        )
    ckpt = _checkpoint(_loader_state(batches=5, micro_batch=4))
    with pytest.raises(
        DataParallelMismatchError,
        match=r"^data.micro_batch_size: .* must keep the global batch .*: saved micro_batch_size\*dp = 4\*2 = 8, "
        r"this run has 4\*1 = 4. Set data.micro_batch_size=8",
    ):
        merge_rank_state(ckpt, split_rank_state(ckpt, dp_rank=0, dp_size=2), dp_rank=0, dp_size=1, micro_batch_size=4)
    ckpt = _checkpoint(_loader_state(batches=5, micro_batch=4))
    with pytest.raises(
        DataParallelMismatchError, match=r"saved micro_batch_size\*dp = 4\*2 = 8, this run has 2\*2 = 4"
    ):
        # the same degree, another micro-batch: refused too (it once resumed silently)
        merge_rank_state(ckpt, split_rank_state(ckpt, dp_rank=0, dp_size=2), dp_rank=0, dp_size=2, micro_batch_size=2)


@pytest.fixture
def upload_gate(monkeypatch):
    """Holds DCP's writes (on its upload thread) until the test sets the event: a save still being written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    gate = threading.Event()
    write = FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        assert gate.wait(30), "the test never opened the upload gate"
        return write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated)
    gate.set()
    return gate


def _state(w: torch.Tensor) -> dict:
    return {"state_dict": {"w": w}, "optimizer_states": [], "rank_state": {}}


def _until(predicate, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_async_save_returns_after_staging_and_completes_in_the_background(tmp_path, upload_gate):
    """save_checkpoint returns while the upload is still blocked (the training thread only staged a copy);
    once the upload finishes, the marker, the rename and `latest` follow with no further call on this thread."""
    from kempnerforge.resilience.auto_resume import find_resume_checkpoint

    io = DCPCheckpointIO(async_save=True)
    w = torch.arange(6.0)
    upload_gate.clear()
    io.save_checkpoint(_state(w), tmp_path / "step=1.ckpt")  # returns although nothing is written yet
    assert io._stager is not None and io._stager._config == StagingOptions(False, False, False, False)  # CPU
    w.add_(100.0)  # the optimizer updates in place while the upload runs
    assert find_resume_checkpoint(tmp_path) is None and (tmp_path / "step=1.ckpt.partial").is_dir()
    upload_gate.set()
    assert _until(lambda: (tmp_path / LATEST_FILE).is_file()), "the save never completed in the background"
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step=1.ckpt"
    io.save_checkpoint(_state(w), tmp_path / "step=2.ckpt")
    io.teardown()
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step=2.ckpt"
    for name, expected in (("step=1.ckpt", torch.arange(6.0)), ("step=2.ckpt", torch.arange(6.0) + 100)):
        state = {"state_dict": {"w": torch.zeros(6)}}
        io.load_sharded(state, io.resolve(tmp_path / name))
        assert torch.equal(state["state_dict"]["w"], expected), name
    with pytest.raises(ValueError, match="async_save='yes' is not allowed"):
        DCPCheckpointIO(async_save="yes")


def test_remove_checkpoint_waits_for_the_pending_save_and_keeps_latest_and_protected(tmp_path, upload_gate):
    """Lightning's save_top_k=1 removes the previous checkpoint right after starting the next save: the
    removal waits until that save is complete and `latest` names it, so a complete checkpoint always exists."""
    from kempnerforge.checkpoint.retention import protect
    from kempnerforge.resilience.auto_resume import find_resume_checkpoint

    io = DCPCheckpointIO(async_save=True)
    w = torch.arange(6.0)
    io.save_checkpoint(_state(w), tmp_path / "step=1.ckpt")
    io.wait()
    upload_gate.clear()
    io.save_checkpoint(_state(w), tmp_path / "step=2.ckpt")
    io.remove_checkpoint(tmp_path / "step=1.ckpt")  # what ModelCheckpoint(save_top_k=1) does now
    time.sleep(0.2)
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step=1.ckpt"  # still there: the only complete one
    upload_gate.set()
    io.wait()
    assert not (tmp_path / "step=1.ckpt").exists()
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step=2.ckpt"
    io.remove_checkpoint(tmp_path / "step=2.ckpt")  # the one `latest` names: kept
    io.save_checkpoint(_state(w), tmp_path / "step=3.ckpt")
    protect(tmp_path, "step=2.ckpt")  # e.g. the NaN guard's rollback target
    io.remove_checkpoint(tmp_path / "step=2.ckpt")
    io.teardown()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=2.ckpt", "step=3.ckpt"]


def test_commit_hooks_run_after_each_complete_save_and_abandon_never_waits(tmp_path, upload_gate):
    """Hooks (retention) see the checkpoint complete and named by `latest`; after an exception, abandon()
    returns at once although a save is still being written (no wait, no collective on this thread)."""
    io = DCPCheckpointIO(async_save=True)
    seen: list[tuple[str, str]] = []
    io.add_commit_hook(lambda p: seen.append((p.name, (p.parent / LATEST_FILE).read_text().strip())))
    io.add_commit_hook(lambda p: 1 / 0)  # a failing hook is logged, never fatal
    io.save_checkpoint(_state(torch.ones(2)), tmp_path / "step=1.ckpt")
    io.wait()
    assert seen == [("step=1.ckpt", "step=1.ckpt")]
    upload_gate.clear()
    io.save_checkpoint(_state(torch.ones(2)), tmp_path / "step=2.ckpt")
    start = time.monotonic()
    io.abandon()
    assert time.monotonic() - start < 1.0
    assert (tmp_path / LATEST_FILE).read_text().strip() == "step=1.ckpt"
    upload_gate.set()  # the save in flight still finishes on its own threads (every rank of this world is alive)
    assert _until(lambda: (tmp_path / LATEST_FILE).read_text().strip() == "step=2.ckpt")


def test_staging_options_pin_host_memory_only_for_cuda_state():
    assert staging_options({"a": {"b": [torch.zeros(1)]}}) == StagingOptions(False, False, False, False)
