"""Issue 17 check 8: one of 2 ranks raises inside training_step while an async save is pending; the other exits
within 60 s (collective timeout 600 s) with the original error reported. Then the auto-resume of that folder is
rank 0's pick on every rank, even with rank 1's own view of the folder empty."""

from __future__ import annotations

import json
import os
import time

import pytest

from kempnerforge.resilience.auto_resume import find_resume_checkpoint
from tests.distributed.forked_ranks import run_ranks
from tests.distributed.launch import HERE

pytestmark = pytest.mark.distributed
SCRIPT = HERE / "failure_script.py"
FAIL_STEP = 3


def _launch(tmp, data, name: str, *args: str, timeout: float) -> tuple[int, list[dict], object]:
    out = tmp / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = ["--data", str(data), "--ckpt-dir", str(tmp / "ckpt"), "--out", str(out), *args]
    # No kill on failure: the survivor must leave by itself (torchrun / srun / Lightning would kill it).
    proc = run_ranks(2, SCRIPT, argv, env, timeout, kill_on_failure=False)
    records = [json.loads((tmp / f"{name}-rank{r}.json").read_text()) for r in range(2)]
    return proc.returncode, records, proc


def test_a_rank_failing_with_a_save_pending_ends_the_job_promptly_and_resume_agrees(tmp_path, shakespeare_tokens):
    code, (r0, r1), proc = _launch(
        tmp_path, shakespeare_tokens, "fail", "--fail-rank", "1", "--fail-step", str(FAIL_STEP),
        "--upload-delay", "1.5", timeout=300,
    )  # fmt: skip
    ended = time.time()  # every rank has exited
    assert code != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r1["pending_at_raise"], "the save of the previous step had already finished: nothing was pending"
    assert f"ValueError: boom: rank 1 at step {FAIL_STEP}" in r1["error"]
    # Before: rank 1's teardown ran a barrier for the pending save and both ranks waited for the 600 s timeout.
    assert ended - r1["raised_at"] < 60, f"the job took {ended - r1['raised_at']:.0f} s to end after the raise"
    assert "the first rank to fail was rank 1: ValueError: boom: rank 1 at step 3" in r0["error"], r0["error"]

    resume = find_resume_checkpoint(tmp_path / "ckpt")
    assert resume is not None, "no complete checkpoint survived the failure"
    saved_step = int(resume.name.split("=")[1].split(".")[0])
    code, records, proc = _launch(tmp_path, shakespeare_tokens, "resume", "--blind-rank", "1", timeout=300)
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["start_step"] for r in records] == [saved_step, saved_step]
