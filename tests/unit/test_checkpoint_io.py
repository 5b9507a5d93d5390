"""DCP checkpoint layout: atomic saves, the `latest` pointer, clear errors for incomplete checkpoints."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kempnerforge.checkpoint.dcp_io import CheckpointError, DCPCheckpointIO
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
    with pytest.raises(CheckpointError, match=r"not a complete kempnerforge checkpoint: missing meta.pt"):
        io.resolve(broken)


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


def test_dataloader_state_under_another_dp_degree_is_refused():
    ckpt = _checkpoint([{"pos": 3}])
    rank_state = split_rank_state(ckpt, dp_rank=0, dp_size=2)
    with pytest.raises(DataParallelMismatchError, match="saved with a data-parallel degree of 2 but this run has dp=1"):
        merge_rank_state(ckpt, rank_state, dp_rank=0, dp_size=1)
    with pytest.raises(DataParallelMismatchError, match="No per-rank state for this rank"):
        merge_rank_state(ckpt, None, dp_rank=3, dp_size=4)
