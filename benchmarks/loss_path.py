"""CPU cost of the loss path at a large vocabulary: full logits vs in-place CE vs compiled vs chunked linear-CE.

What it measures
----------------
One process trains ``kempnerforge.model.Transformer`` (default: the CPU throughput benchmark's shape, dim 256,
4 layers, vocab 50,304, seq 256, batch 8, fp32) with AdamW (``build_adamw``), every step forward + summed
token cross-entropy / target count + backward + optimizer step. The variants differ only in how the loss is
computed from the final hidden states:

  native        ``model(x)`` logits, then ``F.cross_entropy(logits.float(), reduction="sum")`` (the path before
                issue 21: log-softmax, ``nll_loss``, a logits-sized zero-fill in its backward)
  inplace       ``model(x)`` logits, then :func:`kempnerforge.training.cross_entropy.softmax_cross_entropy_sum`
                (the saved softmax becomes the gradient in place)
  compiled      ``model(x)`` logits, then ``torch.compile`` of the native loss function (inductor)
  compiled_lin  hidden states, then ``torch.compile`` of head matmul + cross-entropy together
  old-N         the chunked linear-CE as it was before issue 21, chunks of N tokens (copied below)
  chunked-N     :func:`kempnerforge.training.chunked_ce.chunked_linear_cross_entropy_sum`, chunks of N tokens
                (``auto``: :func:`~kempnerforge.training.chunked_ce.default_chunk_size`)

All variants share one model and one optimizer and run round-robin (the order rotates every round), so each
round is a paired sample on the same machine state; per variant the table gives the median process CPU time
per step (all threads) and its median ratio to ``native`` over the rounds, and the median MiB of fresh pages
(minor page faults x page size) per step, the memory the allocator took back from the OS. ``--peak`` also
measures, each variant in its own process, the rise of the peak resident set (``VmHWM`` reset through
``/proc/self/clear_refs``) over one step after warm-up.

    OMP_NUM_THREADS=1 python benchmarks/loss_path.py --threads 1 --rounds 8 --peak
    python benchmarks/loss_path.py --variants native,inplace,chunked-auto --rounds 12 --json /tmp/loss.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum
from kempnerforge.training.cross_entropy import softmax_cross_entropy_sum
from kempnerforge.training.loss import IGNORE_INDEX
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw

DEFAULT_VARIANTS = (
    "native,inplace,compiled,compiled_lin,old-256,old-1024,chunked-64,chunked-auto,chunked-256,chunked-512,"
    "chunked-1024,chunked-2048"
)


class _OldLinearCrossEntropySum(torch.autograd.Function):
    """The chunked linear-CE before issue 21 (reference only): fresh logits and gradient blocks per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        loss = torch.zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != IGNORE_INDEX
            safe_y = torch.where(valid, y, 0)
            loss += ((lse - logits.gather(1, safe_y[:, None]).squeeze(1)) * valid).sum()
            probs = logits.sub_(lse[:, None]).exp_()
            probs[torch.arange(len(y)), safe_y] -= 1.0
            probs.mul_(valid[:, None])
            grad_h[start : start + chunk_size] = probs @ weight
            grad_w.addmm_(probs.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None


def _native(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _linear_ce(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _hidden(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Final normed hidden states (batch * seq, dim): the model with its head swapped for Identity."""
    head, model.output = model.output, nn.Identity()
    try:
        return model(tokens).flatten(0, 1)
    finally:
        model.output = head


def loss_fn(name: str) -> Callable[[Transformer, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summed token loss of variant ``name`` for (model, tokens (batch, seq), labels (batch * seq,))."""
    if name == "native":
        return lambda m, x, y: _native(m(x).flatten(0, 1), y)
    if name == "inplace":
        return lambda m, x, y: softmax_cross_entropy_sum(m(x).flatten(0, 1), y)
    if name == "compiled":
        fn = torch.compile(_native)
        return lambda m, x, y: fn(m(x).flatten(0, 1), y)
    if name == "compiled_lin":
        fn = torch.compile(_linear_ce)
        return lambda m, x, y: fn(_hidden(m, x), m.output.weight, y)
    kind, _, size = name.partition("-")
    if kind == "old":
        return lambda m, x, y: _OldLinearCrossEntropySum.apply(_hidden(m, x), m.output.weight, y, int(size))
    if kind == "chunked":
        chunk = None if size == "auto" else int(size)
        return lambda m, x, y: chunked_linear_cross_entropy_sum(_hidden(m, x), m.output.weight, y, chunk)[0]
    raise ValueError(f"unknown variant {name!r}")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def build(args: argparse.Namespace):
    cfg = ModelConfig(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=args.vocab, max_seq_len=args.seq_len
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    optimizer = build_adamw(model, OptimizerConfig())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].flatten().contiguous()
    return model, optimizer, x, y


def step(model, optimizer, fn, x, y) -> torch.Tensor:
    loss = fn(model, x, y) / y.numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def peak_rise_mib(variant: str, args: argparse.Namespace) -> float:
    """In this process: warm up, reset VmHWM, one step; the peak resident set's rise (MiB)."""
    model, optimizer, x, y = build(args)
    fn = loss_fn(variant)
    for _ in range(2):
        step(model, optimizer, fn, x, y)

    def kib(field: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])
        raise RuntimeError(field)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    step(model, optimizer, fn, x, y)
    return (kib("VmHWM") - before) / 1024


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (compile happens here)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--peak", action="store_true", help="also the peak-RSS rise of one step, a process per variant")
    p.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_child:
        print(f"PEAK {peak_rise_mib(args.peak_child, args):.1f}")
        return {}
    names = args.variants.split(",")
    model, optimizer, x, y = build(args)
    fns = {n: loss_fn(n) for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0, f0 = time.process_time(), _faults()
            step(model, optimizer, fns[n], x, y)
            t1, f1 = time.process_time(), _faults()
            if r >= args.warmup:
                cpu[n].append(t1 - t0)
                faults[n].append(f1 - f0)
        print(f"  round {r + 1}/{args.warmup + args.rounds} done", file=sys.stderr, flush=True)
    page_mib = resource.getpagesize() / 2**20
    rows = {}
    for n in names:
        ratios = [a / b for a, b in zip(cpu[n], cpu[names[0]], strict=True)]
        rows[n] = {
            "cpu_ms": 1e3 * statistics.median(cpu[n]),
            "cpu_vs_first": statistics.median(ratios),
            "faults_mib": statistics.median(faults[n]) * page_mib,
        }
    if args.peak:
        for n in names:
            child = [sys.executable, __file__, "--peak-child", n, "--threads", str(args.threads or 0)]
            child += ["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--vocab", str(args.vocab)]
            child += ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
            out = subprocess.run(child, capture_output=True, text=True, check=True, env=os.environ.copy())
            rows[n]["peak_rise_mib"] = float(out.stdout.split("PEAK")[-1])
    print(
        f"shape: dim {args.dim}, {args.n_layers} layers, vocab {args.vocab}, {args.batch_size}x{args.seq_len} tokens, "
        f"threads {torch.get_num_threads()}, {args.rounds} rounds; ratios are per-round medians vs {names[0]}"
    )
    print(f"{'variant':<14}{'CPU ms':>9}{'vs ' + names[0]:>12}{'fresh MiB':>11}{'peak MiB':>10}")
    for n, row in rows.items():
        peak = f"{row['peak_rise_mib']:>10.0f}" if "peak_rise_mib" in row else f"{'':>10}"
        print(f"{n:<14}{row['cpu_ms']:>9.0f}{row['cpu_vs_first']:>12.3f}{row['faults_mib']:>11.0f}{peak}")
    result = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
