"""Init time and working memory of one process: the previous algorithm vs the sharded counter-based one.

Both initialize the same decoder (default: dim 1024, 36 layers, vocab 32,000 = 490M parameters, the size of the
sharded-init test) by the same rules (:func:`kempnerforge.model.decoder_init.init_decoder_`); only the truncated-normal
draw differs:

- previous (reimplemented here as the reference): per parameter, a CPU ``torch.Generator`` seeded from (seed, FQN)
  draws the *full* tensor with ``torch.nn.init.trunc_normal_``, then :func:`kempnerforge.model.init.copy_full_` copies
  it (every rank of a mesh did all of this for every parameter);
- new: :func:`kempnerforge.model.init.trunc_normal_init_` (counter-based, only the local shard, in chunks).

The parameters are materialized and touched once before either runs; each variant's figure is its wall time (best
of ``--repeats``, alternating the two) and its peak working memory: the rise of the peak resident set (``VmHWM``,
reset through ``/proc/self/clear_refs`` before each run) over the resident set before it.

    python benchmarks/init_time.py                       # the 490M model, torch's default threads
    python benchmarks/init_time.py --n_layers 8 --threads 1 --json /tmp/init.json
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import torch
from torch import nn

from kempnerforge.config import ModelConfig
from kempnerforge.model import decoder_init
from kempnerforge.model.init import copy_full_, param_seed
from kempnerforge.model.transformer import Transformer


@torch.no_grad()
def previous_trunc_normal_init_(param: torch.Tensor, fqn: str, seed: int, std: float) -> None:
    """The previous implementation: the full tensor on CPU from a per-FQN generator, then this rank's slice."""
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


def _measure(model: Transformer, previous: bool) -> tuple[float, int | None]:
    """(seconds, peak working bytes or None where /proc is unavailable) of one ``init_weights``."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _kib("VmRSS")
    except OSError:
        base = None
    patch = mock.patch.object(decoder_init, "trunc_normal_init_", previous_trunc_normal_init_) if previous else None
    start = time.perf_counter()
    if patch:
        with patch:
            model.init_weights(seed=0)
    else:
        model.init_weights(seed=0)
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM")
    return seconds, None if base is None or peak is None else (peak - base) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=36)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=16, n_kv_heads=8, vocab_size=args.vocab_size,
                      max_seq_len=256, multiple_of=256)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # touch the pages: the runs' memory figures are their working memory only
    n = sum(p.numel() for p in model.parameters())
    runs: dict[str, list[tuple[float, int | None]]] = {"previous": [], "new": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(_measure(model, previous=name == "previous"))
    best = {k: min(s for s, _ in v) for k, v in runs.items()}
    peak = {k: max((b or 0) for _, b in v) for k, v in runs.items()}
    result = {
        "n_params": n,
        "threads": torch.get_num_threads(),
        "seconds": best,
        "ns_per_param": {k: v / n * 1e9 for k, v in best.items()},
        "speedup_new_over_previous": best["previous"] / best["new"],
        "peak_working_bytes": peak,
    }
    print(
        f"init of {n / 1e6:.0f}M params on 1 process, {result['threads']} threads: previous {best['previous']:.1f} s "
        f"(peak working memory {peak['previous'] / 2**20:.0f} MiB), new {best['new']:.1f} s "
        f"({peak['new'] / 2**20:.0f} MiB); new is {result['speedup_new_over_previous']:.2f}x faster"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
