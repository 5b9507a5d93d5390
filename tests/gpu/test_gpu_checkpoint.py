"""Async checkpoint staging on CUDA (skipped without a GPU by tests/conftest.py): the state dict handed to the
checkpoint IO stays on the device (no ``cpu_offload`` copy on the training thread), the training thread's only
work is the device-to-host copy into pinned host buffers, and the checkpoint holds
the values of the moment of the save although the parameters change right after it returns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
from kempnerforge.checkpoint.sharded_state import model_state, optimizer_state

pytestmark = pytest.mark.gpu


def test_async_save_stages_cuda_state_into_pinned_host_memory(tmp_path):
    model = nn.Linear(64, 64, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, opt)], "rank_state": {}}
    assert all(t.is_cuda for t in state["state_dict"].values())  # views of the parameters, not host copies
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    io = DCPCheckpointIO(async_save=True)
    io.save_checkpoint(state, tmp_path / "step=1.ckpt")
    cached = list(io._stager._state_dict_stager._cached_storage_mapping.values())
    assert cached and all(s.is_pinned() for s in cached)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the optimizer goes on at once
    io.save_checkpoint(
        {"state_dict": model_state(model), "optimizer_states": [], "rank_state": {}}, tmp_path / "step=2.ckpt"
    )
    io.teardown()
    loaded = {"state_dict": {k: torch.zeros_like(v) for k, v in expected.items()}}
    io.load_sharded(loaded, io.resolve(tmp_path / "step=1.ckpt"))
    for key, value in expected.items():
        assert torch.equal(loaded["state_dict"][key], value), key


def test_prestaged_pinned_buffers_are_the_ones_saves_use_and_cuda_targets_restore(tmp_path):
    """Issue 30, item 4: ``prestage`` (what the strategy calls after the first optimizer step) allocates the pinned
    staging buffers on the checkpoint worker; the save that follows copies into those same buffers (no allocation on
    the training thread) and writes the values of its own moment, not the prestaged ones; a restore into CUDA
    tensors (read as DCP reads them: only contiguous CPU targets are read in place) gives them back."""
    model = nn.Linear(64, 64, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    io = DCPCheckpointIO(async_save=True)
    io.prestage({"state_dict": model_state(model), "optimizer_0": optimizer_state(model, opt)})
    io.wait()
    mapping = io._stager._state_dict_stager._cached_storage_mapping
    staged = {id(s) for s in mapping.values()}
    assert staged and all(s.is_pinned() for s in mapping.values())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # another step's values: the save must write these
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, opt)], "rank_state": {}}
    io.save_checkpoint(state, tmp_path / "step=2.ckpt")
    assert {id(s) for s in io._stager._state_dict_stager._cached_storage_mapping.values()} == staged
    io.teardown()
    loaded = {"state_dict": {k: torch.zeros_like(v, device="cuda") for k, v in expected.items()}}
    io.load_sharded(loaded, io.resolve(tmp_path / "step=2.ckpt"))
    for key, value in expected.items():
        assert torch.equal(loaded["state_dict"][key].cpu(), value), key
