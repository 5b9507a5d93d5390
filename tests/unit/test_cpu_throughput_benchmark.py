"""benchmarks/cpu_throughput.py finishes at a tiny shape for the step counts people pass (it once crashed on
``--steps 10 --warmup 2``: kforge's start-to-start meter records one closing iteration more than the plain loop)
and writes its JSON, with kforge's losses equal to the plain loop's at every measured step. Issue 29 check 5: the
counts ``--steps 4 --warmup 1``, ``--steps 8`` and the performance page's ``--steps 10 --warmup 2 --repeats 2``, in
one process (the script's ``main(argv)`` three times: one import of torch and Lightning)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.procs import run_group

REPO = Path(__file__).resolve().parents[2]
TINY = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "2", "--vocab", "512", "--seq-len", "16",
        "--batch-size", "2", "--only", "a,b", "--peak-n", "64"]  # fmt: skip
COUNTS = {"4+1": ["--steps", "4", "--warmup", "1"], "8": ["--steps", "8"],
          "page": ["--steps", "10", "--warmup", "2", "--repeats", "2"]}  # fmt: skip
DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cpu_throughput", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["cpu_throughput"] = module
spec.loader.exec_module(module)
for name, argv in json.loads(sys.argv[2]).items():
    module.main(argv)
"""


def test_tiny_runs_write_their_json_with_equal_losses(tmp_path):
    runs = {name: [*TINY, *counts, "--json", str(tmp_path / f"{name}.json")] for name, counts in COUNTS.items()}
    script = str(REPO / "benchmarks" / "cpu_throughput.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", DRIVER, script, json.dumps(runs)]
    proc = run_group(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name, counts in COUNTS.items():
        result = json.loads((tmp_path / f"{name}.json").read_text())
        steps = int(counts[1])
        assert result["steps"] == steps, name
        repeats = int(counts[counts.index("--repeats") + 1]) if "--repeats" in counts else 1
        for key in ("a", "b"):
            assert len(result["trainers"][key]["runs"]) == repeats, name
            for run in result["trainers"][key]["runs"]:
                assert len(run["losses"]) == result["warmup"] + steps, name
        assert result["losses_equal_1e-5"] is True, name
