"""FSDP2 on 2 gloo ranks equals one process on the same global batch; resume equals an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.distributed.launch import train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def single(shakespeare_tokens, tmp_path_factory):
    """One process, global batch 8 x 32 tokens, 20 steps."""
    out = tmp_path_factory.mktemp("single") / "losses.json"
    return train(1, shakespeare_tokens, out, "--steps", "20", "--micro-batch", "8")


@pytest.fixture(scope="module")
def fsdp2(shakespeare_tokens, tmp_path_factory):
    """2 processes (dp_shard 2), micro-batch 4 (the same global batch), 20 steps: the parity run, and the
    uninterrupted run the resume test compares with (the identical command, so it runs once)."""
    out = tmp_path_factory.mktemp("fsdp2") / "fsdp.json"
    return train(2, shakespeare_tokens, out, "--steps", "20", "--micro-batch", "4")


def test_fsdp_dp_shard_2_matches_single_process(single, fsdp2):
    """Same losses and grad norms within 1e-5 (fp32), and the loss actually moves."""
    record = fsdp2
    assert len(record["losses"]) == len(single["losses"]) == 20
    for a, b in zip(record["losses"], single["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    # Grad norms carry the reduction order (a reduce-scatter of 2 halves vs one sum) amplified by Adam over the
    # steps: measured up to 9e-6 relative with the previous init's weights and 1.9e-5 (one step) with the current
    # ones, while the losses agree to 2e-7 throughout.
    for a, b in zip(record["grad_norms"], single["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=3e-5, abs=1e-6)
    assert single["losses"][0] > 10.0  # ~ln(50257) at init
    assert single["losses"][-1] < single["losses"][0] - 2.0


def test_exact_resume_two_processes(fsdp2, shakespeare_tokens, tmp_path):
    """20 steps straight vs 10 steps, stop, resume for 10 more: identical losses for steps 11-20."""
    straight = fsdp2
    ckpt = tmp_path / "ckpt"
    first = train(
        2,
        shakespeare_tokens,
        tmp_path / "first.json",
        "--steps",
        "10",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        "10",
    )
    assert (ckpt / "latest").read_text().strip() == "step=0010.ckpt"
    resumed = train(2, shakespeare_tokens, tmp_path / "resumed.json", "--steps", "20", "--resume", str(ckpt))
    assert first["losses"] == straight["losses"][:10]
    assert resumed["steps"][0] == 11
    assert resumed["losses"] == straight["losses"][10:]
