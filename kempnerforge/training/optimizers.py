"""Optimizers chosen by name: AdamW, Muon (+ AdamW for non-matrix weights), Lion, Schedule-Free AdamW.

Every optimizer gets the same parameter groups (:func:`param_groups`): frozen parameters are left
out, 2-D weight matrices are decayed, norms / biases / embeddings are not (GPT-2 / nanoGPT / litgpt
convention), and DTensor parameters never share a group with plain ones (tensor parallelism without
FSDP2 leaves the parameters outside the TP plan, e.g. norms without sequence parallel or a VLM's
connector, plain: fused and foreach kernels, which run per group, refuse a mix). Each is a plain ``torch.optim.Optimizer`` whose ``state_dict`` holds only tensors keyed
by parameter, so Lightning, FSDP2 (DTensor parameters) and DCP checkpoints treat them alike.

Sources:
- AdamW: Loshchilov & Hutter, arXiv:1711.05101 (``torch.optim.AdamW``, fused kernel on CUDA and CPU).
- Muon: Jordan et al. 2024 (https://kellerjordan.github.io/posts/muon/), ``torch.optim.Muon``;
  ``adjust_lr_fn="match_rms_adamw"`` is Moonlight's update scaling (Liu et al., arXiv:2502.16982),
  which lets Muon reuse an AdamW learning rate and weight decay.
- Lion: Chen et al., "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675
  (``lion_pytorch.Lion``).
- Schedule-Free AdamW: Defazio et al., arXiv:2405.15682 (``schedulefree.AdamWScheduleFree``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: Allowed values of ``OptimizerConfig.name``.
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon", "lion", "schedule_free_adamw")

#: Muon's update-scaling rules (``torch.optim.Muon`` ``adjust_lr_fn``).
MUON_ADJUST_LR: tuple[str, ...] = ("match_rms_adamw", "original")


@dataclass
class OptimizerConfig:
    """Optimizer choice and hyper-parameters (``--model.optimizer.*`` on the CLI).

    Raises:
        ValueError: on construction, naming the field and the allowed values.
    """

    name: str = "adamw"
    """One of ``adamw``, ``muon`` (Muon on hidden 2-D weights, AdamW on the rest), ``lion``,
    ``schedule_free_adamw`` (use with ``scheduler.decay`` ``constant`` or ``none``)."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup). Lion usually wants 3-10x less than AdamW."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to 2-D weight matrices."""
    beta1: float = 0.9
    """First-moment decay (AdamW, Schedule-Free's interpolation, Lion's update interpolation)."""
    beta2: float = 0.95
    """Second-moment decay (AdamW, Schedule-Free); Lion's momentum decay (its paper uses 0.99)."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    decay_norms_and_biases: bool = False
    """Also decay 1-D parameters (norm weights, biases)."""
    decay_embeddings: bool = False
    """Also decay embedding tables (and a head tied to them)."""
    fused: bool | None = None
    """Use the fused AdamW kernel (None: on CUDA and CPU, the devices torch has it for; on CPU it is 6x faster than
    foreach and 2x faster than a ``torch.compile`` d foreach step, see benchmarks/compile_parts.py). AdamW only."""
    foreach: bool | None = None
    """Use the foreach (multi-tensor) AdamW implementation (None: torch's choice when not fused). AdamW only."""
    muon_momentum: float = 0.95
    """Muon momentum (Nesterov) on the hidden matrices."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalize each Muon update."""
    muon_adjust_lr: str = "match_rms_adamw"
    """``match_rms_adamw`` (Moonlight: updates with AdamW's RMS, so ``lr`` and ``weight_decay`` carry
    over from AdamW) or ``original`` (Keller Jordan's sqrt(max(1, rows/cols)); needs a ~50x larger lr)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.name!r} is not allowed; choose one of {list(OPTIMIZERS)}.")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0.")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay={self.weight_decay} must be >= 0.")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name}={getattr(self, name)} must be in [0, 1).")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps={self.eps} must be > 0.")
        if not 1 <= self.muon_ns_steps < 100:
            raise ValueError(f"optimizer.muon_ns_steps={self.muon_ns_steps} must be in [1, 100).")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(f"optimizer.muon_adjust_lr={self.muon_adjust_lr!r}; choose one of {list(MUON_ADJUST_LR)}.")
        for flag in ("fused", "foreach"):
            if getattr(self, flag) and self.name != "adamw":
                raise ValueError(f"optimizer.{flag}=True applies to adamw only, not {self.name!r}.")
        if self.fused and self.foreach:
            raise ValueError("optimizer.fused=True and optimizer.foreach=True exclude each other; set one.")


def _embedding_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group, each split again into plain
    tensors and DTensors.

    Embedding parameters are found by module type (``nn.Embedding``), so a head tied to the embedding
    follows the embedding's rule. Frozen parameters (``requires_grad=False``) are left out. A group
    mixing plain tensors and DTensors (TP without FSDP2: ``dp_shard=1``, or ``pp x tp``) would make
    fused / foreach kernels fail ("got mixed torch.Tensor and DTensor"); those run one group at a
    time, so the kinds are kept apart (DTensors of different meshes may share a group). Returns groups
    with ``weight_decay`` set, in the order decay (plain, DTensor), no decay (plain, DTensor); empty
    groups are dropped.
    """
    embedding_ids = _embedding_ids(model)
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        exempt = (p.ndim < 2 and not cfg.decay_norms_and_biases) or (
            id(p) in embedding_ids and not cfg.decay_embeddings
        )
        (no_decay if exempt else decay).append(p)
    groups = []
    for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        for dtensor in (False, True):
            kind = [p for p in params if isinstance(p, DTensor) == dtensor]
            if kind:
                groups.append({"params": kind, "weight_decay": wd})
    return groups


