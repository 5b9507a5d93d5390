"""Check 3: NaN guard on 2 gloo ranks (KempnerStrategy / FSDP2), NaN injected into rank 0's loss only."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import HERE, launch

pytestmark = pytest.mark.distributed
SCRIPT = HERE / "nan_guard_script.py"


def _run(tmp, data, name: str, *args: str) -> list[dict]:
    out = tmp / name
    launch(2, SCRIPT, ["--data", str(data), "--out", str(out), *args])
    return [torch.load(f"{out}-rank{r}.pt", weights_only=True) for r in range(2)]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_skip_leaves_all_ranks_equal_to_a_run_without_that_batch(tmp_path, shakespeare_tokens):
    """Also: rank 1 alone gets SIGUSR1 in the last step; Preemption (own agreement 1e6 s away) learns it
    through NaNGuard's reduction of that step, so both ranks save the same checkpoint together."""
    preempt = tmp_path / "preempt"
    guarded = _run(tmp_path, shakespeare_tokens, "skip", "--steps", "8", "--action", "skip", "--nan-step", "3",
                   "--signal-step", "7", "--preempt-dir", str(preempt))  # fmt: skip
    oracle = _run(tmp_path, shakespeare_tokens, "oracle", "--steps", "7", "--drop", "3")
    assert guarded[0]["skipped"] == guarded[1]["skipped"] == [3]  # agreed: rank 1's own loss was finite
    _assert_same(guarded[0]["weights"], guarded[1]["weights"])
    _assert_same(guarded[0]["weights"], oracle[0]["weights"])
    assert all(torch.isfinite(w).all() for w in guarded[0]["weights"].values())
    saved = str(preempt / "step=000008.ckpt")
    assert guarded[0]["preempted"] == guarded[1]["preempted"] == saved
    assert (preempt / "step=000008.ckpt" / "COMPLETE").is_file()


def test_rollback_reloads_last_checkpoint_and_continues(tmp_path, shakespeare_tokens):
    """NaN at step 5 rolls back to step=0004 (batch 4's update is undone) and trains on: equal to a run
    that never saw batches 4 and 5."""
    ckpt = tmp_path / "ckpt"
    rolled = _run(
        tmp_path,
        shakespeare_tokens,
        "rb",
        "--steps",
        "8",
        "--action",
        "rollback",
        "--nan-step",
        "5",
        "--ckpt-dir",
        str(ckpt),
    )
    oracle = _run(tmp_path, shakespeare_tokens, "oracle", "--steps", "6", "--drop", "4,5")
    assert rolled[0]["rollbacks"] == rolled[1]["rollbacks"] == 1
    _assert_same(rolled[0]["weights"], rolled[1]["weights"])
    _assert_same(rolled[0]["weights"], oracle[0]["weights"])
    assert (ckpt / "protected").read_text().strip() == "step=0004.ckpt"  # retention keeps the rollback target
