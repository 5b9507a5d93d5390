"""Tensor parallelism (TP=2, TP=2 x FSDP2=2, sequence parallel) equals one process on the same global batch.

Every run trains the tiny model (dim 64, 2 layers, GQA, vocab 50257: an uneven vocab split at tp=2)
for 5 steps on a global batch of 8 x 32 tokens, and records the global loss, the pre-clip gradient
norm and the gradient norm after clipping (max_norm 1.0).
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import HERE, launch, train

pytestmark = pytest.mark.distributed

STEPS = ("--steps", "5")


def _assert_parity(record: dict, single: dict) -> None:
    """Losses and gradient norms (before and after clipping) equal within 1e-5 relative, step by step."""
    assert len(record["losses"]) == len(single["losses"]) == 5
    for key in ("losses", "grad_norms", "clipped_norms"):
        for a, b in zip(record[key], single[key], strict=True):
            assert a == pytest.approx(b, rel=1e-5), key


@pytest.fixture(scope="module")
def single(shakespeare_tokens, tmp_path_factory):
    """One process, micro-batch 8 (the global batch of every run below), with its batches recorded."""
    out = tmp_path_factory.mktemp("tp_single")
    record = train(
        1, shakespeare_tokens, out / "single.json", *STEPS, "--micro-batch", "8", "--record-batches", str(out)
    )
    record["batches"] = json.loads((out / "rank0.json").read_text())["batches"]
    return record


@pytest.fixture(scope="module")
def tp_fsdp(shakespeare_tokens, tmp_path_factory):
    """4 processes: dp_shard=2 x tp=2, micro-batch 4 per data shard; every rank's batches recorded."""
    out = tmp_path_factory.mktemp("tp_fsdp")
    record = train(
        4,
        shakespeare_tokens,
        out / "run.json",
        *STEPS,
        "--micro-batch",
        "4",
        "--tp",
        "2",
        "--record-batches",
        str(out),
        timeout=300,
    )
    record["ranks"] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return record


def test_sequence_parallel_with_gathered_logits_matches_single_process(single, shakespeare_tokens, tmp_path):
    """tp=2, sequence parallel (norms and residual stream sharded along seq), loss parallel off (logits
    all-gathered). Plain tp=2 and sequence parallel with loss parallel run in test_parallel_parity.py;
    TP with loss parallel also runs below (tp=2 x dp_shard=2) and in test_resharding.py."""
    record = train(
        2,
        shakespeare_tokens,
        tmp_path / "sp.json",
        *STEPS,
        "--micro-batch",
        "8",
        "--tp",
        "2",
        "--sequence-parallel",
        "--no-loss-parallel",
    )
    _assert_parity(record, single)
    assert single["losses"][-1] < single["losses"][0] - 0.1  # it trains


def test_tp2_fsdp2_matches_single_process(single, tp_fsdp):
    """dp_shard=2 x tp=2 (2-D DTensor parameters, loss parallel) on 4 processes."""
    _assert_parity(tp_fsdp, single)


def test_tp_ranks_of_one_data_shard_get_identical_batches(single, tp_fsdp):
    """Sampler rank/size come from the dp sub-mesh: TP peers identical, dp shards disjoint, union = global batch."""
    by_dp: dict[int, list] = {}
    for rank in tp_fsdp["ranks"]:
        dp = rank["coords"]["dp_shard"]
        if dp in by_dp:
            assert rank["batches"] == by_dp[dp], f"TP ranks of data shard {dp} got different batches"
        by_dp[dp] = rank["batches"]
    assert sorted(by_dp) == [0, 1]
    for step in range(5):
        rows0 = {tuple(r) for r in by_dp[0][step]}
        rows1 = {tuple(r) for r in by_dp[1][step]}
        assert len(rows0) == len(rows1) == 4
        assert not rows0 & rows1, f"dp ranks share samples at step {step}"
        assert rows0 | rows1 == {tuple(r) for r in single["batches"][step]}


def test_clipped_global_norm_under_tp_fsdp2_equals_single_process(single, tp_fsdp):
    """The global norm after clipping (max_norm 1.0) is the single-process one; no tp double counting."""
    clipped_steps = [i for i, n in enumerate(single["grad_norms"]) if n > 1.0]
    assert clipped_steps, "the run must clip at least once for this test to mean something"
    for i, (a, b) in enumerate(zip(tp_fsdp["clipped_norms"], single["clipped_norms"], strict=True)):
        assert a == pytest.approx(b, rel=1e-5)
        expected = 1.0 if i in clipped_steps else single["grad_norms"][i]
        assert a == pytest.approx(expected, rel=1e-5)


def test_model_level_variants_match_unsharded_model(tmp_path):
    """One forward/backward at tp=2 vs the unsharded model: loss parallel on/off, sequence parallel on/off,
    tied embeddings and QK-norm (per-head norm weights under TP), uneven vocab (101). Cross-entropy + z-loss
    too (weight 1): on vocab-sharded logits its log-sum-exp reduces the shards (loss_parallel variants), else it runs
    on the gathered logits."""
    out = tmp_path / "variants.json"
    launch(2, HERE / "tp_model_check.py", ["--out", str(out)])
    variants = json.loads(out.read_text())
    assert len(variants) == 4
    for v in variants:
        assert v["loss_rel"] < 1e-6, v
        assert v["grad_rel"] < 1e-5, v
        assert v["z_rel"] < 1e-6, v
        assert v["z_grad_rel"] < 1e-5, v
        assert v["logits_sharded"] == v["lp"], v
        assert v["tied_after_tp"] == v["tie"], v
        # Without sequence parallel only the 5 RMSNorm weights (2 per block + final) stay plain tensors.
        assert v["n_dtensor_params"] == (v["n_params"] if v["sp"] else v["n_params"] - 5), v
