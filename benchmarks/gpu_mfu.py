"""One-device training throughput and MFU: kempnerforge (Trainer + KempnerStrategy + CausalLM) next to torchtitan.

What it measures
----------------
One process trains a Llama-3-8B-shaped decoder (dim 4096, 32 query / 8 KV heads, SwiGLU 14336, vocab
128256, RoPE theta 5e5) on one device, on the bundled tiny-shakespeare text (GPT-2 tokens), with

  kforge      ``lightning.Trainer`` + ``KempnerStrategy(mixed_precision_param="bfloat16",
              activation_checkpointing=..., compile=...)`` + ``CausalLM``: the transform chain a user
              gets (AC -> per-block compile -> FSDP2 with bf16 compute, fp32 master weights and fp32
              gradient reduction), no logger, checkpointing, validation or progress bar;
  torchtitan  ``torchtitan.models.llama3.Llama3Model`` (0.3: fused ``wqkv``, rotate-half RoPE through
              ``CosSinRoPE``, SDPA) built at the same shape, loaded with the same initial weights, with
              torchtitan's own ``FullAC`` / ``SelectiveAC`` and ``apply_fsdp_to_decoder`` (same bf16 /
              fp32 policy), per-block ``compile(fullgraph=True)`` as its ``apply_compile`` does, and a
              plain loop with the same AdamW (``build_adamw``), LR schedule, clipping and loss.
              Runs when ``import torchtitan`` works, else it is skipped. Install it without its
              dependencies (its metadata pins ``datasets<4.8``): ``pip install --no-deps
              "torchtitan>=0.3,<0.4" spmd_types torch_checkpointing tyro typeguard`` (+ ``triton`` on CPU).

Both see the same batches in the same order. Each runs ``--warmup`` untimed steps (compilation, allocator
warm-up), then ``--steps`` timed ones: the clock runs from the start of step ``warmup`` to the start of
step ``warmup + steps`` (one closing step runs untimed), with ``torch.cuda.synchronize()`` at both ends.

- tokens/s/GPU = batch * seq_len * steps / timed seconds (one device: global = per device);
- MFU = tokens/s * FLOP/token / peak, FLOP/token = ``6 N + 12 n_layers dim seq_len``
  (``ModelConfig.flops_per_token``, the PaLM convention torchtitan uses; AC recompute not counted);
  peak = the device's dense bf16 datasheet peak (``kempnerforge.metrics.peak``: H200, H100 SXM / PCIe /
  NVL, A100, ...; ``--peak-tflops`` overrides), or on CPU a measured matmul peak in the run's dtype;
- memory: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of each run (CPU: the process's
  peak RSS, which only grows);
- loss: every step's training loss of both; ``max |dL|`` compares them step by step (same weights and
  data, so they agree up to bf16 kernel rounding, which grows over the steps).

Shape: ``--shape auto`` (default) picks, on CUDA, the 8B shape with as many of its 32 blocks as fit in
the device's memory by an estimate of 16 bytes per parameter (fp32 weights, gradients and two AdamW
moments) plus activations, logits and FSDP2's gathered root unit (the full 8B needs ~128 GB before
activations; ``--n-layers`` overrides the pick), and on CPU the ``tiny`` shape (dim 64, 2 blocks).

How to run
----------
    python benchmarks/gpu_mfu.py                               # CUDA: 8B shape, 5 + 30 steps, seq 8192, batch 1
    python benchmarks/gpu_mfu.py --ac selective_op --json benchmarks/results/gpu_mfu_h100.json
    python benchmarks/gpu_mfu.py --n-layers 8 --seq-len 4096 --batch-size 2
    python benchmarks/gpu_mfu.py --device cpu --steps 6 --warmup 2 --no-compile   # CPU, tiny shape (a test)

Settings that differ between the two by design are printed: torchtitan's ``SelectiveAC`` saves every
other matmul where ``selective_op`` saves all of them; torchtitan's FSDP2 does not cast block inputs
(``cast_forward_inputs=False``) and its SDPA prefers cuDNN attention.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kempnerforge.config import ModelConfig
from kempnerforge.data.prepare import load_tokenizer
from kempnerforge.metrics.peak import gpu_peak_flops, matmul_peak
from kempnerforge.model import Transformer
from kempnerforge.parallel.activation_checkpoint import AC_MODES
from kempnerforge.training.lr import SchedulerConfig, build_scheduler
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared contender models beside this script
from contenders import to_torchtitan_state_dict, torchtitan_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
Batch = dict[str, torch.Tensor]

#: Llama-3-8B (arXiv:2407.21783, table 3): the shape every CUDA run starts from.
LLAMA3_8B = {
    "dim": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "vocab_size": 128256,
    "ffn_dim_multiplier": 1.3,
    "multiple_of": 1024,
    "rope_theta": 500000.0,
}
#: The CPU shape (what the test runs): GPT-2's padded vocabulary, two GQA blocks.
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 50304, "multiple_of": 32}
SHAPES = {"8b": LLAMA3_8B, "tiny": TINY}


# -- device, shape ------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA device 0 when available, else CPU.

    Raises:
        SystemExit: ``cuda`` asked for on a machine without CUDA.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_mfu: error: --device cuda: no CUDA device is visible")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def device_info(device: torch.device) -> dict[str, Any]:
    """Name, memory (GiB) and versions of the device the run uses."""
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": torch.cuda.get_device_name(device),
            "total_memory_gib": props.total_memory / 2**30,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "cuda": torch.version.cuda,
        }
    else:
        info |= {"name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    for package in ("lightning", "torchtitan"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed
            info[package] = None
    return info


def model_config(shape: str, n_layers: int | None, seq_len: int) -> ModelConfig:
    """The ``ModelConfig`` of ``shape`` (``8b`` or ``tiny``) with ``n_layers`` blocks (None: all)."""
    fields = dict(SHAPES[shape])
    if n_layers is not None:
        fields["n_layers"] = n_layers
    return ModelConfig(**fields, max_seq_len=seq_len)


def estimate_train_bytes(cfg: ModelConfig, tokens: int, ac: str) -> int:
    """Rough peak device memory of one training step on one device, bytes (what ``--shape auto`` fits).

    16 B per parameter (fp32 weight, gradient, AdamW ``exp_avg`` / ``exp_avg_sq``); the root FSDP2 unit
    (embedding + head) gathered in bf16 with its bf16 and fp32 gradients (8 B per parameter); the bf16
    logits, their fp32 copy, the saved log-softmax and both gradients (16 B per token and vocabulary
    entry); block activations: with AC the
    saved block inputs plus one block's recompute, without it every block's (bf16, ~``8 dim + 4 ffn``
    values per token and block, attention by SDPA's flash kernel, so nothing quadratic).
    """
    params = cfg.num_params()
    root = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    per_block = tokens * (8 * cfg.dim + 4 * cfg.ffn_hidden) * 2
    blocks = cfg.n_layers * tokens * cfg.dim * 2 + per_block if ac == "full" else cfg.n_layers * per_block
    return 16 * params + 8 * root + 16 * tokens * cfg.vocab_size + blocks


def fit_n_layers(device: torch.device, seq_len: int, batch: int, ac: str) -> tuple[int, str]:
    """How many of Llama-3-8B's 32 blocks fit on ``device`` (90% of its memory less 2 GiB of CUDA
    context and allocator slack) by :func:`estimate_train_bytes`, and the reason as text.

    Raises:
        SystemExit: not even one block fits (shorten ``--seq-len`` / ``--batch-size``).
    """
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(0.9 * total) - 2 * 2**30
    tokens = seq_len * batch
    fits = [n for n in range(1, 33) if estimate_train_bytes(model_config("8b", n, seq_len), tokens, ac) <= budget]
    if not fits:
        raise SystemExit(f"gpu_mfu: error: not one Llama-3-8B block fits in {total / 2**30:.0f} GiB; lower --seq-len")
    n = fits[-1]
    need = estimate_train_bytes(model_config("8b", n, seq_len), tokens, ac) / 2**30
    why = f"{n} of 32 blocks fit in {budget / 2**30:.0f} of {total / 2**30:.0f} GiB (estimate {need:.0f} GiB)"
    return n, why


def peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None) -> tuple[float | None, str]:
    """Peak FLOP/s of the device and where it came from (override, datasheet table, measured CPU matmul)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        return peak, (f"dense bf16 datasheet peak of {name}" if peak else f"{name} is not in the table")
    return matmul_peak(512, dtype=dtype), f"measured {str(dtype).removeprefix('torch.')} 512^3 CPU matmul"


