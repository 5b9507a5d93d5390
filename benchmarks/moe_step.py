"""MoE step overhead on CPU: ours MoE vs ours dense (same config, ``num_experts=0``) vs HF Mixtral.

Issue 21 check 2: ``configs/moe_debug.yaml``'s train step may cost at most its extra FLOPs over the dense
model, ``step(MoE) / step(dense) <= flops_per_token(MoE) / flops_per_token(dense) * 1.05``, where
:meth:`~kempnerforge.config.model.ModelConfig.flops_per_token` counts the active parameters (router, ``top_k``
routed experts, shared experts) of every MoE layer.

What a step is: forward to logits, token-mean cross-entropy, plus the MoE layers' weighted auxiliary losses
(:class:`~kempnerforge.training.moe_balance.MoEStepTracker`, as the LightningModule adds them), backward, global
norm clipping, AdamW (``build_adamw``), ``zero_grad``, then the once-per-step router bias update
(``finish_step``). The contenders take turns step by step in one process (same machine state for each), on the
same random token batches; the figure is the median of the per-step ratios of process CPU time (all threads),
which holds up on a shared machine where wall clock does not.

The optional HF contender is ``transformers.MixtralForCausalLM`` built from a Mixtral-compatible variant of
the MoE config (softmax router, no shared experts, no capacity, every layer MoE: Mixtral has none of these),
loaded with our weights (:mod:`kempnerforge.checkpoint.hf_mixtral`), and paired with our model of that same
variant, so "ours vs HF" compares equal networks.

    python benchmarks/moe_step.py                         # moe_debug vs dense, 40 paired steps
    python benchmarks/moe_step.py --steps 60 --hf         # + ours vs HF Mixtral (Mixtral variant)
    python benchmarks/moe_step.py --json /tmp/moe.json

Run as a script it sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (``--spin-wait`` keeps OpenMP's default):
on a shared machine a 2-thread op's idle thread otherwise spins at the barrier while its partner is descheduled,
and that spin, counted as process CPU time, grows with the number of parallel ops, not with the work (it made
the same MoE layer read 3-6x its one-thread CPU time here). Passive waiting makes the CPU time count work.
Importers (``cpu_throughput.py``) decide that themselves: the variable must be set before torch is imported.

Importable: :func:`moe_debug_configs`, :func:`measure_paired`, :func:`moe_row` (the MoE row of ``cpu_throughput.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__" and "--spin-wait" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (see the module docstring)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402
from torch import nn  # noqa: E402

from kempnerforge.config import ModelConfig  # noqa: E402
from kempnerforge.model import Transformer  # noqa: E402
from kempnerforge.training.moe_balance import MoEStepTracker  # noqa: E402
from kempnerforge.training.optimizers import OptimizerConfig, build_adamw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOE_DEBUG = ROOT / "configs" / "moe_debug.yaml"


def moe_debug_configs(path: Path = MOE_DEBUG) -> tuple[ModelConfig, ModelConfig, int, int]:
    """``(moe, dense, batch, seq)`` of a recipe: its ModelConfig, the same with ``num_experts=0``, and its
    ``data.micro_batch_size`` / ``data.seq_len``."""
    recipe = yaml.safe_load(Path(path).read_text())
    fields = recipe["model"]["config"]
    moe = ModelConfig(**fields)
    dense = ModelConfig(**{**fields, "num_experts": 0})
    return moe, dense, int(recipe["data"]["micro_batch_size"]), int(recipe["data"]["seq_len"])


def mixtral_variant(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` made representable as ``MixtralForCausalLM``: softmax router, no shared experts, no capacity,
    every layer MoE, no auxiliary losses (HF adds none without ``output_router_logits``), so both train alike and
    their losses agree step by step; the expert widths stay."""
    return dataclasses.replace(
        cfg,
        router="softmax",
        n_shared_experts=0,
        capacity_factor=0.0,
        moe_frequency=1,
        route_scale=1.0,
        bias_update_rate=0.0,
        aux_loss_weight=0.0,
        z_loss_weight=0.0,
        seq_aux_loss_weight=0.0,
    )


