"""Issue 5 check 6: a 2-process gloo FSDP2 run of the VLM (vlm_mot, and the cross-attention arch whose
extra blocks are their own FSDP2 units) equals the single-process losses within 1e-5, and a checkpoint
resumes with identical losses and the same freeze state."""

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
