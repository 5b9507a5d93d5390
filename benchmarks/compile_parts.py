"""Where ``torch.compile`` pays in a train step: each part eager vs compiled, CPU time, paired and interleaved.

The whole step (benchmarks/cpu_throughput.py, dim 256, 4 layers, vocab 50304, seq 256, batch 8) splits into
parts that compile differently; timing them one by one in the same process, alternating eager and compiled
rep by rep, gives stable ratios on a shared machine where whole steps are too noisy:

- ``blocks``: the 4 transformer blocks, forward + backward (what ``KempnerStrategy(compile=True)`` compiles,
  one ``fullgraph`` graph per block type; inductor fuses RMSNorm, RoPE and SwiGLU's elementwise ops, the
  matmuls and attention stay library kernels);
- ``ce``: token cross-entropy over the (tokens, vocab) fp32 logits, forward + backward (eager: log-softmax,
  NLL, a logits-sized zero-fill and log-softmax backward; compiled: inductor fuses them into two passes);
- ``head``: final norm + output head + cross-entropy from the last hidden states, forward + backward;
- ``chunked``: the same through :func:`kempnerforge.training.chunked_ce.chunked_linear_cross_entropy_sum`
  (``loss_chunk_size``), eager;
- ``adamw``: one AdamW step over all parameters: foreach, fused, and ``torch.compile`` of the foreach step;
- ``embedding``: embedding forward + backward (eager only: a gather and an index-add, nothing to fuse).

Each line prints the median CPU time (process time, all threads) and the median of per-rep paired ratios
against the part's first variant; the first 2 reps (compilation) are dropped. Compiled vs eager results
are checked to agree (max abs difference printed).

    python benchmarks/compile_parts.py                      # all parts, 1 thread (~6 min cold, 2 cores)
    python benchmarks/compile_parts.py --parts blocks,ce --reps 20 --threads 2
    python benchmarks/compile_parts.py --dim 128 --n-heads 4 --n-kv-heads 2 --vocab 50257 --multiple-of 64 --tie  # debug.yaml

Set ``TORCHINDUCTOR_CACHE_DIR`` to reuse compiled code between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # threads before torch is imported (OMP reads the variable once)
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            os.environ["OMP_NUM_THREADS"] = sys.argv[i + 1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kempnerforge.config import ModelConfig  # noqa: E402
from kempnerforge.model import Transformer  # noqa: E402
from kempnerforge.model.rope import pack_rope  # noqa: E402
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw  # noqa: E402

PARTS = ("blocks", "ce", "head", "chunked", "adamw", "embedding")


def paired(variants: dict[str, Callable[[], object]], reps: int, skip: int = 2) -> dict[str, dict[str, float]]:
    """Run every variant once per rep (order reversed every other rep); CPU time medians and paired ratios."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    items = list(variants.items())
    for r in range(reps):
        for name, fn in items if r % 2 == 0 else items[::-1]:
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    base = times[items[0][0]][skip:]
    return {
        k: {
            "cpu_ms": 1e3 * statistics.median(v[skip:]),
            "speedup": statistics.median(b / x for b, x in zip(base, v[skip:], strict=True)),
        }
        for k, v in times.items()
    }


