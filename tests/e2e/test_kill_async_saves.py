"""Issue 17 check 7: a `kforge fit` with async saves every 2 steps and Lightning's default save_top_k=1 is killed
with SIGKILL at 10 random points; after every kill the folder holds a complete checkpoint to resume from (once a
first save completed), never older than the one before, and the restart resumes exactly that one.

One process proves the point (the deletion races are on rank 0; the 2-rank commit is check 8's and the
preemption tests'); each run is a rank forked from the pre-imported forkserver, so a restart costs its
set-up and a few steps, not 10 s of imports.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import yaml

from kempnerforge.resilience.auto_resume import find_resume_checkpoint
from tests.distributed.forked_ranks import start_one
from tests.e2e.preempt_helpers import losses, write_config

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = Path(__file__).with_name("kforge_script.py")
KILLS, MAX_STEPS, EVERY = 10, 80, 2


def _config(tmp: Path, data: Path) -> Path:
    cfg_path = write_config(tmp, data, async_save=True)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["trainer"].update(devices=1, max_steps=MAX_STEPS)
    # Only what the check needs: the throughput monitors measure a matmul peak at every start.
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "Monitor" not in c["class_path"]]
    ckpt = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))["init_args"]
    ckpt.update(every_n_train_steps=EVERY, save_top_k=1)  # Lightning's default rotation
    cfg_path.write_text(yaml.safe_dump(cfg))
    return cfg_path


def _step(ckpt: Path | None) -> int:
    return -1 if ckpt is None else int(ckpt.name.split("=")[1].split(".")[0])


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers at once, as `kill -9` of a job
    except ProcessLookupError:
        proc.kill()
    proc.join(30)


def test_sigkill_at_random_points_always_leaves_a_complete_checkpoint(tmp_path, shakespeare_tokens):
    cfg, ckpt = _config(tmp_path, shakespeare_tokens), tmp_path / "ckpt"
    args, env = ["fit", "--config", str(cfg)], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    rng = random.Random()
    found, history, steps = None, [], []
    for i in range(KILLS + 1):
        log = tmp_path / f"run{i}.log"
        proc = start_one(SCRIPT, args, env, log, tmp_path / f"run{i}.err")
        done = max(losses(tmp_path), default=-1)
        if i == KILLS:  # the last run goes to the end
            proc.join(300)
            assert proc.exitcode == 0, (tmp_path / f"run{i}.err").read_text()[-3000:]
        else:  # kill 1-4 steps after this run's first step, somewhere inside the step
            target = done + rng.randint(1, 4)
            end = time.monotonic() + 180
            while max(losses(tmp_path), default=-1) < target and proc.is_alive() and time.monotonic() < end:
                time.sleep(0.01)
            assert proc.is_alive(), (tmp_path / f"run{i}.err").read_text()[-3000:]
            time.sleep(rng.uniform(0.0, 0.3))
            _kill(proc)
        text = log.read_text() + (tmp_path / f"run{i}.err").read_text()
        expected = f"resuming from {found}" if found is not None else "no complete checkpoint in"
        assert expected in text, f"run {i} did not resume from {found}:\n{text[-3000:]}"
        previous, found = found, find_resume_checkpoint(ckpt)
        history.append((i, sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []))
        steps.append((_step(previous), _step(found)))
        # Once a save has completed there is always one, and never an older one than before.
        assert found is not None or previous is None, history
        assert _step(found) >= _step(previous), history
    assert _step(found) == MAX_STEPS and not list(ckpt.glob("*.partial"))  # each killed save was redone
    # A kill between a save's completion and the removal of the one before leaves that older one behind
    # (ModelCheckpoint of the resumed run does not know it): never more than one per kill.
    assert len(list(ckpt.glob("*.ckpt"))) <= 1 + KILLS
    with_checkpoint = sum(1 for before, _ in steps[:KILLS] if before >= EVERY)
    assert with_checkpoint >= KILLS // 2, f"too few kills landed after a completed save: {steps}"
