"""Peak host memory of the loss: plain (full fp32 logits) vs chunked (fused head + cross-entropy).

Each variant runs in its own fresh process: build the final hidden states (tokens x dim) and the head
weight (vocab x dim), then one forward + backward of the summed token loss; the figure is the rise
of the peak resident set (``VmHWM``, reset just before the loss through ``/proc/self/clear_refs``;
``ru_maxrss`` where that is unavailable; on Linux ``ru_maxrss`` survives ``exec`` and so starts at
the parent's peak) over the resident set just before the loss. Default
shape: 8 x 256 = 2,048 tokens, dim 256, vocab 50,304 (the CPU throughput benchmark's shape), where
the plain path's logits alone are 2048 * 50304 * 4 B = 412 MB.

    python benchmarks/chunked_ce_memory.py                 # chunk 256
    python benchmarks/chunked_ce_memory.py --chunk 1024 --vocab 128256 --json /tmp/cce.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

_CHILD = r"""
import resource, sys, time, torch, torch.nn.functional as F
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    return None

tokens, dim, vocab, chunk = (int(a) for a in sys.argv[1:5])
torch.manual_seed(0)
h = torch.randn(tokens, dim, requires_grad=True)
w = (torch.randn(vocab, dim) * 0.02).requires_grad_()
y = torch.randint(0, vocab, (tokens,))
h.grad = torch.zeros_like(h); w.grad = torch.zeros_like(w)  # gradient buffers exist in both variants
try:  # reset the peak (VmHWM) to the current RSS, so import-time peaks do not hide the loss's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
except OSError:
    before = None
if before is None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if chunk == 0:
    loss = F.cross_entropy(h @ w.t(), y, reduction="sum")
else:
    loss, _ = chunked_linear_cross_entropy_sum(h, w, y, chunk)
loss.backward()
elapsed = time.perf_counter() - t
peak = kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{(peak - before) / 1024:.1f} {elapsed:.3f} {loss.item():.6f}")
"""


def run(tokens: int, dim: int, vocab: int, chunk: int) -> dict[str, float]:
    """One variant in a fresh process; returns peak rise (MiB), time (s) and the loss value."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tokens), str(dim), str(vocab), str(chunk)],
        capture_output=True,
        text=True,
        check=True,
    )
    rise, seconds, loss = (float(x) for x in out.stdout.split()[-3:])
    return {"peak_rise_mib": rise, "seconds": seconds, "loss": loss}


def main(argv: list[str] | None = None) -> dict:
    """Run both variants, print the table and the ratio; optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the chunked variant")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens {args.tokens}, dim {args.dim}, vocab {args.vocab}: full fp32 logits = {logits_mib:.0f} MiB")
    started = time.time()
    plain = run(args.tokens, args.dim, args.vocab, 0)
    chunked = run(args.tokens, args.dim, args.vocab, args.chunk)
    print(f"{'variant':<18}{'peak rise MiB':>14}{'seconds':>9}{'loss':>16}")
    print(f"{'plain':<18}{plain['peak_rise_mib']:>14.1f}{plain['seconds']:>9.3f}{plain['loss']:>16.4f}")
    name = f"chunked ({args.chunk})"
    print(f"{name:<18}{chunked['peak_rise_mib']:>14.1f}{chunked['seconds']:>9.3f}{chunked['loss']:>16.4f}")
    ratio = chunked["peak_rise_mib"] / max(plain["peak_rise_mib"], 1e-9)
    print(
        f"chunked / plain peak memory = {ratio:.3f}; relative loss difference {abs(chunked['loss'] / plain['loss'] - 1):.1e}"
    )
    result = {
        "args": vars(args) | {"json": None},
        "plain": plain,
        "chunked": chunked,
        "ratio": ratio,
        "wall_s": time.time() - started,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
