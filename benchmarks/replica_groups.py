"""The cost of replica-group fault tolerance with no failure (issue 31, check 5): the same 4 ranks trained as plain HSDP
(``dp_replicate=2 x dp_shard=2``, one world) and as 2 torchft replica groups of ``dp_shard=2`` (a lighthouse in this
process), side by side in one run.

Each rank times every optimizer step after ``--warmup`` (start to start) and counts, per step, the host
synchronizations the step would make on an accelerator (``tests/host_syncs.py``), the collectives of its own process
groups (c10d ops through a ``TorchDispatchMode``, by op and group size) and the calls into torchft
(``Manager.allreduce``: a collective across the groups; ``start_quorum``: a lighthouse round trip on a background
thread; ``should_commit``: a blocking round trip to the group's manager server, which waits for every rank of the
group). Reported: the median step time of rank 0 of each run (the fastest of ``--repeats`` alternated pairs), their ratio,
and the per-step counts.

    python benchmarks/replica_groups.py --repeats 3 --json benchmarks/results/replica_groups_2core.json

On CUDA torchft's ``should_commit`` also synchronizes the device once per step (``torchft/manager.py``); on this CPU
machine there is no device to synchronize, so that host sync is stated, not measured.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(nproc: int, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", __file__, "--worker", *args]  # fmt: skip
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout: float) -> None:
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"a run failed ({proc.returncode}):\n{out[-4000:]}")


def run(args: argparse.Namespace) -> dict:
    """Both runs, one after the other; returns the report (also written to ``--json``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--dim", str(args.dim),
              "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--batch", str(args.batch)]  # fmt: skip
    hsdp_s, ft_s = [], []
    for _ in range(args.repeats):  # alternated, so a load change on the shared machine hits both
        with tempfile.TemporaryDirectory() as tmp:
            _finish([_launch(4, [*common, "--out", f"{tmp}/hsdp", "--dp-replicate", "2"], env)], args.timeout)
            os.environ.setdefault("RUST_LOG", "warn")
            from torchft.coordination import LighthouseServer

            server = LighthouseServer(bind="[::]:0", min_replicas=2, quorum_tick_ms=20)
            try:
                ft_env = {**env, "TORCHFT_LIGHTHOUSE": server.address()}
                groups = [_launch(2, [*common, "--out", f"{tmp}/ft{g}", "--group", str(g)], ft_env) for g in range(2)]
                _finish(groups, args.timeout)
            finally:
                server.shutdown()
            hsdp = json.loads(Path(f"{tmp}/hsdp-rank0.json").read_text())
            ft = json.loads(Path(f"{tmp}/ft0-rank0.json").read_text())
        hsdp_s.append(statistics.median(hsdp["step_s"]))
        ft_s.append(statistics.median(ft["step_s"]))
    report = {
        "shape": {k: getattr(args, k) for k in ("dim", "layers", "seq_len", "batch", "steps", "warmup", "repeats")},
        "ranks": 4,
        "hsdp_step_s_per_repeat": hsdp_s,
        "ft_step_s_per_repeat": ft_s,
        "hsdp_step_s": min(hsdp_s),
        "ft_step_s": min(ft_s),
        "hsdp_per_step": hsdp["per_step"],
        "ft_per_step": ft["per_step"],
        "hsdp_host_syncs_per_step": hsdp["host_syncs"],
        "ft_host_syncs_per_step": ft["host_syncs"],
        "losses_equal": hsdp["losses"] == ft["losses"],
        "load_average_1min": os.getloadavg()[0],
    }
    report["ft_over_hsdp"] = report["ft_step_s"] / report["hsdp_step_s"]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return report


def worker(args: argparse.Namespace) -> None:
    """One rank: train, time each step, count collectives and torchft calls per step; rank-local JSON."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(REPO))  # tests/host_syncs.py: the project's host-synchronization counter
    from kempnerforge.config import ModelConfig
    from kempnerforge.module import CausalLM
    from kempnerforge.resilience.ft_config import FaultTolerance
    from kempnerforge.strategies import KempnerStrategy
    from kempnerforge.training.optimizers import OptimizerConfig
    from tests.host_syncs import HostSyncCounter

    counts: collections.Counter = collections.Counter()

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args_=(), kwargs=None):
            packet = func._overloadpacket
            if packet in c10d_collective_ops:
                groups = [a for a in args_ if isinstance(a, torch.ScriptObject)]
                size = dist.ProcessGroup.unbox(groups[0]).size() if groups else "?"
                counts[f"{packet.__name__}@{size}"] += 1
            return func(*args_, **(kwargs or {}))

    class Steps(Callback):
        def __init__(self) -> None:
            self.starts, self.losses, self.per_step = [], [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.starts.append(time.perf_counter())
            counts.clear()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
            if batch_idx >= args.warmup:
                self.per_step.append(dict(counts))

    def count_calls(manager) -> None:
        for name in ("allreduce", "start_quorum", "should_commit"):
            inner = getattr(manager, name)

            def counted(*a, _inner=inner, _name=name, **kw):
                counts[f"torchft.{_name}"] += 1
                return _inner(*a, **kw)

            setattr(manager, name, counted)

    class CountTorchft(Callback):
        def on_train_start(self, trainer, module) -> None:
            if trainer.strategy.replica_groups is not None:
                count_calls(trainer.strategy.replica_groups.manager)

    seed_everything(0)
    vocab = 4096
    module = CausalLM(
        config=ModelConfig(
            dim=args.dim,
            n_layers=args.layers,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=vocab,
            max_seq_len=args.seq_len,
            multiple_of=32,
        ),  # fmt: skip
        optimizer=OptimizerConfig(lr=1e-3),
    )
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (4 * args.batch * (args.steps + 1), args.seq_len + 1), generator=g)
    from kempnerforge.data.datamodule import ResumableLoaders

    class Random(ResumableLoaders):
        def setup(self, stage=None):
            self.train_dataset = [{"input_ids": r[:-1], "labels": r[1:]} for r in data]
            self.val_dataset, self.micro_batch_size, self.data_seed, self.num_workers = None, args.batch, 0, 0

    ft = None
    if args.group is not None:
        ft = FaultTolerance(replica_group_id=args.group, num_replica_groups=2, timeout_s=120, quorum_timeout_s=120)
    steps, syncs = Steps(), HostSyncCounter()
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=KempnerStrategy(dp_replicate=args.dp_replicate, fault_tolerance=ft),
        max_steps=args.steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[steps, CountTorchft(), syncs.callback(warmup=args.warmup)],
    )
    with Collectives(), syncs:
        trainer.fit(module, datamodule=Random())
    last = syncs.per_iteration(args.warmup, args.steps - 2)  # the last step's own syncs are not all counted
    host_syncs = [f"{e.op}@{os.path.relpath(e.where.split(':')[0], REPO)}" for e in last[max(last)]] if last else []
    step_s = [b - a for a, b in zip(steps.starts[args.warmup :], steps.starts[args.warmup + 1 :], strict=False)]
    rank = int(os.environ["RANK"])
    Path(f"{args.out}-rank{rank}.json").write_text(
        json.dumps({"step_s": step_s, "losses": steps.losses, "per_step": steps.per_step[-1], "host_syncs": host_syncs})
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dp-replicate", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps not timed")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument(
        "--repeats", type=int, default=1, help="HSDP / fault-tolerant pairs, alternated; the fastest of each"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    worker(args) if args.worker else run(args)


if __name__ == "__main__":
    main()
