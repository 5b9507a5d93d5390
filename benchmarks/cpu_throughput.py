"""CPU training throughput: kempnerforge's Lightning trainer vs plain PyTorch, Hugging Face, litgpt and torchtitan.

What it measures
----------------
One process trains the SAME decoder (Llama-style: RMSNorm, RoPE, SwiGLU, untied head, fp32; default
dim 256, 4 layers, 8 query heads and 8 KV heads, i.e. MHA, vocab 50304, seq 256, batch 8) with five
trainers, on the same pre-generated random token batches, from the same initial weights, with the
same optimizer (``build_adamw``: AdamW, no decay on norms / embeddings), the same LR schedule
(``build_scheduler``), the same loss (cross-entropy, mean over target tokens) and the same clipping
(global L2 norm, ``--grad-clip``):

  (a) kforge   ``lightning.Trainer`` + ``KempnerStrategy`` (FSDP2 at world size 1) + ``CausalLM``; no
               validation, checkpointing, logger, progress bar or model summary, default ``grad_clip``.
  (b) plain    a hand-written loop over the same ``kempnerforge.model.Transformer`` (eager build and
               ``init_weights``), ``F.cross_entropy``, ``torch.nn.utils.clip_grad_norm_``: the reference.
  (c) hf       ``transformers.LlamaForCausalLM(to_hf_config(cfg))`` with SDPA attention, loaded with the
               same weights (``to_hf_state_dict``), in the same loop as (b).
  (d) litgpt   ``litgpt.model.GPT`` with an equivalent ``litgpt.config.Config`` (fused qkv), loaded with
               the same weights, in the same loop as (b) (the ``bench`` extra; skipped if not installed).
  (e) titan    torchtitan 0.3's ``Llama3Model`` (fused ``wqkv``, causal SDPA), loaded with the same weights, in
               the same loop as (b) (installed by hand, see ``benchmarks/contenders.py``; skipped if absent).

``--compile`` runs (a) with ``KempnerStrategy(compile=True)``; the others stay eager (the issue's bar: compiled
(a) at least 1.1x HF, litgpt and torchtitan eager). The speed-up table gives, for each contender X, the median
over steps of X's step time / (a)'s step time in the same iteration, in process CPU time (all threads) and in
wall clock: > 1 means (a) is faster. CPU time is the figure to trust on a shared machine.

Each trainer runs ``--warmup`` steps, then ``--steps`` measured steps. Schedules:

- ``interleaved`` (default): (b)-(e) take their step i inside (a)'s step i (at the start of
  Lightning's ``on_train_batch_start``), and that time is taken off (a)'s clock. All trainers then see
  the same machine state step by step, which keeps the comparison fair on a shared machine; the
  headline (a)/(b) is the median of per-step paired ratios.
- ``sequential``: one trainer after the other (b, a, c, d); with ``--repeats`` > 1 the whole sequence
  repeats and the headline is the median over repeats.

A step of (a) lasts from one ``on_train_batch_start`` to the next, so everything the loop does counts
(data fetch, forward, loss, backward, clipping, optimizer, LR scheduler, zero_grad, every Lightning
hook, ``self.log`` and the loss all-reduce). Reported step times are medians over the measured
steps; tokens/s = batch * seq / median step time.

Fairness: every trainer uses the same threads (``torch.set_num_threads`` and ``OMP_NUM_THREADS``,
which Lightning's launcher would otherwise reset), the cyclic garbage collector is off while timing,
Lightning's default DistributedSampler (which shuffles) is off so (a) sees the batches in the same
order, and the ``max|dL|`` column checks that every step's loss equals (b)'s: same model, same math.
``--keep-freed-memory`` runs every trainer with KempnerStrategy's opt-in glibc setting
(``cpu_keep_freed_memory``: ~30% faster steps, but only safe with ``--only a,b``, see
``kempnerforge/strategies/cpu_malloc.py``).

CPU MFU = tokens/s * ``ModelConfig.flops_per_token(seq)`` / peak, where the peak is the best fp32
FLOP/s of a square matmul (``--peak-n``, default 2048) measured here with the same threads: a
fraction of what this CPU's GEMM reaches, not of a datasheet number.

How to run
----------
    python benchmarks/cpu_throughput.py                          # default shape, all five (~5 min, 2 cores)
    python benchmarks/cpu_throughput.py --only a,b --steps 20 --json /tmp/bench.json
    python benchmarks/cpu_throughput.py --only a,c,d,e --compile --steps 20        # check 1, compiled (a)
    python benchmarks/cpu_throughput.py --dim 512 --n-layers 8 --n-kv-heads 4 --threads 1
    python benchmarks/cpu_throughput.py --schedule sequential --repeats 3

(d) needs litgpt without its pinned dependencies (they would replace torch):
``pip install --no-deps litgpt psutil``.

How to read it
--------------
Columns: tokens/s; step ms (median); in-step (batch start to batch end; step - in-step is the loop's
time between batches); CPU ms (process CPU time per step, all threads); faults (MiB of fresh memory
pages touched per step: large temporaries that the allocator returns to the OS and faults back in);
vs (b) (tokens/s ratio); CPU vs b (CPU-time ratio); MFU; loss0 (first-step loss); max|dL| (largest
per-step loss difference to (b)); clean (steps during which other processes used at most
``--max-other-load`` of the CPUs; medians use the clean steps when there are at least 3).

The headline is (a)/(b) with the target >= 0.97 (the trainer costs at most 3% over a hand-written
loop). On a shared machine another busy process slows 2-thread torch far more than its share: the
script waits for the machine to go idle (``--wait-idle``) and warns when too few steps were clean.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# Threads must be fixed before torch is imported (OMP reads the variable once) and before
# Lightning's launcher runs (it calls torch.set_num_threads(cpu_count) unless OMP_NUM_THREADS is set).


def _early_threads(argv: list[str]) -> int | None:
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--threads="):
            return int(arg.split("=", 1)[1])
    return None


_THREADS = _early_threads(sys.argv[1:])
if "--moe" in sys.argv[1:]:
    # The MoE row's many small parallel ops make spinning OpenMP waits dominate on a shared machine
    # (benchmarks/moe_step.py's docstring); passive waits must be chosen before torch loads libgomp.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if _THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    os.environ["MKL_NUM_THREADS"] = str(_THREADS)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from kempnerforge.config import ModelConfig  # noqa: E402
from kempnerforge.metrics.peak import matmul_peak  # noqa: E402
from kempnerforge.model import Transformer  # noqa: E402
from kempnerforge.model.fused import split_state_dict  # noqa: E402
from kempnerforge.strategies.cpu_malloc import keep_freed_memory  # noqa: E402
from kempnerforge.training.lr import SchedulerConfig, build_scheduler  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared contender models beside this script
from contenders import to_torchtitan_state_dict, torchtitan_config  # noqa: E402

Batch = dict[str, torch.Tensor]


# -- machine ------------------------------------------------------------------------------------


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """CPU, cores, threads and library versions."""
    import lightning

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "python": platform.python_version(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        from importlib.metadata import version

        info["litgpt"] = version("litgpt")
    except Exception:  # noqa: BLE001 - not installed
        info["litgpt"] = None
    return info


# -- data and weights ---------------------------------------------------------------------------


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int) -> list[Batch]:
    """``n`` batches of random tokens; labels are the inputs shifted by one (next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def reference_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights every trainer starts from: ``Transformer(cfg).init_weights(seed)``.

    (a) does not load these: ``KempnerStrategy`` builds on meta and runs the same ``init_weights(seed)``
    after sharding, which is documented to give identical values.
    """
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def to_litgpt_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our keys -> litgpt ``GPT`` keys (qkv is the row-concatenation [wq; wk; wv]); ``sd`` in either layout (fused
    ``wqkv`` / ``w13``, the default, are split first with ``cfg``)."""
    sd = split_state_dict(sd, cfg)
    out = {
        "transformer.wte.weight": sd["tok_embeddings.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "lm_head.weight": sd["output.weight"],
    }
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        out[q + "norm_1.weight"] = sd[p + "attention_norm.weight"]
        out[q + "norm_2.weight"] = sd[p + "ffn_norm.weight"]
        out[q + "attn.qkv.weight"] = torch.cat(
            [sd[p + "attention.wq.weight"], sd[p + "attention.wk.weight"], sd[p + "attention.wv.weight"]]
        )
        out[q + "attn.proj.weight"] = sd[p + "attention.wo.weight"]
        out[q + "mlp.fc_1.weight"] = sd[p + "feed_forward.w1.weight"]
        out[q + "mlp.fc_2.weight"] = sd[p + "feed_forward.w3.weight"]
        out[q + "mlp.proj.weight"] = sd[p + "feed_forward.w2.weight"]
    return out


# -- measurement --------------------------------------------------------------------------------


def _cpu_counters() -> tuple[int, int, int] | None:
    """(busy jiffies of all CPUs, all jiffies of all CPUs, jiffies of this process) from /proc; None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total, int(own[11]) + int(own[12])  # utime + stime, all threads


def other_load(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """Fraction of the machine's CPU time used by OTHER processes between two :func:`_cpu_counters`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy, total, own = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, (busy - own) / total)


def wait_until_idle(max_wait_s: float, threshold: float) -> float | None:
    """Wait (at most ``max_wait_s``) until other processes use <= ``threshold`` of the CPUs for 2 s.

    Returns the last measured other-process load. Another busy process on a 2-core machine slows
    torch by far more than its share (thread oversubscription), so timing next to one is meaningless.
    """
    deadline = time.monotonic() + max_wait_s
    announced = False
    while True:
        before = _cpu_counters()
        time.sleep(2.0)
        load = other_load(before, _cpu_counters())
        if load is None or load <= threshold or time.monotonic() >= deadline:
            return load
        if not announced:
            print(f"  waiting up to {max_wait_s:.0f} s for other processes to go idle (they use {100 * load:.0f}%)")
            announced = True


def _now() -> tuple[float, float, int]:
    """(wall s, process CPU s over all threads, minor page faults) of this process."""
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Meter:
    """Per-iteration records of one trainer: wall clock, process CPU time and minor page faults at the
    start and end of every iteration, and /proc CPU counters (to tell how busy other processes were).

    ``exclude(since)`` removes the time spent since ``since`` (a :func:`_now` snapshot) from this
    meter's clock: in the interleaved schedule the other trainers' steps run inside (a)'s loop.

    Args:
        warmup, steps: iterations to skip, then iterations to measure.
        start_to_start: a step lasts from its start to the next iteration's start (everything the loop
            does between steps counts; needs one closing iteration), else from its start to its end.
    """

    def __init__(self, warmup: int, steps: int, start_to_start: bool) -> None:
        self.warmup, self.steps, self.start_to_start = warmup, steps, start_to_start
        self._offset = [0.0, 0.0, 0]
        self.starts: list[tuple[float, float, int]] = []
        self.ends: list[tuple[float, float, int]] = []
        self.counters: list[tuple[int, int, int] | None] = []
        self.end_counters: list[tuple[int, int, int] | None] = []
        self.losses: list[torch.Tensor] = []
        self.threads: set[int] = set()

    def _read(self) -> tuple[float, float, int]:
        wall, cpu, faults = _now()
        return wall - self._offset[0], cpu - self._offset[1], faults - self._offset[2]

    def exclude(self, since: tuple[float, float, int]) -> None:
        """Do not count what happened since the snapshot ``since`` (other trainers' steps)."""
        now = _now()
        for i in range(3):
            self._offset[i] += now[i] - since[i]

    def mark(self) -> None:
        """Record the start of an iteration (first thing in it)."""
        self.counters.append(_cpu_counters())
        self.starts.append(self._read())

    def end(self, loss: torch.Tensor) -> None:
        """Record the end of an iteration and its loss (mean over target tokens, nats)."""
        self.ends.append(self._read())
        self.end_counters.append(_cpu_counters())
        self.losses.append(loss.detach())
        self.threads.add(torch.get_num_threads())

    def per_step(self) -> list[dict[str, float | None]]:
        """Wall s, CPU s, page faults and other-process load of each measured step."""
        w, n = self.warmup, self.steps
        need = w + n + (1 if self.start_to_start else 0)
        if len(self.starts) < need or len(self.ends) < w + n:
            raise RuntimeError(f"recorded {len(self.starts)} iterations, need {need}")
        out = []
        for i in range(w, w + n):
            a, c0 = self.starts[i], self.counters[i]
            b, c1 = (
                (self.starts[i + 1], self.counters[i + 1])
                if self.start_to_start
                else (self.ends[i], self.end_counters[i])
            )
            out.append(
                {
                    "wall": b[0] - a[0],
                    "cpu": b[1] - a[1],
                    "faults": b[2] - a[2],
                    "in_step": self.ends[i][0] - a[0],
                    "other_load": other_load(c0, c1),
                }
            )
        return out


def summarize(meter: Meter, tokens_per_step: int, max_other_load: float) -> dict[str, Any]:
    """Medians over the measured steps: over the clean ones (other processes <= ``max_other_load``)
    when there are at least 3, else over all of them (then ``contended`` is True)."""
    steps = meter.per_step()
    clean = [s for s in steps if s["other_load"] is not None and s["other_load"] <= max_other_load]
    use = clean if len(clean) >= 3 else steps
    step_s = statistics.median(s["wall"] for s in use)
    return {
        "tokens_per_s": tokens_per_step / step_s,
        "step_ms": 1e3 * step_s,
        "in_step_ms": 1e3 * statistics.median(s["in_step"] for s in use),
        "cpu_ms": 1e3 * statistics.median(s["cpu"] for s in use),
        "faulted_mib": statistics.median(s["faults"] for s in steps) * resource.getpagesize() / 2**20,
        "clean_steps": len(clean),
        "contended": len(clean) < 3,
        "step_ms_all": [1e3 * s["wall"] for s in steps],
        "other_load_per_step": [s["other_load"] for s in steps],
        "threads_seen": sorted(meter.threads),
        # The measured iterations only: a start-to-start meter (kforge) records one closing iteration more.
        "losses": [float(x) for x in meter.losses[: meter.warmup + meter.steps]],
    }


# -- (b), (c), (d): one plain loop for any module that maps tokens to logits -----------------


class PlainTrainer:
    """The reference training step: forward, token-mean cross-entropy, backward, global-norm clipping
    (``torch.nn.utils.clip_grad_norm_``), AdamW (``build_adamw``), LR schedule, ``zero_grad``."""

    def __init__(
        self,
        model: nn.Module,
        logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        batches: list[Batch],
        args: argparse.Namespace,
        start_to_start: bool,
    ) -> None:
        self.model, self.logits_fn, self.batches, self.grad_clip = model, logits_fn, batches, args.grad_clip
        self.optimizer = build_adamw(model, OptimizerConfig())
        self.scheduler = build_scheduler(self.optimizer, SchedulerConfig(), len(batches))
        self.meter = Meter(args.warmup, args.steps, start_to_start)
        model.train()

    def step(self, i: int) -> None:
        """Train on batch ``i``."""
        self.meter.mark()
        batch = self.batches[i]
        logits = self.logits_fn(self.model, batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.end(loss)


def build_plain(cfg: ModelConfig, sd: dict[str, torch.Tensor], batches: list[Batch], args, sts: bool) -> PlainTrainer:
    """(b) the same ``Transformer`` (eager build + its own ``init_weights``: the same values as ``sd``)."""
    model = Transformer(cfg)
    model.init_weights(seed=args.seed)
    return PlainTrainer(model, lambda m, x: m(x), batches, args, sts)


def build_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor], batches: list[Batch], args, sts: bool) -> PlainTrainer:
    """(c) ``LlamaForCausalLM`` (SDPA attention) with the same weights."""
    from transformers import LlamaForCausalLM

    from kempnerforge.checkpoint.hf_llama import to_hf_config, to_hf_state_dict

    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg.use_cache = False
    model = LlamaForCausalLM(hf_cfg).float()
    model.load_state_dict(to_hf_state_dict(sd, cfg), strict=True)
    impl = model.config._attn_implementation
    if impl != "sdpa":
        raise RuntimeError(f"HF picked attention implementation {impl!r}, expected 'sdpa'")
    return PlainTrainer(model, lambda m, x: m(input_ids=x, use_cache=False).logits, batches, args, sts)


def litgpt_config(cfg: ModelConfig):
    """A litgpt ``Config`` with the same shape as ``cfg`` (raises ImportError without litgpt)."""
    from litgpt.config import Config

    return Config(
        name="kforge-bench",
        block_size=cfg.max_seq_len,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.vocab_size,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_query_groups=cfg.n_kv_heads_resolved,
        n_embd=cfg.dim,
        head_size=cfg.head_dim_resolved,
        intermediate_size=cfg.ffn_hidden,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        lm_head_bias=False,
        norm_class_name="RMSNorm",
        norm_eps=cfg.norm_eps,
        mlp_class_name="LLaMAMLP",
        rope_base=int(cfg.rope_theta),
    )


def build_litgpt(cfg: ModelConfig, sd: dict[str, torch.Tensor], batches: list[Batch], args, sts: bool) -> PlainTrainer:
    """(d) litgpt ``GPT`` with the same weights."""
    from litgpt.model import GPT

    model = GPT(litgpt_config(cfg))
    model.load_state_dict(to_litgpt_state_dict(sd, cfg), strict=True)
    return PlainTrainer(model, lambda m, x: m(x), batches, args, sts)


def build_torchtitan(cfg: ModelConfig, sd: dict[str, torch.Tensor], batches: list[Batch], args, sts: bool):
    """(e) torchtitan 0.3 ``Llama3Model`` (fused ``wqkv``, causal SDPA) with the same weights, eager."""
    try:
        config = torchtitan_config(cfg)
    except ImportError as e:
        raise ImportError(f"torchtitan not importable ({e}); see benchmarks/contenders.py") from e
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))  # the RoPE cache
    model.load_state_dict(to_torchtitan_state_dict(sd, cfg), strict=True)
    return PlainTrainer(model, lambda m, x: m(x), batches, args, sts)