# -- data ---------------------------------------------------------------------------------------


def text_batches(n: int, batch: int, seq_len: int, vocab: int, device: torch.device, text: Path) -> list[Batch]:
    """``n`` batches of consecutive ``seq_len + 1``-token windows of ``text`` (GPT-2 tokens, EOS between
    paragraphs, repeated when the text is short): ``input_ids`` and next-token ``labels``, (batch, seq_len)
    int64, in pinned memory on CUDA.

    Raises:
        ValueError: ``vocab`` is smaller than the tokenizer's vocabulary.
    """
    tok = load_tokenizer(REPO / "data" / "tokenizers" / "gpt2")
    if vocab < tok.vocab_size:
        raise ValueError(f"vocab_size={vocab} < {tok.vocab_size} (the GPT-2 tokens of the benchmark text)")
    paragraphs = [p for p in text.read_text().split("\n\n") if p.strip()]
    need = n * batch * seq_len + 1
    tokens: list[int] = []
    for start in range(0, len(paragraphs), 256):  # tokenize only as much text as the run reads
        tokens += [i for piece in tok.encode_batch(paragraphs[start : start + 256]) for i in [*piece, tok.eos_id]]
        if len(tokens) >= need:
            break
    ids = torch.tensor(tokens)
    ids = ids.repeat(math.ceil(need / ids.numel()))[:need]
    windows = ids.unfold(0, seq_len + 1, seq_len)  # (n * batch, seq_len + 1), each overlapping the next by 1
    out = []
    for b in windows.split(batch):
        x, y = b[:, :-1].contiguous(), b[:, 1:].contiguous()
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        out.append({"input_ids": x, "labels": y})
    return out


