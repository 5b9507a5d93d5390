"""Issue 20 check 2: imported Llama-3.1 (llama3 RoPE), Qwen 2.5 (q/k/v biases, tied), Qwen 3 (QK-norm, head_dim 32 on
width 64, YaRN) and Qwen3-MoE models train under ``dp_shard=2`` and under ``tp=2`` exactly as in one process.

Two launches of ``hf_family_script.py``: one process (the oracles, one per family) and two processes (dp_shard=2, and
tp=2 with full activation checkpointing, for every family). Each run starts from the weights-only checkpoint ``kforge convert hf-to-dcp`` wrote (as
``kforge fit --ckpt_path`` does) and takes 5 AdamW steps; losses and grad norms match within 1e-5 relative, and
under tp the biases / QK-norm weights really are DTensors with the placements of their Linears.
"""

from __future__ import annotations

import pytest

from kempnerforge.checkpoint.convert import hf_to_dcp
from tests.distributed.launch import HERE, launch_runs
from tests.hf_family_models import ISSUE_FAMILIES as FAMILIES
from tests.hf_family_models import save_hf_model

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "hf_family_script.py"


@pytest.fixture(scope="module")
def records(shakespeare_tokens, tmp_path_factory):
    """{run name: record} of both launches; models with the GPT-2 vocabulary of the token data."""
    root = tmp_path_factory.mktemp("hf_families")
    for family in FAMILIES:
        hf_to_dcp(save_hf_model(family, root / f"{family}_hf", vocab_size=50257), root / family)
    single = [f"{f}:family={f}" for f in FAMILIES]
    two = [f"{f}_dp:family={f},micro_batch=2" for f in FAMILIES] + [f"{f}_tp:family={f},tp=2,ac=full" for f in FAMILIES]
    out = launch_runs(1, SCRIPT, shakespeare_tokens, root, single, ckpt_root=True, timeout=400, tag="hf1")
    return {**out, **launch_runs(2, SCRIPT, shakespeare_tokens, root, two, ckpt_root=True, timeout=400, tag="hf2")}


@pytest.mark.parametrize("layout", ["dp", "tp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_five_steps_equal_one_process(records, family, layout):
    record, oracle = records[f"{family}_{layout}"], records[family]
    assert len(record["losses"]) == len(oracle["losses"]) == 5
    for key in ("losses", "grad_norms"):
        for a, b in zip(record[key], oracle[key], strict=True):
            assert a == pytest.approx(b, rel=1e-5), (key, record[key], oracle[key])
    assert oracle["losses"][-1] < oracle["losses"][0]  # the oracle really trains
    placements = record["placements"]
    assert record["checkpointed"] == (layout == "tp")
    if layout == "tp":
        assert placements["layers.0.attention.wqkv.weight"].startswith("(Shard(dim=0)")  # the default fused wqkv
        if family == "qwen2":  # the bias is sharded with its Colwise Linear's rows
            assert placements["layers.0.attention.wqkv.bias"] == placements["layers.0.attention.wqkv.weight"]
        if family.startswith("qwen3"):
            assert "Replicate()" in placements["layers.0.attention.q_norm.weight"]
    else:
        assert all(p.startswith("(Shard(dim=0)") for p in placements.values())  # FSDP2 shards every parameter
