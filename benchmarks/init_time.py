"""Init time and working memory of one process: the previous algorithm vs the sharded counter-based one.

Both initialize the same decoder (default: dim 1024, 36 layers, vocab 32,000 = 490M parameters, the size of the
sharded-init test) by the same rules (:func:`kempnerforge.model.decoder_init.init_decoder_`); only the truncated-normal
draw differs:

- previous (reimplemented here as the reference): per parameter, a CPU ``torch.Generator`` seeded from (seed, FQN)
  draws the *full* tensor with ``torch.nn.init.trunc_normal_``, then :func:`kempnerforge.model.init.copy_full_` copies
  it (every rank of a mesh did all of this for every parameter);
- new: :func:`kempnerforge.model.init.trunc_normal_init_` (counter-based, only the local shard, in chunks).

Each run is a fresh process (alternating the two variants, ``--repeats`` each) that builds the model on meta,
materializes and touches its parameters, then times one ``init_weights``: wall seconds and process CPU seconds (all
threads), best of the repeats, and the peak working memory: the rise of the peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs`` just before init) over the resident set then. On a shared machine the CPU seconds
are the steadier figure (wall time includes waiting for a core).

    python benchmarks/init_time.py                       # the 490M model, 1 thread
    python benchmarks/init_time.py --n_layers 8 --threads 2 --json /tmp/init.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from unittest import mock

import torch
from torch import nn

from kempnerforge.config import ModelConfig
from kempnerforge.model import decoder_init
from kempnerforge.model import init as kinit
from kempnerforge.model.init import copy_full_, param_seed
from kempnerforge.model.transformer import Transformer


@torch.no_grad()
def previous_trunc_normal_init_(
    param: torch.Tensor, fqn: str, seed: int, std: float, concat: tuple = (), rows: tuple = ()
) -> None:
    """The previous implementation: the full tensor on CPU from a per-FQN generator, then this rank's slice. It
    predates fused projections (``concat``): the benchmark's decoder has separate ones."""
    if concat or rows:
        raise ValueError(f"{fqn}: the previous init has no fused projections (build the model unfused)")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, fqn))
    full = torch.empty(tuple(param.shape), dtype=torch.float32)
    nn.init.trunc_normal_(full, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    copy_full_(param, full)


def _kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_once(args: argparse.Namespace) -> dict:
    """One variant in this process: build, materialize, touch, then time and measure ``init_weights``."""
    torch.set_num_threads(args.threads)
    kinit.CHUNK_ELEMENTS = args.chunk
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=16, n_kv_heads=8, vocab_size=args.vocab_size,
                      max_seq_len=256, multiple_of=256, fuse_qkv=False, fuse_w13=False)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # touch the pages: the memory figure is init's working memory only
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _kib("VmRSS")
    except OSError:
        base = None
    patch = mock.patch.object(decoder_init, "trunc_normal_init_", previous_trunc_normal_init_)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    with patch if args.variant == "previous" else contextlib.nullcontext():
        model.init_weights(seed=0)
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    peak = _kib("VmHWM")
    return {
        "n_params": sum(p.numel() for p in model.parameters()),
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_working_bytes": None if base is None or peak is None else (peak - base) * 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=36)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each run")
    parser.add_argument(
        "--chunk", type=int, default=kinit.chunk_elements(torch.device("cpu")), help="the new init's chunk (elements)"
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--variant", choices=["previous", "new"], help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_once(args)))
        return
    shape = ["--dim", str(args.dim), "--n_layers", str(args.n_layers), "--vocab_size", str(args.vocab_size)]
    shape += ["--threads", str(args.threads), "--chunk", str(args.chunk)]
    runs: dict[str, list[dict]] = {"previous": [], "new": []}
    for _ in range(args.repeats):
        for name in runs:
            cmd = [sys.executable, __file__, *shape, "--variant", name]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    n = runs["new"][0]["n_params"]
    best = {k: {m: min(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in runs.items()}
    median = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in runs.items()}
    peak = {k: max(r["peak_working_bytes"] or 0 for r in v) for k, v in runs.items()}
    result = {
        "n_params": n,
        "threads": args.threads,
        "chunk_elements": args.chunk,
        "best": best,
        "median": median,
        "runs": runs,
        "cpu_speedup_new_over_previous": best["previous"]["cpu_s"] / best["new"]["cpu_s"],
        "wall_speedup_new_over_previous": best["previous"]["wall_s"] / best["new"]["wall_s"],
        "peak_working_bytes": peak,
    }
    print(
        f"init of {n / 1e6:.0f}M params on 1 process, {args.threads} thread(s), best (median) of {args.repeats}: "
        f"previous {best['previous']['wall_s']:.1f} ({median['previous']['wall_s']:.1f}) s wall / "
        f"{best['previous']['cpu_s']:.1f} s CPU, peak working memory {peak['previous'] / 2**20:.0f} MiB; "
        f"new {best['new']['wall_s']:.1f} ({median['new']['wall_s']:.1f}) s / {best['new']['cpu_s']:.1f} s, "
        f"{peak['new'] / 2**20:.0f} MiB; new/previous time {1 / result['wall_speedup_new_over_previous']:.2f} wall, "
        f"{1 / result['cpu_speedup_new_over_previous']:.2f} CPU"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