# -- measurement --------------------------------------------------------------------------------


def synced_now(device: torch.device) -> float:
    """``time.perf_counter()`` after the device finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_memory(device: torch.device) -> None:
    """Free what the previous run left and start a new CUDA peak window."""
    gc.collect()
    torch.compiler.reset()  # drop compiled graphs (they hold the previous model's code objects)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved CUDA memory of the run, GiB; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    from kempnerforge.metrics.memory import peak_rss_bytes

    return {"process_peak_rss_gib": peak_rss_bytes() / 2**30}


def result(t0: float, t1: float, losses: list[torch.Tensor], args, cfg: ModelConfig, peak: float | None) -> dict:
    """Throughput, MFU and losses of one run from its timed window ``[t0, t1]`` (s)."""
    tokens = args.batch_size * args.seq_len * args.steps
    tokens_per_s = tokens / (t1 - t0)
    flops = tokens_per_s * cfg.flops_per_token(args.seq_len)
    values = [float(x) for x in losses]
    return {
        "tokens_per_s_per_device": tokens_per_s,
        "step_ms": 1e3 * (t1 - t0) / args.steps,
        "tflops_per_s": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "losses": values,
        "loss_first": values[0],
        "loss_last": values[-1],
        "loss_finite": all(math.isfinite(v) for v in values),
    }


# -- (a) kforge ---------------------------------------------------------------------------------


def run_kforge(cfg: ModelConfig, batches: list[Batch], args, device: torch.device, peak: float | None) -> dict:
    """``Trainer.fit`` of ``CausalLM`` under ``KempnerStrategy`` with the benchmark's settings; a callback
    takes the synchronized timestamps and each step's ``train/loss``."""
    from lightning.pytorch import Callback, Trainer

    from kempnerforge.module import CausalLM
    from kempnerforge.strategies import KempnerStrategy

    warmup, steps = args.warmup, args.steps
    stamps: dict[str, float] = {}
    losses: list[torch.Tensor] = []

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx in (warmup, warmup + steps):
                stamps["t0" if batch_idx == warmup else "t1"] = synced_now(device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx < warmup + steps:  # the step's loss, mean per target token; no host sync here
                losses.append(trainer.callback_metrics["train/loss"].detach().clone())

    module = CausalLM(
        cfg, optimizer=OptimizerConfig(lr=args.lr), scheduler=schedule(args), grad_clip=args.grad_clip, init_seed=0
    )
    strategy = KempnerStrategy(
        mixed_precision_param="bfloat16" if args.dtype == "bf16" else "float32",
        mixed_precision_reduce="float32",
        activation_checkpointing=args.ac,
        compile=args.compile,
    )
    trainer = Trainer(
        accelerator=device.type,
        devices=1,
        strategy=strategy,
        precision="32-true",  # bf16 compute comes from the strategy's FSDP2 policy (fp32 master weights)
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,  # keep the shared batch order (no DistributedSampler shuffle)
        callbacks=[Timer()],
    )
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    out = result(stamps["t0"], stamps["t1"], losses, args, cfg, peak) | memory_gib(device)
    del trainer, module, strategy
    return out


def schedule(args) -> SchedulerConfig:
    """The LR schedule both runs use: linear warmup, cosine decay over every step of the run."""
    total = args.warmup + args.steps + 1
    return SchedulerConfig(warmup_steps=min(args.lr_warmup_steps, total - 1), decay="cosine", total_steps=total)


# -- (b) torchtitan -----------------------------------------------------------------------------


def build_torchtitan(cfg: ModelConfig, args, device: torch.device):
    """``Llama3Model`` on ``device`` with our initial weights (``init_weights(seed=0)``, the values the
    kforge run starts from), then torchtitan's AC, per-block compile and FSDP2 (bf16 runs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    with torch.device("meta"):
        model = torchtitan_config(cfg).build()
        # The same initial values in the separate layout (fused init is bit-identical): no split copies on the GPU.
        ours = Transformer(replace(cfg, fuse_qkv=False, fuse_w13=False))
    model.to_empty(device=device)
    model.init_states(buffer_device=device)  # the RoPE cache
    ours.to_empty(device=device)
    with torch.no_grad():
        ours.init_weights(seed=0)
    model.load_state_dict(to_torchtitan_state_dict(ours.state_dict()), strict=True)
    del ours
    # AC -> compile -> FSDP2, the order torchtitan's parallelize_llama uses (and ours).
    if args.ac == "full":
        FullAC(FullAC.Config(preserve_rng_state=False)).apply(model)  # ours keeps no RNG state either
    elif args.ac == "selective_op":
        SelectiveAC(SelectiveAC.Config(preserve_rng_state=False)).apply(model)
    if args.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    if args.dtype == "bf16":  # fp32 at one rank: FSDP2 has nothing to do, and ours skips it too
        if not dist.is_initialized():  # a one-rank group of this process (no rendezvous)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    return model


def run_torchtitan(cfg: ModelConfig, batches: list[Batch], args, device: torch.device, peak: float | None) -> dict:
    """The plain loop over torchtitan's model: forward, token-mean cross-entropy in fp32, backward,
    ``clip_grad_norm_``, AdamW (``build_adamw``), the same LR schedule, ``zero_grad``."""
    model = build_torchtitan(cfg, args, device)
    optimizer = build_adamw(model, OptimizerConfig(lr=args.lr))
    scheduler = build_scheduler(optimizer, schedule(args), len(batches))
    losses, stamps = [], {}
    model.train()
    for i, batch in enumerate(batches):
        if i in (args.warmup, args.warmup + args.steps):
            stamps["t0" if i == args.warmup else "t1"] = synced_now(device)
        x = batch["input_ids"].to(device, non_blocking=True)
        y = batch["labels"].to(device, non_blocking=True)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if i < args.warmup + args.steps:
            losses.append(loss.detach())
    out = result(stamps["t0"], stamps["t1"], losses, args, cfg, peak) | memory_gib(device)
    del model, optimizer, scheduler
    return out


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags; device-dependent defaults are filled in by :func:`main`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if available")
    p.add_argument("--shape", choices=("auto", "8b", "tiny"), default="auto", help="auto: 8b on CUDA, tiny on CPU")
    p.add_argument("--n-layers", type=int, default=None, help="blocks (default: all of tiny; what fits of 8b)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 8192 CUDA, 64 CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 1 CUDA, 4 CPU)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--ac", choices=[m for m in AC_MODES if m != "selective"], default="full", help="default full")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="per-block torch.compile")
    p.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (default 3e-4)")
    p.add_argument("--lr-warmup-steps", type=int, default=10, help="linear LR warmup steps (default 10)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad L2 norm (default 1.0)")
    p.add_argument("--only", default="kforge,torchtitan", help="comma-separated subset of kforge,torchtitan")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device (overrides the table)")
    p.add_argument("--text", type=Path, default=REPO / "data" / "tinyshakespeare" / "input.txt", help="training text")
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    for name in ("steps", "warmup", "n_layers", "seq_len", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')}={value}: must be {'>= 0' if name == 'warmup' else '>= 1'}")
    return args


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict[str, Any]) -> None:
    """The side-by-side table and the loss comparison."""
    runs = results["runs"]
    mem_key = "peak_allocated_gib" if results["device"]["type"] == "cuda" else "process_peak_rss_gib"
    print(f"\n{'trainer':<11} {'tokens/s/GPU':>12} {'step ms':>9} {'TFLOP/s':>8} {'MFU':>7} {'peak GiB':>9} "
          f"{'loss[0]':>8} {'loss[-1]':>8}")  # fmt: skip
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<11} failed: {r['error']}")
            continue
        mfu = None if r["mfu"] is None else 100 * r["mfu"]
        print(
            f"{name:<11} {r['tokens_per_s_per_device']:>12.0f} {r['step_ms']:>9.1f} {r['tflops_per_s']:>8.3g} "
            f"{_fmt(mfu, '6.1f'):>6}% {r.get(mem_key, 0.0):>9.2f} {r['loss_first']:>8.4f} {r['loss_last']:>8.4f}"
        )
    for name, why in results["skipped"].items():
        print(f"{name:<11} skipped ({why})")
    match = results.get("loss_match")
    if match:
        print(
            f"\nsame initial weights and batches: |dL| at step 0 = {match['first_step_abs_diff']:.2e}, "
            f"max over {match['steps_compared']} steps = {match['max_abs_diff']:.2e}; "
            f"torchtitan / kforge tokens/s = {match['throughput_ratio']:.3f}"
        )


def compare(runs: dict[str, dict]) -> dict[str, float] | None:
    """Step-by-step loss difference and throughput ratio of the two runs (None unless both ran)."""
    a, b = runs.get("kforge"), runs.get("torchtitan")
    if not a or not b or "error" in a or "error" in b:
        return None
    diffs = [abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)]
    return {
        "first_step_abs_diff": diffs[0],
        "max_abs_diff": max(diffs),
        "median_abs_diff": statistics.median(diffs),
        "steps_compared": len(diffs),
        "throughput_ratio": b["tokens_per_s_per_device"] / a["tokens_per_s_per_device"],
    }


def settings(args, device: torch.device, cfg: ModelConfig, shape: str, why: str) -> dict[str, Any]:
    """What both runs share (for the JSON and the header)."""
    return {
        "shape": shape,
        "shape_choice": why,
        "config": asdict(cfg),
        "params": cfg.num_params(),
        "flops_per_token": cfg.flops_per_token(args.seq_len),
        "dtype": args.dtype,
        "fsdp2": args.dtype == "bf16",  # at one rank FSDP2 only runs to cast (ours skips it for fp32)
        "activation_checkpointing": args.ac,
        "compile": args.compile,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_step": args.seq_len * args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
        "lr": args.lr,
        "grad_clip": args.grad_clip,
    }


def choose_shape(args, device: torch.device) -> tuple[ModelConfig, str, str]:
    """The model config, shape name and the reason for the block count (fills device defaults in ``args``)."""
    cuda = device.type == "cuda"
    args.seq_len = args.seq_len or (8192 if cuda else 64)
    args.batch_size = args.batch_size or (1 if cuda else 4)
    shape = args.shape if args.shape != "auto" else ("8b" if cuda else "tiny")
    why = "--n-layers" if args.n_layers else "the whole shape"
    if shape == "8b" and args.n_layers is None and cuda:
        args.n_layers, why = fit_n_layers(device, args.seq_len, args.batch_size, args.ac)
    return model_config(shape, args.n_layers, args.seq_len), shape, why


def run_all(cfg, batches, args, device, peak, only) -> tuple[dict, dict]:
    """Each selected trainer in turn (kforge first), memory freed in between; returns (runs, skipped)."""
    runs: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for name, fn in (("kforge", run_kforge), ("torchtitan", run_torchtitan)):
        if name not in only:
            continue
        if name == "torchtitan":
            try:
                torchtitan_config(cfg)
            except ImportError as err:
                skipped[name] = f"not importable: {err}"
                continue
        reset_memory(device)
        # What an earlier run left allocated (should be ~0: the runs must not share the device's memory).
        left = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        print(f"running {name} ...", flush=True)
        try:
            runs[name] = fn(cfg, batches, args, device, peak) | {"allocated_at_start_gib": left}
        except torch.cuda.OutOfMemoryError as err:
            runs[name] = {"error": f"CUDA out of memory ({str(err).splitlines()[0]}); rerun with fewer --n-layers"}
        reset_memory(device)
    return runs, skipped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, optionally write JSON; returns the results dict."""
    args = parse_args(argv)
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    if not only or only - {"kforge", "torchtitan"}:
        raise SystemExit(f"gpu_mfu: error: --only={args.only!r}: allowed kforge, torchtitan or both")
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 for what still runs in fp32
    cfg, shape, why = choose_shape(args, device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak, peak_source = peak_flops(device, dtype, args.peak_tflops)
    info = device_info(device)
    shared = settings(args, device, cfg, shape, why)
    print(f"device  : {info['name']} ({device.type}) | torch {info['torch']} | torchtitan {info['torchtitan']}")
    print(
        f"shape   : {shape}, {cfg.n_layers} blocks ({why}), dim {cfg.dim}, heads {cfg.n_heads}/{cfg.n_kv_heads_resolved}, "
        f"ffn {cfg.ffn_hidden}, vocab {cfg.vocab_size}: {shared['params'] / 1e9:.3f} B params, "
        f"{shared['flops_per_token'] / 1e9:.2f} GFLOP/token"
    )
    print(
        f"run     : {args.dtype}, FSDP2 {'on' if shared['fsdp2'] else 'off (fp32, one rank)'}, AC {args.ac}, "
        f"compile {args.compile}, seq {args.seq_len} x batch {args.batch_size}, {args.warmup} + {args.steps} steps"
    )
    print(f"peak    : {_fmt(peak and peak / 1e12, '.4g')} TFLOP/s ({peak_source})", flush=True)

    batches = text_batches(
        args.warmup + args.steps + 1, args.batch_size, args.seq_len, cfg.vocab_size, device, args.text
    )
    started_pg = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(val_dataloader|LeafSpec|does not have many workers).*")
        runs, skipped = run_all(cfg, batches, args, device, peak, only)
    if started_pg and dist.is_initialized():
        dist.destroy_process_group()  # the fit initialized it; leave the process as it was

    results = {
        "device": info | {"peak_flops": peak, "peak_source": peak_source},
        "settings": shared,
        "runs": runs,
        "skipped": skipped,
        "loss_match": compare(runs),
    }
    print_table(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
