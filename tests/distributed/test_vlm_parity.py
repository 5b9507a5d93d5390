"""Issue 5 check 6: a 2-process gloo FSDP2 run of the VLM (vlm_mot, and the cross-attention arch whose
extra blocks are their own FSDP2 units) equals the single-process losses within 1e-5, and a checkpoint
resumes with identical losses and the same freeze state. Issue 32: joint_decoder with sequence parallelism, pipeline
stages and FP8, and MLA + MoE backbones (joint_decoder, cross_attention) under FSDP2, tp=2 (expert-TP, with and
without sequence parallelism) and ep=2, each equal to one process; the runs of one world size share one launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import launch

SCRIPT = Path(__file__).resolve().parent / "vlm_train_script.py"
pytestmark = pytest.mark.distributed


def _run(nproc: int, out: Path, *extra: str) -> dict:
    launch(nproc, SCRIPT, ["--out", str(out), *extra], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ["mot"])
def test_fsdp2_parity_and_resume_with_freeze_schedule(arch, tmp_path):
    """Issue 5 check 6 (vlm_mot) and the cross-attention blocks' FSDP2 units: the backbone is frozen
    except its new parts (cross-attention blocks / MoT's image-modality weights) until step 3, then
    trains too. 2 processes (FSDP2, micro-batch 2, full AC) equal 1 process (micro-batch 4) within
    1e-5, and resuming the step-2 checkpoint (before the switch) replays steps 3-6 exactly, with the
    switch at the same step. (TP over VLM backbone blocks: tests/distributed/test_vlm_backbones.py.)"""
    args = ["--arch", arch, "--schedule"]
    one = _run(1, tmp_path / "one.json", *args, "--micro-batch", "4")
    ckpt = tmp_path / "ckpt"
    two = _run(2, tmp_path / "two.json", *args, "--micro-batch", "2", "--ac", "full", "--ckpt-dir", str(ckpt),
               "--ckpt-every", "2")  # fmt: skip
    assert len(one["losses"]) == 6 and one["losses"][-1] < one["losses"][0]
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    assert two["trainable"][:3] != two["trainable"][3:] and len(set(two["trainable"][3:])) == 1
    step2 = ckpt / "step=0002.ckpt"
    assert step2.is_dir(), sorted(p.name for p in ckpt.iterdir())
    resumed = _run(2, tmp_path / "resumed.json", *args, "--micro-batch", "2", "--ac", "full", "--resume", str(step2))
    assert resumed["steps"][0] == 3
    assert resumed["losses"] == two["losses"][2:]
    assert resumed["trainable"] == two["trainable"][2:]


#: joint_decoder with sequence parallelism: 16 visual + 23 text positions, 39, odd, so the last position is padding on
#: the second TP rank.
SP = "--arch joint_decoder --micro-batch 4 --max-text-len 23"
#: A DeepSeek-V3-shaped backbone (vlm_train_script.py: MLA with a query latent, every block MoE with 4 experts, top-2
#: sigmoid routing with bias balancing, a shared expert, sequence aux and z losses), 5 steps on captions cut to 16
#: text positions (every caption is longer: no padding, so every rank's batch holds as many tokens).
DS = "--mla --moe --steps 5 --max-text-len 16"
#: Each launch's runs (name -> vlm_train_script.py flags): one rendezvous per world size serves every test below.
ONE = {"jd": SP, "ds_jd": f"--arch joint_decoder {DS}", "ds_cross": f"--arch cross_attention {DS}"}
TWO = {
    "jd_sp": f"{SP} --tp 2 --sequence-parallel",
    "ds_jd_fsdp": f"--arch joint_decoder {DS} --micro-batch 2",
    "ds_jd_tp": f"--arch joint_decoder {DS} --tp 2",
    "ds_jd_tp_sp": f"--arch joint_decoder {DS} --tp 2 --sequence-parallel",
    "ds_jd_ep": f"--arch joint_decoder {DS} --ep 2 --micro-batch 2",
    "ds_cross_tp": f"--arch cross_attention {DS} --tp 2",
    "ds_jd_pp": f"--arch joint_decoder {DS} --pp 2",
}
FOUR = {"jd_pp_sp": f"{SP} --pp 2 --tp 2 --sequence-parallel"}


def _runs(nproc: int, out: Path, runs: dict[str, str]) -> dict:
    specs = [f"{name}:{flags}" for name, flags in runs.items()]
    return _run(nproc, out, "--arch", "joint_decoder", "--runs", *specs)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return _runs(1, tmp_path_factory.mktemp("vlm_one") / "one.json", ONE)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _runs(2, tmp_path_factory.mktemp("vlm_two") / "two.json", TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _runs(4, tmp_path_factory.mktemp("vlm_four") / "four.json", FOUR)


def test_joint_decoder_sequence_parallel_tp2_and_pp2_equal_one_process(one, two, four):
    """Issue 32 check 3: joint_decoder with tp=2 and sequence parallelism, then pp=2 x tp=2 x SP, (the joint [visual; text] sequence split
    over the TP ranks, padded to even when the batch's length is odd; vocab-parallel loss) trains as one process
    with the fused chunked loss (loss_impl=auto at tp=1), 6 steps within 1e-5."""
    ref, sp = one["jd"], two["jd_sp"]
    assert len(ref["losses"]) == 6 and ref["losses"][-1] < ref["losses"][0]
    assert sp["sp_degree"] == 2 and ref["sp_degree"] == 1
    assert sp["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    # Issue 32 check 3, pp=2: the same run split into two pipeline stages (encoder, connector, embedding and block 0;
    # block 1, norm and head), with tp=2 and sequence parallelism inside each stage (4 processes).
    pp_sp = four["jd_pp_sp"]
    assert pp_sp["sp_degree"] == 2
    assert pp_sp["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def _assert_parity(record: dict, ref: dict, bias_rows: slice = slice(None)) -> None:
    """5 steps: losses within 1e-5 (as every VLM parity test), gradient norms within 1e-5 relative (the text path's
    MoE tolerance, tests/distributed/test_moe_tensor_parallel.py), the routers' bias after every step equal (each is a
    function of the step's global expert loads; ``bias_rows``: the reference's rows of the layers ``record``'s rank
    holds), and the oracle trains."""
    assert len(record["losses"]) == len(ref["losses"]) == 5
    assert record["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert record["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert ref["losses"][-1] < ref["losses"][0] - 0.2
    assert record["bias"] == ref["bias"][bias_rows]  # the same global expert loads every step: the same routing


@pytest.mark.parametrize("arch", ["ds_jd", "ds_cross"])
def test_mla_moe_backbone_one_process_trains_with_its_balancing(one, arch):
    """Issue 32 item 2: an MLA + MoE backbone (joint_decoder, cross_attention) builds the text model's blocks; its MoE
    layers are the module's (aux losses in the objective and logged, router bias updated every step)."""
    ref = one[arch]
    assert ref["moe_layers"] == ["layers.0.moe", "layers.1.moe"]
    assert ref["aux_logged"] and len(ref["bias"]) == 2 * 5 and any(any(b) for b in ref["bias"])


def test_mla_moe_joint_decoder_fsdp2_equals_one_process(one, two):
    """Issue 32 item 2: an MLA (+ MoE) joint_decoder under FSDP2 on 2 gloo ranks (each rank half the batch)."""
    record = two["ds_jd_fsdp"]
    _assert_parity(record, one["ds_jd"])
    assert record["placements"] == {"experts.w1": "(Shard(dim=0),)", "router": "(Shard(dim=0),)"}  # FSDP2 shards


@pytest.mark.parametrize(
    ("name", "ref", "w1", "router"),
    [
        ("ds_jd_tp", "ds_jd", "(Shard(dim=1),)", "plain"),  # expert-TP: each expert's hidden channels split
        ("ds_jd_tp_sp", "ds_jd", "(Shard(dim=1),)", "plain"),
        ("ds_cross_tp", "ds_cross", "(Shard(dim=1),)", "plain"),
        ("ds_jd_ep", "ds_jd", "Shard(dim=0))", "(Shard(dim=0),)"),  # EP (then FSDP2 over dp_shard / ep = 1)
    ],
)
def test_mla_moe_vlm_tp2_ep2_equal_one_process(one, two, name, ref, w1, router):
    """Issue 32 item 2: MoE VLM backbones under tp=2 (expert-TP, the text path's moe_block plan; heads of MLA split),
    with sequence parallelism for joint_decoder, and under ep=2 (2 processes), train as one process for 5 steps; every
    rank holds half of the routed experts' bytes; under TP the router stays a replicated plain parameter."""
    record = two[name]
    _assert_parity(record, one[ref])
    held = record["expert_bytes"]
    assert held["local"] == [held["global"] // 2] * 2, held
    assert record["placements"]["experts.w1"].endswith(w1) and record["placements"]["router"] == router
    assert record["sp_degree"] == (2 if name == "ds_jd_tp_sp" else 1)


def test_mla_moe_joint_decoder_pp2_equals_one_process(one, two):
    """Issue 32 item 2: the MLA + MoE joint_decoder in two pipeline stages (1F1B; each stage's MoE aux losses in its
    backward, its routers' bias from the loads it saw): 5 steps equal one process."""
    record = two["ds_jd_pp"]
    assert record["moe_layers"] == ["layers.0.moe"]  # rank 0: the first stage, block 0
    _assert_parity(record, one["ds_jd"], bias_rows=slice(0, None, 2))


def test_joint_decoder_pp2_with_a_tied_head_equals_one_process(tmp_path):
    """Issue 32 check 3: joint_decoder with pp=2 (1F1B, 2 micro-batches) and a tied head (the last stage's copy of the
    embedding reduced with the first stage's) trains as one process, 6 steps within 1e-5."""
    args = ["--arch", "joint_decoder", "--micro-batch", "4", "--tie"]
    one = _run(1, tmp_path / "one.json", *args)
    pp = _run(2, tmp_path / "pp.json", *args, "--pp", "2")
    assert len(one["losses"]) == 6 and one["losses"][-1] < one["losses"][0]
    assert pp["losses"] == pytest.approx(one["losses"], abs=1e-5)


def test_joint_decoder_fp8_tensorwise_tp1_and_tp2(tmp_path):
    """Issue 32 check 3: FP8 (torchao tensorwise) on a VLM: the backbone's Linears convert, the vision tower's and
    connector's do not (``float8_vision`` off), the head stays high precision; one process trains within FP8's
    rounding of the fp32 run, and tp=2 equals one process with the text path's FP8 tolerances
    (tests/distributed/test_float8_tp.py: step 1 within 1e-5 relative, later steps 1e-4)."""
    pytest.importorskip("torchao.float8")
    args = ["--arch", "joint_decoder", "--micro-batch", "4", "--steps", "5"]
    fp32 = _run(1, tmp_path / "fp32.json", *args)
    one = _run(1, tmp_path / "one.json", *args, "--float8", "tensorwise")
    two = _run(2, tmp_path / "two.json", *args, "--float8", "tensorwise", "--tp", "2")
    assert one["float8"] and all(n.startswith("backbone.layers.") for n in one["float8"]), one["float8"]
    assert len(one["float8"]) == 8  # 2 blocks x (wqkv, wo, w13, w2): fused projections, the default
    assert two["float8"] and all(n.startswith("backbone.layers.") for n in two["float8"]), two["float8"]
    assert one["losses"] != fp32["losses"] and one["losses"] == pytest.approx(fp32["losses"], rel=2e-2)
    assert two["losses"][0] == pytest.approx(one["losses"][0], rel=1e-5)
    assert two["losses"][1:] == pytest.approx(one["losses"][1:], abs=1e-4)