def run_plain_alone(trainer: PlainTrainer) -> Meter:
    """Sequential schedule: every batch in order, nothing else running."""
    gc.collect()
    gc.disable()
    try:
        for i in range(len(trainer.batches)):
            trainer.step(i)
    finally:
        gc.enable()
    return trainer.meter


# -- (a) the kforge trainer -----------------------------------------------------------------------


def run_kforge(cfg: ModelConfig, batches: list[Batch], args, others: list[PlainTrainer] = ()) -> Meter:
    """(a) ``Trainer`` + ``KempnerStrategy`` + ``CausalLM``; a callback takes the timestamps.

    With ``others`` (interleaved schedule), each of them trains on batch i at the start of (a)'s batch
    i, and that time is excluded from (a)'s clock: all trainers see the same machine state, step by step.
    """
    import logging
    import warnings

    from lightning.pytorch import Callback, Trainer

    from kempnerforge.module import CausalLM
    from kempnerforge.strategies import KempnerStrategy

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*val_dataloader.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    meter = Meter(args.warmup, args.steps, start_to_start=True)
    n_others = args.warmup + args.steps  # the closing batch only closes (a)'s last interval

    class StepTimer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if others and batch_idx < n_others:
                since = _now()
                for other in others:
                    other.step(batch_idx)
                meter.exclude(since)
            meter.mark()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            # The module's own step loss (mean over the step's target tokens); what training_step
            # returns may be un-normalized (the module normalizes gradients before the optimizer step).
            meter.end(trainer.callback_metrics.get("train/loss", outputs["loss"]))

    module = CausalLM(cfg, grad_clip=args.grad_clip, init_seed=args.seed)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(cpu_keep_freed_memory=args.keep_freed_memory, compile=args.compile),
        precision="32-true",
        max_steps=len(batches),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        # Lightning would wrap the loader in DistributedSampler(shuffle=True) (it always shuffles the
        # training set under a distributed strategy, world size 1 included): keep the shared order.
        use_distributed_sampler=False,
        callbacks=[StepTimer()],
    )
    # batch_size=None: the DataLoader yields the prepared batches unchanged (no collation).
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    gc.collect()
    gc.disable()
    try:
        trainer.fit(module, loader)
    finally:
        gc.enable()
    return meter


