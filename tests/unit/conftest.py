"""Unit-test fixtures: a one-rank gloo process group for code that needs torch.distributed."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world_1():
    """A world of one gloo rank, torn down after the test."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_process_group():
    """In-process ``Trainer.fit`` with KempnerStrategy initializes a 1-rank process group and leaves it;
    destroy a group a test left behind, so later tests that create their own start clean."""
    was_initialized = dist.is_initialized()
    yield
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()