def _grad_fn(fn: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        x = x0.detach().requires_grad_()
        out = fn(x)
        out.backward()
        return x.grad

    return run


def build_parts(cfg: ModelConfig, batch: int, seq: int, which: list[str]) -> dict[str, dict[str, Callable]]:
    """The variants of each part (name -> zero-argument callable), sharing one model's weights."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    labels = torch.randint(0, cfg.vocab_size, (batch, seq))
    hidden = torch.randn(batch, seq, cfg.dim)
    parts: dict[str, dict[str, Callable]] = {}
    if "blocks" in which:
        compiled = Transformer(cfg)
        compiled.load_state_dict(model.state_dict())
        for block in compiled.layers.values():
            block.compile(fullgraph=True)
        rope = pack_rope(model.rope_cos[:seq], model.rope_sin[:seq])

        def blocks(m: Transformer) -> Callable[[torch.Tensor], torch.Tensor]:
            def fn(x: torch.Tensor) -> torch.Tensor:
                for block in m.layers.values():
                    x = block(x, rope, None)
                return x.square().mean()

            return fn

        parts["blocks"] = {"eager": _grad_fn(blocks(model), hidden), "compiled": _grad_fn(blocks(compiled), hidden)}
    if "ce" in which:
        logits = torch.randn(batch * seq, cfg.vocab_size)
        flat = labels.flatten()
        ce_c = torch.compile(F.cross_entropy, fullgraph=True)
        parts["ce"] = {
            "eager": _grad_fn(lambda x: F.cross_entropy(x, flat), logits),
            "compiled": _grad_fn(lambda x: ce_c(x, flat), logits),
        }

    def head_ce(h: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), labels.flatten())

    if "head" in which:
        parts["head"] = {"eager": _grad_fn(head_ce, hidden), "compiled": _grad_fn(torch.compile(head_ce), hidden)}
    if "chunked" in which:
        flat = labels.flatten()

        def chunked(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def fn(h: torch.Tensor) -> torch.Tensor:
                normed = model.norm(h).flatten(0, 1)
                loss, _ = chunked_linear_cross_entropy_sum(normed, model.output.weight, flat, size, 0.0)
                return loss / flat.numel()

            return fn

        parts["chunked"] = {"full logits": _grad_fn(head_ce, hidden)}
        parts["chunked"].update({f"chunk {n}": _grad_fn(chunked(n), hidden) for n in (512, 2048)})
    if "adamw" in which:

        def optimizer(**kernel) -> torch.optim.Optimizer:
            m = Transformer(cfg)
            m.load_state_dict(model.state_dict())
            for p in m.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            opt = build_adamw(m, OptimizerConfig(**kernel))
            opt.step()  # state created
            return opt

        foreach, fused, to_compile = optimizer(foreach=True), optimizer(fused=True), optimizer(foreach=True)
        parts["adamw"] = {"foreach": foreach.step, "fused": fused.step, "compiled": torch.compile(to_compile.step)}
    if "embedding" in which:
        parts["embedding"] = {"eager": lambda: model.tok_embeddings(tokens).sum().backward()}
    return parts


def check_equal(variants: dict[str, Callable]) -> float | None:
    """Max abs difference of the variants' results (gradients) to the first one's; None when they return none."""
    outs = [fn() for fn in variants.values()]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    return max((o - outs[0]).abs().max().item() for o in outs[1:]) if len(outs) > 1 else 0.0


def main(argv: list[str] | None = None) -> None:
    """Parse flags, time every part, print one line per variant."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--reps", type=int, default=12, help="reps per variant, the first 2 dropped (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--multiple-of", type=int, default=256, help="SwiGLU hidden rounding (configs/debug.yaml: 64)")
    p.add_argument("--tie", action="store_true", help="tie the head to the embedding (configs/debug.yaml)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    which = [w for w in args.parts.split(",") if w]
    unknown = sorted(set(which) - set(PARTS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}")
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                      vocab_size=args.vocab, max_seq_len=args.seq_len, multiple_of=args.multiple_of,
                      tie_embeddings=args.tie)  # fmt: skip
    print(f"torch {torch.__version__}, {args.threads} thread(s); dim {cfg.dim}, {cfg.n_layers} layers, vocab "
          f"{cfg.vocab_size}, seq {args.seq_len}, batch {args.batch_size}; CPU ms = median process time per rep")  # fmt: skip
    result: dict = {"threads": args.threads, "shape": {k: v for k, v in vars(args).items() if k not in ("json", "parts")},
                    "parts": {}}  # fmt: skip
    for part, variants in build_parts(cfg, args.batch_size, args.seq_len, which).items():
        diff = check_equal(variants)  # also compiles
        print(f"{part}" + ("" if diff is None else f"  (max |diff| to {next(iter(variants))}: {diff:.1e})"))
        timed = paired(variants, args.reps)
        result["parts"][part] = {"max_abs_diff": diff, "variants": timed}
        for name, r in timed.items():
            print(f"  {name:12s} CPU {r['cpu_ms']:8.1f} ms   speed-up {r['speedup']:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