# -- main ---------------------------------------------------------------------------------------


NAMES = {"a": "(a) kforge", "b": "(b) plain", "c": "(c) hf", "d": "(d) litgpt", "e": "(e) titan"}
BUILDERS = {"b": build_plain, "c": build_hf, "d": build_litgpt, "e": build_torchtitan}
OTHERS = ("b", "c", "d", "e")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (shape, steps, schedule, threads, output)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument("--n-layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--n-heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--n-kv-heads", type=int, default=8, help="key/value heads (default 8 = MHA; 4 = GQA)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trainer (default 3)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per trainer (default 10)")
    p.add_argument(
        "--schedule",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved (default): (b), (c), (d) each take their step i inside (a)'s step i, so every\n"
        "trainer sees the same machine state; sequential: one trainer after the other",
    )
    p.add_argument("--repeats", type=int, default=1, help="repeat the whole measurement R times (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all logical CPUs)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad L2 norm (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default 0)")
    p.add_argument("--only", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e (default all)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="(a) runs with KempnerStrategy(compile=True) (per-block torch.compile); the others stay eager",
    )
    p.add_argument("--peak-n", type=int, default=2048, help="matmul size for the FLOP/s peak (default 2048)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=120.0,
        help="before measuring, wait up to this many seconds for other processes to go idle (default 120)",
    )
    p.add_argument(
        "--max-other-load",
        type=float,
        default=0.05,
        help="a step is clean when other processes used at most this fraction of the CPUs (default 0.05)",
    )
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="every trainer runs with glibc keeping freed memory (KempnerStrategy(cpu_keep_freed_memory=True));\n"
        "~30%% faster steps for all, but the heap grows without bound with (c) or (d): use with --only a,b",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="also the MoE row (benchmarks/moe_step.py): configs/moe_debug.yaml vs its dense twin and HF Mixtral,\n"
        "paired CPU time next to the active-FLOP ratio (OpenMP waits passively for the whole run)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


