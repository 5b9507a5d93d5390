"""DataLoader workers ignore the stop signals (the training process decides when to stop) without ever keeping
their parent from exiting: a process that still holds a loader iterator with live workers at exit used to hang
forever after its last line (multiprocessing's exit hook SIGTERMs daemonic children, which these ignore, then joins
them). That is how the stop-36 CI run printed its summary and then ran out its 90 minutes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, signal, time
import torch
from kempnerforge.data.datamodule import resumable_loader

class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 84
    def __getitem__(self, i):
        return i

loader = resumable_loader(Windows(), 10, 0, 1, True, 0, 2)
it = iter(loader)
next(it)
workers = [w.pid for w in it._workers]
for pid in workers:
    os.kill(pid, signal.SIGTERM)  # a group signal: the workers stay
time.sleep(1.5)
print("alive", sum(w.is_alive() for w in it._workers), flush=True)
KEEP = (loader, it)  # still referenced at exit, its workers idle
"""


def test_a_process_holding_live_workers_at_exit_still_exits(tmp_path):
    script = tmp_path / "hold_workers.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = run_group([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "alive 2" in proc.stdout, proc.stdout  # SIGTERM did not end them
    assert took < 60, took  # the exit hook ended them (it hung for good before)
