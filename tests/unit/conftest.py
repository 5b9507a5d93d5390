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