#: Devices where ``torch.optim.AdamW(fused=True)`` has a kernel and ``fused=None`` picks it.
_FUSED_DEVICES = ("cuda", "cpu")


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` of ``model`` (works on FSDP2 / TP DTensor parameters, any mix).

    Fused on CUDA and CPU (one pass over each parameter's state, no host read of the step count) unless
    ``cfg.fused`` / ``cfg.foreach`` say otherwise; foreach elsewhere.
    """
    params = list(model.parameters())
    fused = cfg.fused
    if fused is None:
        fused = not cfg.foreach and bool(params) and params[0].device.type in _FUSED_DEVICES
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=cfg.foreach,
    )


def muon_param_ids(model: nn.Module) -> set[int]:
    """Ids of the parameters Muon updates: trainable 2-D weights of hidden ``nn.Linear`` layers.

    Excluded (they go to AdamW, as in the Muon and Moonlight recipes): embeddings, the output head
    (``output``; a tied head is the embedding), norms, biases, routers and packed 3-D expert weights
    (``torch.optim.Muon`` orthogonalizes 2-D matrices only).

    Raises:
        ValueError: the model has fused projections (``fuse_qkv`` / ``fuse_w13``): Muon would orthogonalize
            the stacked Q/K/V or gate/up matrix as one, which is not the update of the separate matrices.
    """
    fused = sorted(n for n, m in model.named_modules() if n.endswith(("attention.wqkv", "feed_forward.w13")))
    if fused:
        raise ValueError(
            f"optimizer.name='muon' orthogonalizes each matrix, and {fused[0]} stacks several; set "
            "model.config.fuse_qkv=False and model.config.fuse_w13=False with Muon"
        )
    head = getattr(model, "output", None)
    excluded = _embedding_ids(model) | ({id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set())
    ids = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(("output", "router.gate", "gate")):
            w = module.weight
            if w.requires_grad and w.ndim == 2 and id(w) not in excluded:
                ids.add(id(w))
    return ids


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on hidden matrices and ``torch.optim.AdamW`` on everything else, as one optimizer.

    One ``param_groups`` list (Muon's groups first, each tagged ``"muon": True``) and one ``state``
    shared with the two inner optimizers, so LR schedulers, gradient clipping, ``state_dict`` and DCP
    see a single ordinary optimizer. State per parameter: ``momentum_buffer`` (Muon) or ``step``,
    ``exp_avg``, ``exp_avg_sq`` (AdamW).

    On FSDP2 / TP the parameters and momenta are DTensor shards; Muon's Newton-Schulz matmuls run as
    DTensor ops, which redistribute the sharded momentum matrix (an all-gather per matrix and
    iteration), so every rank orthogonalizes the full matrix redundantly and keeps its own shard of
    the result. That is exact (the same update as one process up to bf16 matmul rounding) but costs
    the full-matrix compute on each rank; fine up to a few billion parameters.

    Args:
        muon_groups, adamw_groups: parameter groups (dicts with ``params`` and ``weight_decay``).
        cfg: hyper-parameters (:class:`OptimizerConfig`).

    Raises:
        ValueError: a Muon parameter is not 2-D (from ``torch.optim.Muon``).
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], cfg: OptimizerConfig) -> None:
        muon_groups = [{**g, "muon": True} for g in muon_groups]
        adamw_groups = [{**g, "muon": False} for g in adamw_groups]
        super().__init__(muon_groups + adamw_groups, {"lr": cfg.lr})
        n = len(muon_groups)
        self._muon = torch.optim.Muon(
            self.param_groups[:n] or [{"params": []}],
            lr=cfg.lr,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
        )
        self._adamw = torch.optim.AdamW(
            self.param_groups[n:] or [{"params": []}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this optimizer's group dicts and state (after init or a load)."""
        n = sum(1 for g in self.param_groups if g["muon"])
        if n:
            self._muon.param_groups = self.param_groups[:n]
        if len(self.param_groups) > n:
            self._adamw.param_groups = self.param_groups[n:]
        self._muon.state = self.state
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like any optimizer, then re-share the new group dicts and state with the inner ones."""
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Muon step on the matrix groups and one AdamW step on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(g["muon"] for g in self.param_groups):
            self._muon.step()
        if any(not g["muon"] for g in self.param_groups):
            self._adamw.step()
        return loss


def build_muon(model: nn.Module, cfg: OptimizerConfig) -> MuonWithAdamW:
    """Muon on :func:`muon_param_ids`, AdamW (same lr, betas, eps) on the rest; both with the
    decay / no-decay split of :func:`param_groups`."""
    ids = muon_param_ids(model)
    muon_groups, adamw_groups = [], []
    for group in param_groups(model, cfg):
        matrices = [p for p in group["params"] if id(p) in ids]
        rest = [p for p in group["params"] if id(p) not in ids]
        if matrices:
            muon_groups.append({**group, "params": matrices})
        if rest:
            adamw_groups.append({**group, "params": rest})
    return MuonWithAdamW(muon_groups, adamw_groups, cfg)


def build_lion(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Lion (``lion_pytorch.Lion``) over :func:`param_groups`, betas ``(beta1, beta2)``."""
    from lion_pytorch import Lion

    return Lion(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def build_schedule_free_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Schedule-Free AdamW (``schedulefree.AdamWScheduleFree``) over :func:`param_groups`.

    The optimizer keeps the iterate ``z`` and the averaged weights ``x`` and puts their interpolation
    ``y`` in the parameters for training; ``optimizer.eval()`` swaps ``x`` in.
    :class:`~kempnerforge.module.CausalLM` calls ``eval()`` around validation and ``train()`` after
    it, and checkpoints are written in train mode (``y`` in the weights, ``z`` in the state), which
    makes resuming bit-exact. Warmup comes from the LR scheduler (``scheduler.decay`` constant or none).
    """
    from schedulefree import AdamWScheduleFree

    opt = AdamWScheduleFree(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    set_schedule_free_mode(opt, train=True)
    return opt


_BUILDERS: dict[str, Callable[[nn.Module, OptimizerConfig], torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "muon": build_muon,
    "lion": build_lion,
    "schedule_free_adamw": build_schedule_free_adamw,
}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` over ``model``'s trainable parameters (see the module docstring).

    Raises:
        ValueError: ``cfg.name`` is unknown (normally caught by :class:`OptimizerConfig`).
    """
    if cfg.name not in _BUILDERS:
        raise ValueError(f"optimizer.name={cfg.name!r} is not allowed; choose one of {list(OPTIMIZERS)}.")
    return _BUILDERS[cfg.name](model, cfg)


def check_optimizer_schedule(cfg: OptimizerConfig, scheduler: Any) -> None:
    """Refuse optimizer / LR-schedule pairs that do not fit together.

    Args:
        cfg: the optimizer config.
        scheduler: a :class:`~kempnerforge.training.lr.SchedulerConfig` (its ``decay`` is read).

    Raises:
        ValueError: ``schedule_free_adamw`` with a decaying schedule: Schedule-Free averaging replaces
            the LR decay (arXiv:2405.15682); use ``scheduler.decay`` ``constant`` or ``none`` (warmup allowed).
    """
    if cfg.name == "schedule_free_adamw" and scheduler.decay not in ("constant", "none"):
        raise ValueError(
            f"optimizer.name='schedule_free_adamw' needs scheduler.decay 'constant' or 'none' (warmup allowed), "
            f"got {scheduler.decay!r}: Schedule-Free's weight averaging replaces the LR decay (arXiv:2405.15682)."
        )


def check_optimizer_model(cfg: OptimizerConfig, model_config: Any) -> None:
    """Refuse optimizer / model-config pairs that do not fit together, before the model is built.

    Args:
        cfg: the optimizer config.
        model_config: a :class:`~kempnerforge.config.model.ModelConfig` (its ``fuse_qkv`` / ``fuse_w13``).

    Raises:
        ValueError: ``muon`` with fused projections (``fuse_qkv`` / ``fuse_w13``, both on by default): Muon
            orthogonalizes each 2-D matrix, and a fused ``wqkv`` / ``w13`` stacks several (the update would not be
            that of the separate Q/K/V or gate/up matrices). ``configs/recipes/muon_wsd.yaml`` sets both False.
    """
    gqa = getattr(model_config, "attention", "gqa") == "gqa"  # MLA ignores fuse_qkv
    fused = [n for n in ("fuse_qkv", "fuse_w13") if getattr(model_config, n, False) and (gqa or n == "fuse_w13")]
    if cfg.name == "muon" and fused:
        raise ValueError(
            f"model.config.{fused[0]}=True (fuse_qkv and fuse_w13 are True by default) does not go with "
            "optimizer.name='muon': Muon orthogonalizes each matrix, and a fused wqkv / w13 stacks several; set "
            "--model.config.fuse_qkv=False --model.config.fuse_w13=False (configs/recipes/muon_wsd.yaml does)"
        )


def set_schedule_free_mode(optimizer: torch.optim.Optimizer, train: bool) -> None:
    """Put a Schedule-Free optimizer's weights in train (``y``) or eval (``x``) mode; no-op for others."""
    mode = getattr(optimizer, "train" if train else "eval", None)
    if callable(mode) and type(optimizer).__module__.startswith("schedulefree"):
        mode()
        # train()/eval() read ``self.state[p]`` of a defaultdict, leaving ``{}`` entries before the first
        # step; DCP's loader then takes the state for initialized and restores no tensors into it.
        for p in [p for p, st in optimizer.state.items() if not st]:
            del optimizer.state[p]
