"""Per-optimizer-step bookkeeping of MoE layers for the LightningModule.

After each micro-batch forward, :meth:`MoEStepTracker.collect` takes every MoE layer's auxiliary
loss (to add to the training loss) and its detached routing statistics. Once per optimizer step,
:meth:`MoEStepTracker.finish_step` all-reduces the step's expert load over the data-parallel group and
applies DeepSeek-V3's aux-loss-free bias update (arXiv:2412.19437 sec. 2.1.2). Statistics for the
logs accumulate on the device and are only reduced to numbers by :meth:`MoEStepTracker.metrics`,
which the module calls at its log interval: no per-step host synchronization.

Reading statistics in ``training_step`` (not inside the layer) means an activation-checkpointing
recomputation, which re-runs the layer's forward during backward, is never counted twice.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def moe_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's MoE layers by canonical FQN (``model.moe_layers()``); empty if it has none."""
    getter = getattr(model, "moe_layers", None)
    return getter() if callable(getter) else {}


class MoEStepTracker:
    """Collects MoE auxiliary losses, expert loads and log statistics across micro-batches and steps."""

    def __init__(self) -> None:
        self._step_load: dict[str, torch.Tensor] = {}
        self._window: dict[str, dict[str, torch.Tensor | int]] = {}

    def collect(self, model: nn.Module, new_step: bool) -> torch.Tensor | None:
        """Read the MoE layers after one micro-batch forward.

        Args:
            model: the model that just ran its forward.
            new_step: True for the first micro-batch of an optimizer step (restarts the step's load).

        Returns:
            Sum over layers of their weighted auxiliary losses (scalar fp32, differentiable), or None
            for a model without MoE layers.
        """
        layers = moe_modules(model)
        if not layers:
            return None
        if new_step:
            self._step_load = {}
        aux = None
        for name, layer in layers.items():
            stats = layer.stats
            aux = layer.aux_loss if aux is None else aux + layer.aux_loss
            self._step_load[name] = self._step_load.get(name, 0) + stats.counts
            w = self._window.setdefault(name, {})
            for key, value in (
                ("counts", stats.counts),
                ("dropped", stats.dropped),
                ("lb_loss", stats.lb_loss),
                ("seq_loss", stats.seq_loss),
                ("z_loss", stats.z_loss),
            ):
                w[key] = w[key] + value if key in w else value.clone()
            # Counts known on the host stay Python numbers (a tensor would be copied to the device).
            w["assignments"] = w.get("assignments", 0) + stats.assignments
            w["n"] = w.get("n", 0) + 1
        return aux

    @torch.no_grad()
    def finish_step(self, model: nn.Module, group: dist.ProcessGroup | None, rate: float) -> None:
        """Once per optimizer step: update each router's selection bias from the step's global load.

        The per-layer loads of every micro-batch since the last ``new_step`` are stacked, summed over
        ``group`` with one all-reduce (so all replicas apply the same update), and passed to
        :meth:`~kempnerforge.model.router.Router.update_bias`. A no-op when ``rate`` is 0 or no
        micro-batch was collected.
        """
        layers = moe_modules(model)
        if rate <= 0 or not layers or not self._step_load:
            self._step_load = {}
            return
        names = sorted(self._step_load)
        loads = torch.stack([self._step_load[n] for n in names])
        if group is not None:
            dist.all_reduce(loads, group=group)
        for name, load in zip(names, loads, strict=True):
            layers[name].router.update_bias(load, rate)
        self._step_load = {}

    @torch.no_grad()
    def metrics(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Per-layer statistics since the last call, then reset (this rank's tokens).

        Keys ``moe/{layer}/{stat}`` with ``layer`` the FQN (``layers.1.moe``) and stat:
        ``load_max_ratio`` / ``load_min_ratio`` (max / min expert load over the mean load; 1 = balanced),
        ``load_entropy`` (entropy of the load distribution over ln(num_experts); 1 = balanced),
        ``dropped_frac`` (capacity-dropped assignments / all assignments), ``lb_loss``, ``seq_loss``,
        ``z_loss`` (unweighted means over micro-batches), ``bias_range`` (max - min selection bias).
        All values are 0-dim tensors; no host synchronization happens here.
        """
        layers = moe_modules(model)
        out: dict[str, torch.Tensor] = {}
        for name, w in self._window.items():
            counts = w["counts"]
            mean = counts.mean().clamp(min=1e-12)
            p = counts / counts.sum().clamp(min=1e-12)
            entropy = -(p * p.clamp(min=1e-12).log()).sum() / math.log(max(counts.numel(), 2))
            bias = layers[name].router.expert_bias if name in layers else torch.zeros(1)
            prefix = f"moe/{name}"
            out[f"{prefix}/load_max_ratio"] = counts.max() / mean
            out[f"{prefix}/load_min_ratio"] = counts.min() / mean
            out[f"{prefix}/load_entropy"] = entropy
            out[f"{prefix}/dropped_frac"] = w["dropped"] / max(w["assignments"], 1)
            for key in ("lb_loss", "seq_loss", "z_loss"):
                out[f"{prefix}/{key}"] = w[key] / w["n"]
            out[f"{prefix}/bias_range"] = bias.max() - bias.min()
        self._window = {}
        return out
