"""Validation and parameter counting for the Mixture-of-Experts fields of :class:`ModelConfig`.

Kept apart from ``model.py`` so the dense config stays readable; ``ModelConfig.__post_init__`` calls
:func:`validate_moe` and ``num_params`` / ``num_active_params`` call :func:`moe_layer_params`. The
functions take any object with the fields of :class:`MoEFields` (``ModelConfig`` has them), so this
module needs nothing from ``model.py`` and the two do not import each other.
"""

from __future__ import annotations

from typing import Protocol

#: Router scoring functions: Mixtral / Qwen-MoE softmax, DeepSeek-V3 sigmoid.
ROUTERS = ("softmax", "sigmoid")


class MoEFields(Protocol):
    """The fields of :class:`~kempnerforge.config.model.ModelConfig` that MoE validation and parameter
    counting read (see ``ModelConfig`` for their meaning and units)."""

    dim: int
    n_layers: int
    num_experts: int
    top_k: int
    moe_frequency: int
    n_dense_layers: int
    num_expert_groups: int
    num_limited_groups: int
    n_shared_experts: int
    expert_width_multiplier: float
    shared_expert_gate: bool
    router: str
    route_scale: float
    aux_loss_weight: float
    seq_aux_loss_weight: float
    z_loss_weight: float
    capacity_factor: float
    bias_update_rate: float

    @property
    def ffn_hidden(self) -> int: ...

    @property
    def expert_hidden(self) -> int: ...


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate_moe(cfg: MoEFields) -> None:
    """Check the MoE fields of ``cfg``; with ``num_experts == 0`` (dense) only their types and signs.

    Raises:
        ValueError: naming the field and the allowed values: ``num_experts`` < 0, ``top_k`` not in
            ``[1, num_experts]``, ``moe_frequency`` < 1 or larger than ``n_layers`` (no MoE layer),
            ``n_dense_layers`` < 0 or leaving no MoE layer, ``num_expert_groups`` not dividing ``num_experts``
            into groups of >= 2, ``num_limited_groups`` outside 1..num_expert_groups or too few for ``top_k``,
            ``n_shared_experts`` < 0, ``expert_width_multiplier`` <= 0 or giving an expert width < 1,
            ``router`` not in :data:`ROUTERS`, a negative loss weight / ``capacity_factor`` /
            ``bias_update_rate``, ``bias_update_rate`` > 0 with the softmax router, ``route_scale`` <= 0,
            ``shared_expert_gate`` without shared experts.
    """
    for name in ("num_experts", "n_shared_experts", "n_dense_layers"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 0:
            raise ValueError(f"ModelConfig.{name}={value!r} must be an integer >= 0 (0 = none)")
    for name in ("top_k", "moe_frequency", "num_expert_groups", "num_limited_groups"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 1:
            raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
    for name in ("aux_loss_weight", "seq_aux_loss_weight", "z_loss_weight", "capacity_factor", "bias_update_rate"):
        value = getattr(cfg, name)
        if not _is_number(value) or value < 0:
            raise ValueError(f"ModelConfig.{name}={value!r} must be a number >= 0 (0 disables it)")
    for name in ("expert_width_multiplier", "route_scale"):
        value = getattr(cfg, name)
        if not _is_number(value) or not value > 0:
            raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number (> 0)")
    if cfg.router not in ROUTERS:
        raise ValueError(f"ModelConfig.router={cfg.router!r} is not allowed; choose one of {list(ROUTERS)}")
    if cfg.num_experts == 0:
        return
    if cfg.top_k > cfg.num_experts:
        raise ValueError(
            f"ModelConfig.top_k={cfg.top_k} must be <= num_experts={cfg.num_experts} (allowed: 1..{cfg.num_experts})"
        )
    if cfg.moe_frequency > cfg.n_layers:
        raise ValueError(
            f"ModelConfig.moe_frequency={cfg.moe_frequency} leaves no MoE layer among n_layers={cfg.n_layers} "
            f"(layer i is MoE when (i + 1) % moe_frequency == 0); allowed: 1..{cfg.n_layers}"
        )
    if not any(i >= cfg.n_dense_layers and (i + 1) % cfg.moe_frequency == 0 for i in range(cfg.n_layers)):
        raise ValueError(
            f"ModelConfig.n_dense_layers={cfg.n_dense_layers} leaves no MoE layer among n_layers={cfg.n_layers} "
            f"with moe_frequency={cfg.moe_frequency}; lower it (or set num_experts=0 for a dense model)"
        )
    _validate_groups(cfg)
    if cfg.expert_hidden < 1:
        raise ValueError(
            f"ModelConfig.expert_width_multiplier={cfg.expert_width_multiplier} gives an expert width of "
            f"int({cfg.ffn_hidden} * {cfg.expert_width_multiplier}) = {cfg.expert_hidden} < 1; raise it"
        )
    if cfg.bias_update_rate > 0 and cfg.router != "sigmoid":
        raise ValueError(
            f"ModelConfig.bias_update_rate={cfg.bias_update_rate} needs router='sigmoid' (DeepSeek-V3 "
            f"aux-loss-free balancing); got router={cfg.router!r}. Set bias_update_rate=0 or router='sigmoid'."
        )
    if cfg.shared_expert_gate and cfg.n_shared_experts == 0:
        raise ValueError("ModelConfig.shared_expert_gate=True needs n_shared_experts >= 1")


def _validate_groups(cfg: MoEFields) -> None:
    """Group-limited routing: equal groups of at least 2 experts (a group's score is its top-2 sum), a
    reachable number of groups and enough experts in the chosen groups for top_k."""
    groups, limited = cfg.num_expert_groups, cfg.num_limited_groups
    if cfg.num_experts % groups:
        raise ValueError(
            f"ModelConfig.num_expert_groups={groups} must divide num_experts={cfg.num_experts} (equal groups)"
        )
    if groups > 1 and cfg.num_experts // groups < 2:
        raise ValueError(
            f"ModelConfig.num_expert_groups={groups} gives groups of {cfg.num_experts // groups} expert; each "
            "group needs >= 2 (its score is the sum of its two highest expert scores)"
        )
    if limited > groups:
        raise ValueError(f"ModelConfig.num_limited_groups={limited} must be in 1..num_expert_groups={groups}")
    if groups > 1 and cfg.top_k > limited * (cfg.num_experts // groups):
        raise ValueError(
            f"ModelConfig.top_k={cfg.top_k} exceeds the {limited * (cfg.num_experts // groups)} experts of "
            f"num_limited_groups={limited} groups; raise num_limited_groups or lower top_k"
        )


def moe_layer_params(cfg: MoEFields, active: bool) -> int:
    """Parameters of one MoE feed-forward (router, routed experts, shared experts, shared gate).

    Args:
        cfg: a config with ``num_experts > 0``.
        active: count only the ``top_k`` routed experts a token uses (for FLOPs), else all of them.
    """
    per_expert = 3 * cfg.dim * cfg.expert_hidden
    routed = (cfg.top_k if active else cfg.num_experts) * per_expert
    shared = cfg.n_shared_experts * per_expert + (cfg.dim if cfg.shared_expert_gate else 0)
    return cfg.dim * cfg.num_experts + routed + shared
