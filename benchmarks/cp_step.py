"""Context parallelism against data parallelism at the same tokens per step, side by side in one run (issue 26).

Two launches of 2 gloo processes each train the same decoder (the debug recipe's shape by default) on the same
random tokens for ``--steps`` steps: ``cp=2`` (every sequence split over both ranks, K/V all-gathered per block;
one data shard of ``2 x --batch`` sequences) and ``dp_shard=2`` (each rank a whole sequence of its own data shard,
``--batch`` per rank). Both see ``2 x batch x seq_len`` tokens per step. Each rank times every step after
``--warmup`` (start to start, Lightning's loop); the report is the median step time of rank 0, tokens/s and the
ratio cp / dp.

    python benchmarks/cp_step.py --seq-len 2048 --json benchmarks/results/cp_step_2core.json

At the same global batch cp does the same FLOPs as dp except attention's (each rank's queries see the whole
sequence's keys, in the zigzag split the same number of pairs per rank as dp's causal attention) and adds an
all-gather of K/V and a reduce-scatter of their gradients per block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (divisible by 4)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank under dp_shard=2 (cp: 2 x this)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "cp" or "dp": one rank of a launch
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One rank: fit the model under cp=2 or dp_shard=2 and write rank 0's step times to ``--out``."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from kempnerforge.config import ModelConfig
    from kempnerforge.module import CausalLM
    from kempnerforge.strategies import KempnerStrategy

    seed_everything(0)
    cp = args.worker == "cp"
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab_size=args.vocab, max_seq_len=args.seq_len, multiple_of=64)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n_rows = 2 * args.batch * (args.steps + 1)
    tokens = torch.randint(0, args.vocab, (n_rows, args.seq_len + 1), generator=g)
    rows = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    loader = DataLoader(rows, batch_size=2 * args.batch if cp else args.batch, shuffle=False)
    times: list[float] = []

    class StepClock(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            times.append(time.perf_counter())

    strategy = KempnerStrategy(cp=2 if cp else 1, dp_shard=1 if cp else 2, mixed_precision_param="float32")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[StepClock()])  # fmt: skip
    trainer.fit(CausalLM(config=cfg), train_dataloaders=loader)
    if trainer.global_rank == 0:
        steps = [b - a for a, b in zip(times, times[1:], strict=False)][args.warmup :]
        Path(args.out).write_text(json.dumps({"step_s": steps}))


def launch(kind: str, args: argparse.Namespace, out: Path) -> list[float]:
    """One 2-process launch of this script as ``--worker kind``; rank 0's measured step times (s)."""
    shape = ("seq_len", "batch", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "steps", "warmup")
    own = [x for k in shape for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           *own, "--worker", kind, "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["step_s"]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if args.seq_len % 4:
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by 4 (2 x cp chunks)")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    tokens = 2 * args.batch * args.seq_len
    report: dict = {"seq_len": args.seq_len, "tokens_per_step": tokens, "processes": 2, "cpu_threads_per_rank": 1}
    for kind in ("dp", "cp"):
        print(f"[cp_step] {kind}: 2 processes, {args.steps} steps ...", flush=True)
        steps = launch(kind, args, tmp / f"cp_step_{kind}_{os.getpid()}.json")
        median = statistics.median(steps)
        report[kind] = {"median_step_s": median, "tokens_per_s": tokens / median, "steps_timed": len(steps)}
        print(f"[cp_step] {kind}: median step {median:.3f} s, {tokens / median:,.0f} tokens/s", flush=True)
    report["cp_over_dp_step_time"] = report["cp"]["median_step_s"] / report["dp"]["median_step_s"]
    print(f"[cp_step] cp=2 / dp_shard=2 step time: {report['cp_over_dp_step_time']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
