"""Check 6: a 2-process gloo FSDP2 run of the VLM equals the single-process losses within 1e-5 (every
registered arch), a checkpoint resumes with identical losses and the same freeze state, and TP=2 over
the backbone blocks equals one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kempnerforge.model.vlm import ARCHS
from tests.distributed.launch import torchrun

SCRIPT = Path(__file__).resolve().parent / "vlm_train_script.py"
pytestmark = pytest.mark.distributed


def _run(nproc: int, out: Path, *extra: str) -> dict:
    torchrun(nproc, SCRIPT, ["--out", str(out), *extra], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", sorted(a for a in ARCHS if a != "cross_attention"))
def test_fsdp2_two_processes_equal_one(arch, tmp_path):
    one = _run(1, tmp_path / "one.json", "--arch", arch, "--micro-batch", "4")
    two = _run(2, tmp_path / "two.json", "--arch", arch, "--micro-batch", "2", "--ac", "full")
    assert len(one["losses"]) == 6
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    assert one["losses"][-1] < one["losses"][0]


def test_cross_attention_fsdp2_parity_and_resume_with_freeze_schedule(tmp_path):
    """Backbone frozen (cross blocks and connector train) until step 3, then the backbone trains too;
    the 2-process run equals 1 process, and resuming the step-2 checkpoint (before the switch) replays
    steps 3-6 exactly, with the switch happening at the same step; TP=2 with AC equals one process too."""
    args = ["--arch", "cross_attention", "--schedule"]
    one = _run(1, tmp_path / "one.json", *args, "--micro-batch", "4")
    ckpt = tmp_path / "ckpt"
    two = _run(2, tmp_path / "two.json", *args, "--micro-batch", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", "2")
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    assert two["trainable"][:3] != two["trainable"][3:] and len(set(two["trainable"][3:])) == 1
    step2 = ckpt / "step=0002.ckpt"
    assert step2.is_dir(), sorted(p.name for p in ckpt.iterdir())
    resumed = _run(2, tmp_path / "resumed.json", *args, "--micro-batch", "2", "--resume", str(step2))
    assert resumed["steps"][0] == 3
    assert resumed["losses"] == two["losses"][2:]
    assert resumed["trainable"] == two["trainable"][2:]
    # Tensor parallelism over the backbone blocks (cross blocks planned by full path) on the same batch.
    tp = _run(2, tmp_path / "tp.json", *args, "--micro-batch", "4", "--tp", "2", "--ac", "full")
    assert one["losses"] == pytest.approx(tp["losses"], abs=1e-5)