class StepRunner:
    """One contender's train step (see the module docstring); ``step(batch)`` returns the loss (nats)."""

    def __init__(
        self, model: nn.Module, logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], cfg: ModelConfig
    ) -> None:
        self.model, self.logits_fn, self.cfg = model, logits_fn, cfg
        self.optimizer = build_adamw(model, OptimizerConfig())
        self.tracker = MoEStepTracker()
        model.train()

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, loss (+ MoE aux), backward, clip (1.0), AdamW, zero_grad, router bias update."""
        logits = self.logits_fn(self.model, batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        aux = self.tracker.collect(self.model, new_step=True)
        (loss if aux is None else loss + aux).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.tracker.finish_step(self.model, None, self.cfg.bias_update_rate)
        return loss.detach()


def ours(cfg: ModelConfig, seed: int = 0) -> StepRunner:
    """Our ``Transformer(cfg)`` with ``init_weights(seed)``."""
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    return StepRunner(model, lambda m, x: m(x), cfg)


def hf_mixtral(cfg: ModelConfig, seed: int = 0) -> StepRunner:
    """``MixtralForCausalLM`` (SDPA) with the weights of ``ours(cfg, seed)``; ``cfg`` must be Mixtral-compatible
    (see :func:`mixtral_variant`; ValueError otherwise); ``output_router_logits`` stays False (no aux loss)."""
    from transformers import MixtralForCausalLM

    from kempnerforge.checkpoint.hf_mixtral import to_hf_config, to_hf_state_dict

    ref = Transformer(cfg)
    ref.init_weights(seed=seed)
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg.use_cache = False
    model = MixtralForCausalLM(hf_cfg).float()
    model.load_state_dict(to_hf_state_dict(ref.state_dict(), cfg), strict=False)
    return StepRunner(model, lambda m, x: m(input_ids=x, use_cache=False).logits, cfg)


def make_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` random next-token batches (batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()})
    return out


def measure_paired(
    runners: dict[str, StepRunner], batches: list[dict[str, torch.Tensor]], warmup: int = 3
) -> dict[str, dict]:
    """Run every runner on batch i in turn (rotating who goes first), for all batches; per-step process CPU
    seconds of each. The first ``warmup`` steps are dropped.

    Returns:
        ``{name: {"cpu_s": [per measured step], "median_cpu_ms": float, "losses": [nats per step]}}``.
    """
    names = list(runners)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i, batch in enumerate(batches):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.process_time()
                loss = runners[name].step(batch)
                cpu[name].append(time.process_time() - t0)
                losses[name].append(float(loss))
    finally:
        if gc_was:
            gc.enable()
    return {
        n: {"cpu_s": cpu[n][warmup:], "median_cpu_ms": 1e3 * statistics.median(cpu[n][warmup:]), "losses": losses[n]}
        for n in names
    }


def paired_ratio(result: dict[str, dict], num: str, den: str) -> float:
    """Median over steps of ``cpu(num) / cpu(den)`` (same step index, so the same machine state)."""
    return statistics.median(a / b for a, b in zip(result[num]["cpu_s"], result[den]["cpu_s"], strict=True))


def moe_row(steps: int = 40, warmup: int = 3, hf: bool = False, path: Path = MOE_DEBUG, seed: int = 0) -> dict:
    """The MoE row: ours MoE / ours dense CPU-time ratio next to the active-FLOP ratio (and with ``hf``, ours vs HF
    Mixtral on the Mixtral variant). Losses per step come back too (MoE and dense differ, of course)."""
    moe, dense, batch, seq = moe_debug_configs(path)
    batches = make_batches(steps + warmup, batch, seq, moe.vocab_size, seed)
    runners = {"moe": ours(moe, seed), "dense": ours(dense, seed)}
    if hf:
        mix = mixtral_variant(moe)
        runners["ours_mixtral"] = ours(mix, seed)
        runners["hf_mixtral"] = hf_mixtral(mix, seed)
    res = measure_paired(runners, batches, warmup)
    flop_ratio = moe.flops_per_token(seq) / dense.flops_per_token(seq)
    step_ratio = paired_ratio(res, "moe", "dense")
    row = {
        "shape": {"batch": batch, "seq": seq, "threads": torch.get_num_threads()},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "median_cpu_ms": {n: r["median_cpu_ms"] for n, r in res.items()},
        "moe_vs_dense_cpu": step_ratio,
        "active_flop_ratio": flop_ratio,
        "target": flop_ratio * 1.05,
        "pass": step_ratio <= flop_ratio * 1.05,
        "losses": {n: r["losses"] for n, r in res.items()},
    }
    if hf:
        row["ours_mixtral_vs_hf_cpu"] = paired_ratio(res, "ours_mixtral", "hf_mixtral")
        row["max_loss_diff_ours_vs_hf"] = max(
            abs(a - b) for a, b in zip(res["ours_mixtral"]["losses"], res["hf_mixtral"]["losses"], strict=True)
        )
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hf", action="store_true", help="also ours vs HF MixtralForCausalLM (Mixtral variant)")
    p.add_argument("--config", type=Path, default=MOE_DEBUG)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--spin-wait", action="store_true", help="keep OpenMP's default (spinning) wait policy")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    row = moe_row(args.steps, args.warmup, args.hf, args.config)
    for name, ms in row["median_cpu_ms"].items():
        print(f"{name:>14}: {ms:8.1f} CPU ms/step (median)")
    print(
        f"MoE / dense CPU time (median of paired steps): {row['moe_vs_dense_cpu']:.4f}; active-FLOP ratio "
        f"{row['active_flop_ratio']:.4f}; target <= {row['target']:.4f}: {'PASS' if row['pass'] else 'FAIL'}"
    )
    if args.hf:
        print(
            f"ours / HF Mixtral CPU time (Mixtral variant): {row['ours_mixtral_vs_hf_cpu']:.4f}; "
            f"max |dL| {row['max_loss_diff_ours_vs_hf']:.2e}"
        )
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    sys.exit(0 if main()["pass"] else 1)
