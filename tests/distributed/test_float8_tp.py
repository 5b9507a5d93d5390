"""Issue 19 check 3: FP8 (tensorwise and rowwise) under tensor parallelism, and FP8 + TP + FSDP2 + full AC.

Three launches of ``fp8_tp_script.py`` (dim-32 decoder, 5 steps, global batch 8 x 32 tokens, fp32 master weights):
1 process (the oracles: tensorwise, rowwise, tensorwise + full AC), 2 processes (tp=2: tensorwise, rowwise,
rowwise + sequence parallel), 4 processes (tp=2 x dp_shard=2, full AC: tensorwise, tensorwise + float8
all-gather, rowwise).

The FP8 tolerance, and why. FP8 scales are amax-based (one per tensor, or per row for rowwise): under TP a
sharded weight's / activation's / gradient's amax is reduced over the TP ranks (a ``Partial(max)`` DTensor), so
the scales are the one-process scales. Measured on step 1: every tensorwise forward scale is bit-identical; of the
4032 rowwise row scales one differs, by exactly 2x (rowwise scales are rounded to powers of two, and an fp32
reduction-order difference of ~1e-7 in one row's amax crossed a power of two). So step 1 is held to 1e-5 relative
(measured: loss 1.8e-7 tensorwise / 6.2e-7 rowwise, grad norm 0 / 2.8e-6). After the first update the runs
part by FP8 rounding, not by a scale: an fp32 difference of 1e-7 moves a few elements across an e4m3 rounding
boundary (a 2^-4 relative step each), and AdamW's first updates (about +-lr for every element, whatever its size)
carry such flips into the weights. Measured over steps 2-5: losses within 3.5e-5, grad norms within 2e-3
relative (fp32 TP under the same script: 1e-7), hence 1e-4 and 5e-3. With dp_shard=2 every data-parallel rank
scales its own activations and gradients (amax over its half of the batch, as on a cluster), so the input scales
and the step-1 grad norm differ from one process by design (measured 2.4e-4 at step 1); the weight scales are
still whole-tensor and are compared exactly.
"""

from __future__ import annotations

import pytest

from tests.distributed.launch import HERE, launch_runs

pytestmark = pytest.mark.distributed

pytest.importorskip("torchao.float8")

SCRIPT = HERE / "fp8_tp_script.py"
N_FLOAT8 = 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3), pinned separate; the head stays high precision
FIRST_STEP, LATER_LOSS, LATER_NORM = 1e-5, 1e-4, 5e-3


def _launch(nproc: int, data, root, runs: list[str]) -> dict:
    return launch_runs(nproc, SCRIPT, data, root, runs)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_tp")


@pytest.fixture(scope="module")
def single(shakespeare_tokens, root):
    return _launch(1, shakespeare_tokens, root, ["tw:f8=tensorwise", "rw:f8=rowwise", "tw_ac:f8=tensorwise,ac=full"])


@pytest.fixture(scope="module")
def two(shakespeare_tokens, root):
    runs = ["tw:f8=tensorwise,tp=2", "rw:f8=rowwise,tp=2", "rw_sp:f8=rowwise,tp=2,sp=1"]
    return _launch(2, shakespeare_tokens, root, runs)


@pytest.fixture(scope="module")
def four(shakespeare_tokens, root):
    layout = "tp=2,dp_shard=2,micro_batch=4,ac=full"
    runs = [f"tw_ac:f8=tensorwise,{layout}", f"tw_ag:f8=tensorwise,ag=1,{layout}", f"rw_ac:f8=rowwise,{layout}"]
    return _launch(4, shakespeare_tokens, root, runs)


def _rel(a: float, b: float) -> float:
    return abs(a / b - 1)


def _styles(record: dict) -> set[str]:
    assert len(record["float8"]) == N_FLOAT8, record["float8"]
    return {hook.split(".")[0] for hook in record["float8"].values()}


def _later_steps_close(record: dict, ref: dict) -> None:
    assert record["steps"] == ref["steps"] == [1, 2, 3, 4, 5]
    for a, b in zip(record["losses"], ref["losses"], strict=True):
        assert _rel(a, b) < LATER_LOSS, (record["losses"], ref["losses"])
    for a, b in zip(record["grad_norms"], ref["grad_norms"], strict=True):
        assert _rel(a, b) < LATER_NORM, (record["grad_norms"], ref["grad_norms"])
    assert record["losses"][-1] < record["losses"][0]


def _forward_scales(record: dict) -> list[list[float]]:
    """The forward casts of step 1: per Float8Linear, in call order, (input scale, weight scale)."""
    return record["scales"][: 2 * N_FLOAT8]


@pytest.mark.parametrize("name", ["tw", "rw", "rw_sp"])
def test_fp8_tp2_equals_one_process(two, single, name):
    """tp=2: the styles (torchao's float8 ones for tensorwise, the stock ones for rowwise), the step-1 scales,
    step 1 within 1e-5 and steps 2-5 within the FP8 tolerance of one process."""
    record, ref = two[name], single[name.split("_")[0]]
    expected = (
        {"Float8ColwiseParallel", "Float8RowwiseParallel"} if name == "tw" else {"ColwiseParallel", "RowwiseParallel"}
    )
    assert _styles(record) == expected
    ratios = [
        a / b
        for sa, sb in zip(_forward_scales(record), _forward_scales(ref), strict=True)
        for a, b in zip(sa, sb, strict=True)
    ]
    if name == "tw":
        assert set(ratios) == {1.0}
    else:  # power-of-two row scales: a reordered fp32 amax may cross a power of two (measured: 1 row of 4032)
        assert set(ratios) <= {0.5, 1.0, 2.0} and sum(r != 1.0 for r in ratios) <= len(ratios) // 1000
    assert _rel(record["losses"][0], ref["losses"][0]) < FIRST_STEP
    assert _rel(record["grad_norms"][0], ref["grad_norms"][0]) < FIRST_STEP
    _later_steps_close(record, ref)


@pytest.mark.parametrize("name", ["tw_ac", "tw_ag", "rw_ac"])
def test_fp8_tp2_fsdp2_full_ac_equals_one_process(four, single, name):
    """tp=2 x dp_shard=2 with full AC (and the FSDP2 float8 all-gather): weight scales exact on step 1 (with the
    all-gather: the precomputed ones), losses and grad norms within the FP8 tolerance of one process."""
    record, ref = four[name], single["tw_ac" if name.startswith("tw") else "rw"]
    assert _styles(record) == (
        {"Float8ColwiseParallel", "Float8RowwiseParallel"}
        if name.startswith("tw")
        else {"ColwiseParallel", "RowwiseParallel"}
    )
    ref_weights = [s for s in _forward_scales(ref)[1::2]]
    if name == "tw_ag":
        assert sorted(record["precomputed"]) == sorted(s[0] for s in ref_weights)  # modules() order, not call order
    else:
        assert [s for s in _forward_scales(record)[1::2]] == ref_weights
    assert _rel(record["losses"][0], ref["losses"][0]) < FIRST_STEP  # step-1 loss: per-rank scales, same weights
    _later_steps_close(record, ref)
