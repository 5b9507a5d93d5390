"""Issue 28 check 1 at full size (a script, not part of the suite): SIGTERM to the process group of an N-process
run of the tiny debug config, without Preemption, at random points until the run is done; every run must exit 75
within 30 s and the stitched losses must equal an uninterrupted run's (1e-6).

    python -m tests.e2e.kill_soak --procs 2 --kills 10 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tests.e2e.preempt_helpers import REPO, log_text, losses, start, wait_for, write_config


def _config(tmp: Path, tokens: Path, procs: int, steps: int) -> Path:
    cfg = write_config(tmp, tokens, preemption=False)
    data = yaml.safe_load(cfg.read_text())
    data["trainer"].update(devices=procs, max_steps=steps)
    data["trainer"]["callbacks"][-1]["init_args"]["every_n_train_steps"] = 7  # the ModelCheckpoint
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def main(argv: list[str] | None = None) -> dict:
    """Run the soak; print and return the figures (runs, worst seconds to exit, largest loss difference)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kill_soak_"))
    from kempnerforge.data.prepare import prepare_data

    src = root / "head.txt"
    src.write_text((REPO / "data" / "tinyshakespeare" / "input.txt").read_text()[:100_000])
    tokens = root / "tokens"
    prepare_data(source=str(src), tokenizer=str(REPO / "data" / "tokenizers" / "gpt2"), output_dir=str(tokens))
    ref_dir, run_dir = root / "reference", root / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    ref_cfg = _config(ref_dir, tokens, args.procs, args.steps)
    assert start(ref_cfg).wait(timeout=900) == 0, log_text(ref_cfg)[-3000:]
    reference = losses(ref_dir)
    cfg = _config(run_dir, tokens, args.procs, args.steps)
    rng, exits, codes = random.Random(), [], []
    for _ in range(args.kills):
        done = len(losses(run_dir))
        if done >= args.steps - 1:
            break
        proc = start(cfg)
        wait_for(lambda d=done: len(losses(run_dir)) >= d + rng.randint(1, 2), proc, timeout=600)
        time.sleep(rng.uniform(0.0, 0.5))
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        codes.append(proc.wait(timeout=120))
        exits.append(time.monotonic() - sent)
    final = start(cfg)
    codes.append(final.wait(timeout=900))
    got = losses(run_dir)
    diff = max(abs(got[s] - reference[s]) for s in reference) if sorted(got) == sorted(reference) else float("inf")
    result = {"procs": args.procs, "kills": len(exits), "exit_codes": codes, "max_exit_s": max(exits, default=0.0),
              "max_loss_diff": diff}  # fmt: skip
    print(json.dumps(result))
    ok = all(c == 75 for c in codes[:-1]) and codes[-1] == 0 and max(exits, default=0) < 30 and diff <= 1e-6
    if not ok:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
