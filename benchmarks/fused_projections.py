"""Fused Q/K/V (``fuse_qkv``) and gate/up (``fuse_w13``) projections vs separate ones: CPU time of a train step.

One process builds the same decoder once per variant (unfused, fused Q/K/V, fused gate/up, both) from the same
weights (the unfused model's ``init_weights``, joined with :func:`kempnerforge.model.fused.join_state_dict`), and
trains them step by step interleaved (variant order rotated every step) on the same batches: forward,
token-mean cross-entropy, backward, AdamW (``build_adamw``), ``zero_grad``. Per step it records process CPU time
(``time.process_time``: every thread of this process, robust to other load on a shared machine) and the loss.
The headline per variant is the median over steps of the paired ratio ``cpu(variant, step i) / cpu(unfused,
step i)``; the losses of all variants must agree at every step (same math).

How to run
----------
    python benchmarks/fused_projections.py                         # dim 256, 4 layers, MHA, vocab 50304, seq 256, batch 8
    python benchmarks/fused_projections.py --n-kv-heads 2          # GQA
    python benchmarks/fused_projections.py --steps 40 --threads 2 --json /tmp/fused.json
    python benchmarks/fused_projections.py --variants unfused,both --steps 12

How to read it
--------------
``ratio`` < 1: the variant spends less CPU time per step than separate projections. ``max|dL|``: the largest
loss difference to the unfused model over all steps (fp32 reassociation only: ~1e-6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kempnerforge.config.model import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.fused import join_state_dict
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw

VARIANTS = {"unfused": (False, False), "qkv": (True, False), "w13": (False, True), "both": (True, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


def build(cfg: ModelConfig, fuse: tuple[bool, bool], sd: dict[str, torch.Tensor]):
    """A model of ``cfg`` with ``fuse`` = (fuse_qkv, fuse_w13), loaded with the unfused weights ``sd``."""
    fcfg = ModelConfig(**{**cfg.__dict__, "fuse_qkv": fuse[0], "fuse_w13": fuse[1]})
    model = Transformer(fcfg)
    model.load_state_dict(join_state_dict(sd, fcfg), strict=True)
    model.train()
    return model, build_adamw(model, OptimizerConfig())


def step(model, opt, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One train step; returns (process CPU seconds, loss)."""
    t0 = time.process_time()
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.process_time() - t0, loss.item()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The reference weights are the unfused layout's (fusing is ModelConfig's default: say unfused here).
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab_size=args.vocab, max_seq_len=args.seq, fuse_qkv=False, fuse_w13=False)  # fmt: skip
    ref = Transformer(cfg)
    ref.init_weights(seed=args.seed)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    del ref
    names = ["unfused", *(n for n in args.variants.split(",") if n != "unfused")]
    runs = {name: build(cfg, VARIANTS[name], sd) for name in names}
    g = torch.Generator().manual_seed(args.seed)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    loss: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate: no variant always runs first
        for name in order:
            t, value = step(*runs[name], batch)
            if i >= args.warmup:
                cpu[name].append(t)
            loss[name].append(value)
    out = {"shape": {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "seq", "batch")},
           "threads": torch.get_num_threads(), "steps": args.steps, "variants": {}}  # fmt: skip
    print(f"threads={out['threads']} steps={args.steps} shape={out['shape']}")
    print(f"{'variant':8s} {'cpu ms':>8s} {'ratio':>7s} {'max|dL|':>9s}")
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(cpu[name], cpu["unfused"], strict=True))
        dl = max(abs(a - b) for a, b in zip(loss[name], loss["unfused"], strict=True))
        ms = 1e3 * statistics.median(cpu[name])
        out["variants"][name] = {"cpu_ms": ms, "ratio": ratio, "max_dloss": dl}
        print(f"{name:8s} {ms:8.1f} {ratio:7.3f} {dl:9.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
