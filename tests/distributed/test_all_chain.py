"""Issue 19 check 4: TP -> EP -> FP8 -> full AC -> per-block compile -> FSDP2 on one MoE model, all at once.

Two launches of ``moe_tp_script.py`` (the ``chain`` model: dim 32, 2 heads of 16, SwiGLU and expert width 32,
block 0 dense and block 1 MoE with 4 experts, top-2, a shared expert; 5 steps on 8 x 32 tokens, fp32 master
weights, gloo): 1 process and 4 processes (``tp=2 x ep=2``, ``dp_shard=2``), both with ``float8_recipe=tensorwise``, full
AC and per-block compile with the ``aot_eager`` backend (traced forward and backward graphs, no code generation:
inductor's cold compile of these graphs takes minutes on 2 cores; tests/gpu runs inductor). ~90 s on 2 cores.

``tp=2`` with compile alone is also in tests/distributed/test_parallel_parity.py (``compile-tp2-*``).

Asserted: the dense Linears really are ``Float8Linear`` (attention, dense and shared-expert SwiGLU; not the
experts, router or head); the dense block compiles whole and the MoE block piecewise around its FSDP2 units
(attention, norms, shared expert; the router, the MoE glue, the EP all-to-all and the experts eager); losses and
grad norms within the FP8 tolerance of tests/distributed/test_float8_tp.py: step-1 loss 1e-5 (same weights; every
data-parallel rank scales its own activations; measured 1.1e-6), later losses 1e-4 (measured 4.5e-5 at step 5).
Grad norms: 1e-3 at step 1 (per-rank input scales over half of the batch; measured 6.4e-4) and 1e-2 after
(measured 1.9e-3 at step 5; 6.0e-3 with ep=2 x dp_shard=4: the FP8 rounding flips of test_float8_tp, carried
into the routing, hence looser than its 5e-3). The order check is tests/unit/test_order.py's.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import HERE, launch_runs

pytestmark = pytest.mark.distributed

pytest.importorskip("torchao.float8")

SCRIPT = HERE / "moe_tp_script.py"
CHAIN = "router=chain,f8=tensorwise,ac=full,compile=1,backend=aot_eager"
FLOAT8 = [f"layers.{i}.attention.{w}" for i in (0, 1) for w in ("wqkv", "wo")]  # the default fused projections
FLOAT8 += [f"layers.0.feed_forward.{w}" for w in ("w13", "w2")]
FLOAT8 += [f"layers.1.moe.shared_experts.0.{w}" for w in ("w1", "w2", "w3")]
PIECES = [
    "layers.0",
    "layers.1.attention_norm",
    "layers.1.attention",
    "layers.1.ffn_norm",
    "layers.1.moe.shared_experts.0",
]


def _launch(nproc: int, data, root, opts: str) -> dict:
    return launch_runs(nproc, SCRIPT, data, root, [f"chain:{opts}"], timeout=400, tag="chain")["chain"]


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1)


def test_tp_ep_fp8_ac_compile_fsdp2_equals_one_process(shakespeare_tokens, tmp_path):
    single = _launch(1, shakespeare_tokens, tmp_path, CHAIN)
    four = _launch(4, shakespeare_tokens, tmp_path, f"{CHAIN},tp=2,ep=2,micro_batch=4")
    for record in (single, four):
        assert sorted(record["float8"]) == sorted(FLOAT8)
    assert single["compiled"] == ["layers.0", "layers.1"]  # ep=1: both blocks whole
    assert four["compiled"] == PIECES
    assert four["expert_bytes"]["local"] == [four["expert_bytes"]["global"] // 4] * 4
    assert _rel(four["losses"][0], single["losses"][0]) < 1e-5
    assert _rel(four["grad_norms"][0], single["grad_norms"][0]) < 1e-3
    for a, b in zip(four["losses"], single["losses"], strict=True):
        assert _rel(a, b) < 1e-4, (four["losses"], single["losses"])
    for a, b in zip(four["grad_norms"], single["grad_norms"], strict=True):
        assert _rel(a, b) < 1e-2, (four["grad_norms"], single["grad_norms"])
    assert single["losses"][-1] < single["losses"][0]