def _measure_once(cfg, sd, batches, args, only: list[str], skipped: dict[str, str]) -> dict[str, Meter]:
    """One measurement of every selected trainer, in the chosen schedule."""
    sequential = args.schedule == "sequential"
    meters: dict[str, Meter] = {}
    plain: dict[str, PlainTrainer] = {}
    for key in OTHERS:
        if key in only and key not in skipped:
            try:
                plain[key] = BUILDERS[key](cfg, sd, batches, args, sequential)
            except ImportError as e:
                skipped[key] = f"{type(e).__name__}: {e}"
                print(f"{NAMES[key]}: skipped ({skipped[key]})", flush=True)
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle, args.max_other_load)
    if sequential:
        for key in [k for k in ("b", "a", "c", "d", "e") if k in only and k not in skipped]:
            print(f"running {NAMES[key]} ...", flush=True)
            meters[key] = run_kforge(cfg, batches, args) if key == "a" else run_plain_alone(plain.pop(key))
            gc.collect()
    elif "a" in only:
        print(f"running {', '.join(NAMES[k] for k in ['a', *plain])} interleaved ...", flush=True)
        meters["a"] = run_kforge(cfg, batches, args, list(plain.values()))
        meters.update({k: t.meter for k, t in plain.items()})
    else:
        print(f"running {', '.join(NAMES[k] for k in plain)} interleaved ...", flush=True)
        gc.collect()
        gc.disable()
        try:
            for i in range(args.warmup + args.steps + 1):
                for t in plain.values():
                    t.step(i)
        finally:
            gc.enable()
        meters.update({k: t.meter for k, t in plain.items()})
    return meters


