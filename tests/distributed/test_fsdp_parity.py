"""FSDP2 on 2 gloo ranks equals one process on the same global batch; resume equals an uninterrupted run.

The untied model's FSDP2 units are the embedding, each block and ``[norm, output]``; the tied model's are
``[tok_embeddings, norm, output]`` and each block (:func:`kempnerforge.parallel.fsdp.apply_fsdp`).
"""

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
    """Same losses within 1e-5 and grad norms within 3e-5 over 20 steps (fp32), and the loss actually moves."""
    record = fsdp2
    assert len(record["losses"]) == len(single["losses"]) == 20
    for a, b in zip(record["losses"], single["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    # Grad norms carry the reduction order (a reduce-scatter of 2 halves vs one sum) amplified by Adam over the
    # steps: measured up to 9e-6 relative with the previous init's weights and 1.9e-5 (one step) with the current
    # ones, while the losses agree to 2e-7 throughout.
    for a, b in zip(record["grad_norms"], single["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=3e-5, abs=1e-6)
    # Issue 17 check 4 on 2 FSDP2 ranks: a callback's on_before_optimizer_step sees the gradients of the
    # logged loss (their norm is the logged train/grad_norm), in both runs.
    for run in (record, single):
        assert run["callback_norms"] == pytest.approx(run["grad_norms"], rel=1e-5)
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


@pytest.fixture(scope="module")
def single_tied(shakespeare_tokens, tmp_path_factory):
    """One process, tied embedding and head, global batch 8 x 32 tokens, 5 steps."""
    out = tmp_path_factory.mktemp("single_tied") / "losses.json"
    return train(1, shakespeare_tokens, out, "--steps", "5", "--micro-batch", "8", "--tie")


def test_fsdp_dp_shard_2_tied_matches_single_process(single_tied, shakespeare_tokens, tmp_path):
    """The tied unit: 5 steps within 1e-5. (Over 20 steps the tied grad norm drifts to 1.0e-5 relative, under
    the old root-unit layout just the same: the fp32 order of the two summed head / embedding gradients.)"""
    record = train(2, shakespeare_tokens, tmp_path / "tied.json", "--steps", "5", "--micro-batch", "4", "--tie")
    assert len(record["losses"]) == len(single_tied["losses"]) == 5
    assert record["losses"] == pytest.approx(single_tied["losses"], rel=1e-5)
    assert record["grad_norms"] == pytest.approx(single_tied["grad_norms"], rel=1e-5)
    assert single_tied["losses"][-1] < single_tied["losses"][0] - 0.2