def print_moe_row(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE row: ``configs/moe_debug.yaml``'s model vs the same model with ``num_experts=0``, and ours vs HF
    Mixtral at a Mixtral-style variant of it, each a median of per-step paired CPU-time ratios."""
    from moe_step import moe_row

    print(
        "\nMoE row (configs/moe_debug.yaml vs its dense twin; Mixtral variant vs HF MixtralForCausalLM) ...", flush=True
    )
    row = moe_row(steps=max(args.steps, 15), warmup=args.warmup, hf=True, seed=args.seed)
    verdict = "PASS" if row["pass"] else "ABOVE TARGET"
    print(
        f"  MoE / dense step CPU time {row['moe_vs_dense_cpu']:.3f}; active-FLOP ratio {row['active_flop_ratio']:.4f}; "
        f"target <= {row['target']:.4f}: {verdict} (OMP_WAIT_POLICY={row['omp_wait_policy']})"
    )
    print(
        f"  ours / HF Mixtral step CPU time {row['ours_mixtral_vs_hf_cpu']:.3f} (< 1: ours faster); "
        f"max per-step loss difference {row['max_loss_diff_ours_vs_hf']:.1e}"
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, optionally write JSON; returns the results dict."""
    args = parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)  # Lightning's launcher respects it
    torch.set_num_threads(threads)
    if args.keep_freed_memory:
        keep_freed_memory()  # what (a)'s strategy then does on CPU; for all trainers so the comparison stays fair
    only = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        raise SystemExit(f"--only: unknown trainers {unknown}; allowed: {', '.join(NAMES)}")

    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab,
        max_seq_len=args.seq_len,
    )
    tokens_per_step = args.batch_size * args.seq_len
    flops_per_token = cfg.flops_per_token(args.seq_len)
    info = machine_info()
    kv = cfg.n_kv_heads_resolved
    attn = "MHA" if kv == cfg.n_heads else f"GQA, {cfg.n_heads // kv} query heads per KV head"
    print(f"machine : {info['cpu']} | {info['affinity_cpus']} CPUs | torch {info['torch']} | threads {threads}")
    print(f"versions: lightning {info['lightning']} | transformers {info['transformers']} | litgpt {info['litgpt']}")
    print(
        f"shape   : dim {cfg.dim}, n_layers {cfg.n_layers}, n_heads {cfg.n_heads}, n_kv_heads {kv} ({attn}), "
        f"ffn {cfg.ffn_hidden}, vocab {cfg.vocab_size}, seq {args.seq_len}, batch {args.batch_size} -> "
        f"{tokens_per_step} tokens/step, {cfg.num_params() / 1e6:.2f} M params, {flops_per_token / 1e6:.1f} MFLOP/token"
    )
    print(
        f"run     : {args.schedule}, {args.warmup} warmup + {args.steps} measured steps per trainer, "
        f"{args.repeats} repeat(s), grad_clip {args.grad_clip}, fp32, gc off while timing"
    )
    if args.wait_idle > 0:
        wait_until_idle(args.wait_idle, args.max_other_load)
    peak = matmul_peak(args.peak_n)
    print(f"peak    : {peak / 1e9:.1f} GFLOP/s (fp32 {args.peak_n}^3 matmul, best of 15)", flush=True)

    batches = make_batches(args.warmup + args.steps + 1, args.batch_size, args.seq_len, cfg.vocab_size, args.seed)
    sd = reference_state_dict(cfg, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in only}
    # Per contender X: per-step X time / (a) time (> 1: (a) is faster), wall clock and process CPU time.
    wall_pairs: dict[str, list[float]] = {k: [] for k in OTHERS}
    cpu_pairs: dict[str, list[float]] = {k: [] for k in OTHERS}
    skipped: dict[str, str] = {}
    for _ in range(max(1, args.repeats)):
        meters = _measure_once(cfg, sd, batches, args, only, skipped)
        for key, meter in meters.items():
            res = summarize(meter, tokens_per_step, args.max_other_load)
            res["mfu"] = res["tokens_per_s"] * flops_per_token / peak
            runs[key].append(res)
            print(
                f"  {NAMES[key]:<11} {res['tokens_per_s']:6.0f} tokens/s, steps (ms): "
                f"{', '.join(f'{x:.0f}' for x in res['step_ms_all'])}; clean {res['clean_steps']}/{args.steps}",
                flush=True,
            )
        if "a" in meters:
            sa = meters["a"].per_step()
            for key in [k for k in OTHERS if k in meters]:
                sx = meters[key].per_step()
                if args.schedule == "interleaved":
                    ok = [i for i in range(len(sa)) if max(sa[i]["other_load"] or 0.0, sx[i]["other_load"] or 0.0)
                          <= args.max_other_load]  # fmt: skip
                    use = ok if len(ok) >= 3 else range(len(sa))
                    wall_pairs[key] += [sx[i]["wall"] / sa[i]["wall"] for i in use]
                    cpu_pairs[key] += [sx[i]["cpu"] / sa[i]["cpu"] for i in range(len(sa))]
                else:
                    wall_pairs[key].append(runs["a"][-1]["tokens_per_s"] / runs[key][-1]["tokens_per_s"])

    table: dict[str, dict[str, Any]] = {}
    for key, rs in runs.items():
        if rs:
            fields = ("tokens_per_s", "step_ms", "in_step_ms", "cpu_ms", "faulted_mib", "mfu")
            table[key] = {
                "name": NAMES[key],
                **{f: statistics.median(r[f] for r in rs) for f in fields},
                "clean_steps": sum(r["clean_steps"] for r in rs),
                "contended": any(r["contended"] for r in rs),
                "runs": rs,
            }
    ref = table.get("b")
    for row in table.values():
        row["ratio_to_b"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
        row["cpu_ratio_to_b"] = ref["cpu_ms"] / row["cpu_ms"] if ref else None
        # Same weights, batches and math: every step's loss, in every repeat, should match the reference's
        # ((b), or (a) when (b) is not run) to float rounding.
        loss_ref = ref or table.get("a")
        row["max_loss_diff_to_b"] = (
            max(
                abs(x - y)
                for mine, theirs in zip(row["runs"], loss_ref["runs"], strict=True)
                for x, y in zip(mine["losses"], theirs["losses"], strict=True)
            )
            if loss_ref
            else None
        )

    print()
    print(
        f"{'trainer':<11} {'tokens/s':>8} {'step ms':>8} {'in-step':>8} {'CPU ms':>8} {'faults':>8} "
        f"{'vs (b)':>7} {'CPU vs b':>8} {'MFU':>6} {'loss0':>8} {'max|dL|':>8} {'clean':>7}"
    )
    for key in NAMES:
        if key in table:
            r = table[key]
            print(
                f"{r['name']:<11} {r['tokens_per_s']:>8.0f} {r['step_ms']:>8.1f} {r['in_step_ms']:>8.1f} "
                f"{r['cpu_ms']:>8.0f} {r['faulted_mib']:>5.0f}MiB {_fmt(r['ratio_to_b'], '.3f'):>7} "
                f"{_fmt(r['cpu_ratio_to_b'], '.3f'):>8} {100 * r['mfu']:>5.1f}% {r['runs'][0]['losses'][0]:>8.4f} "
                f"{_fmt(r['max_loss_diff_to_b'], '.0e'):>8} {r['clean_steps']:>3}/{args.steps * len(r['runs']):<3}"
            )
        elif key in skipped:
            print(f"{NAMES[key]}: skipped ({skipped[key]})")
    print(
        "step ms: median time per step (start to next start); in-step: batch start to batch end; CPU ms: process "
        "CPU time per step, all threads; faults: fresh memory pages per step; vs (b): tokens/s ratio; CPU vs b: "
        "CPU-time ratio; MFU: tokens/s * FLOP/token / matmul peak; max|dL|: largest per-step loss difference to "
        f"(b); clean: steps during which other processes used <= {100 * args.max_other_load:.0f}% of the CPUs."
    )

    speedups = {
        k: {
            "wall": statistics.median(wall_pairs[k]) if wall_pairs[k] else None,
            "cpu": statistics.median(cpu_pairs[k]) if cpu_pairs[k] else None,
            "n": len(cpu_pairs[k]) or len(wall_pairs[k]),
        }
        for k in OTHERS
        if k in table and "a" in table
    }
    if speedups:
        how = "median of per-step paired ratios" if args.schedule == "interleaved" else "median over repeats"
        mode = "compiled" if args.compile else "eager"
        print(f"\n(a) kforge ({mode}) speed-up over each contender (X time / (a) time, > 1: (a) faster; {how}):")
        for k, r in speedups.items():
            print(
                f"  vs {NAMES[k]:<11} CPU time {_fmt(r['cpu'], '.3f'):>6}   wall {_fmt(r['wall'], '.3f'):>6}   n={r['n']}"
            )
    losses_ok = all(r["max_loss_diff_to_b"] is None or r["max_loss_diff_to_b"] <= 1e-5 for r in table.values())
    print(f"losses equal to {'(b)' if ref else '(a)'} within 1e-5 at every step: {'yes' if losses_ok else 'NO'}")
    headline = speedups.get("b", {}).get("wall")
    if any(r["contended"] for r in table.values()):
        print(
            "WARNING: other processes were busy during most steps (fewer than 3 clean steps for a trainer): the "
            "wall-clock figures are not reliable. Rerun on an idle machine."
        )

    results = {
        "machine": info,
        "threads": threads,
        "shape": asdict(cfg),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_step": tokens_per_step,
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "schedule": args.schedule,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "trainers": table,
        "skipped": skipped,
        "compile": args.compile,
        "paired_wall_speedups": wall_pairs,
        "paired_cpu_speedups": cpu_pairs,
        "speedups": speedups,
        "losses_equal_1e-5": losses_ok,
        "headline_a_over_b": headline,
    }
    if args.moe:
        results["moe"] = print_moe_row(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
