"""Conversion between kempnerforge's MoE ``Transformer`` with gated shared experts and HF ``Qwen2MoeForCausalLM``.

Qwen1.5/2-MoE: softmax router (``norm_topk_prob`` = ``router_renormalize``), routed experts of width
``moe_intermediate_size``, one sigmoid-gated shared expert of width ``shared_expert_intermediate_size``,
MoE on every ``decoder_sparse_step``-th layer (our ``moe_frequency``, same rule) and dense SwiGLU
layers of width ``intermediate_size`` elsewhere. Our ``n_shared_experts`` experts of width h, summed,
are one SwiGLU of width ``n * h`` (rows of w1/w3 and columns of w2 concatenated), so:

- ``layers.{i}.moe.router.gate.weight`` <-> ``model.layers.{i}.mlp.gate.weight``
- ``cat([experts.w1, experts.w3], dim=1)`` <-> ``mlp.experts.gate_up_proj``; ``experts.w2`` <-> ``mlp.experts.down_proj``
- ``cat(shared_experts.{s}.w1)`` / ``w3`` / ``w2`` <-> ``mlp.shared_expert.gate_proj`` / ``up_proj`` / ``down_proj``
- ``moe.shared_gate.weight`` <-> ``mlp.shared_expert_gate.weight``

Attention, norms, embeddings, head and dense layers use the Llama mapping; ``qkv_bias`` is our ``attention_bias``
(q/k/v only, as Qwen2-MoE).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kempnerforge.checkpoint import hf_llama
from kempnerforge.checkpoint.hf_source import SWIGLU_NAMES, HFSource, routed_experts_source, shared_expert_source
from kempnerforge.config.model import ModelConfig

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"

_MOE_KEY = re.compile(r"^layers\.(\d+)\.moe\.(.+)$")
_HF_MOE_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\..+|shared_expert.*)$")
_SHARED = SWIGLU_NAMES  # ours -> HF projection names


def check_qwen2_moe_compatible(cfg: ModelConfig) -> None:
    """Refuse configs ``Qwen2MoeForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` == 0, ``n_shared_experts`` == 0,
            ``shared_expert_gate`` False, ``n_dense_layers`` != 0, ``num_expert_groups`` != 1, ``router`` != 'softmax', ``route_scale`` != 1,
            ``capacity_factor`` != 0, ``qk_norm``.
    """
    rules = (
        ("num_experts", cfg.num_experts > 0, "> 0"),
        ("n_shared_experts", cfg.n_shared_experts > 0, ">= 1"),
        ("shared_expert_gate", cfg.shared_expert_gate, "True"),
        ("n_dense_layers", cfg.n_dense_layers == 0, "0"),
        ("num_expert_groups", cfg.num_expert_groups == 1, "1"),
        ("router", cfg.router == "softmax", "'softmax'"),
        ("route_scale", cfg.route_scale == 1.0, "1.0"),
        ("capacity_factor", cfg.capacity_factor == 0, "0"),
        ("qk_norm", not cfg.qk_norm, "False"),
    )
    for field, ok, allowed in rules:
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no Qwen2MoeForCausalLM equivalent; allowed: {allowed}"
            )


def check_compatible(cfg: ModelConfig) -> None:
    """:func:`check_qwen2_moe_compatible` (the registry's name for it)."""
    check_qwen2_moe_compatible(cfg)


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.Qwen2MoeConfig`` for ``cfg`` (``qkv_bias`` = ``attention_bias``, no sliding window).

    Raises:
        ValueError: see :func:`check_qwen2_moe_compatible`.
    """
    from transformers import Qwen2MoeConfig  # local import: transformers is slow to import

    check_qwen2_moe_compatible(cfg)
    return Qwen2MoeConfig(
        **hf_llama.without_derived_head_dim(hf_llama.decoder_hf_kwargs(cfg), cfg),
        intermediate_size=cfg.ffn_hidden,
        moe_intermediate_size=cfg.expert_hidden,
        shared_expert_intermediate_size=cfg.n_shared_experts * cfg.expert_hidden,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.router_renormalize,
        decoder_sparse_step=cfg.moe_frequency,
        mlp_only_layers=[],
        qkv_bias=cfg.attention_bias,
        use_sliding_window=False,
        output_router_logits=False,
    )


def expert_width_multiplier(ffn_hidden: int, expert_hidden: int) -> float:
    """The ``expert_width_multiplier`` with ``int(ffn_hidden * m) == expert_hidden`` (exact under float rounding)."""
    multiplier = expert_hidden / ffn_hidden
    if int(ffn_hidden * multiplier) != expert_hidden:  # float rounding: nudge up to the exact width
        multiplier = (expert_hidden + 0.5) / ffn_hidden
    return multiplier


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``Qwen2MoeConfig``.

    Raises:
        ValueError: a sliding window, ``mlp_only_layers``, or a shared-expert width that is not a whole number of
            routed-expert widths; plus :func:`hf_llama.dense_fields_from_hf`'s refusals.
    """
    hf_llama.refuse_sliding_window(hf_cfg, "Qwen2MoeConfig")
    only = list(getattr(hf_cfg, "mlp_only_layers", None) or [])
    if only:
        raise ValueError(
            f"Qwen2MoeConfig.mlp_only_layers={only} is not supported; allowed: [] (use decoder_sparse_step)"
        )
    expert, shared = hf_cfg.moe_intermediate_size, hf_cfg.shared_expert_intermediate_size
    if shared % expert:
        raise ValueError(
            f"Qwen2MoeConfig.shared_expert_intermediate_size={shared} must be a multiple of "
            f"moe_intermediate_size={expert} (kempnerforge's shared experts have the routed experts' width)"
        )
    fields = hf_llama.dense_fields_from_hf(hf_cfg, "Qwen2MoeConfig")
    fields["attention_bias"] = bool(getattr(hf_cfg, "qkv_bias", False))
    fields["expert_width_multiplier"] = expert_width_multiplier(hf_cfg.intermediate_size, expert)
    fields.update(
        num_experts=hf_cfg.num_experts,
        top_k=hf_cfg.num_experts_per_tok,
        moe_frequency=hf_cfg.decoder_sparse_step,
        n_shared_experts=shared // expert,
        shared_expert_gate=True,
        router_renormalize=bool(hf_cfg.norm_topk_prob),
    )
    return ModelConfig(**fields)


def hf_source(fqn: str, cfg: ModelConfig, disk_keys: set[str]) -> HFSource:
    """Where our parameter ``fqn`` lies in a ``save_pretrained`` Qwen2-MoE folder.

    Routed experts: per-expert ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (what transformers 5
    writes; a stack along our dim 0), or blocks of the packed ``gate_up_proj`` / ``down_proj``. Shared expert
    ``s`` of width h: rows ``[s * h, (s + 1) * h)`` of ``shared_expert.gate_proj`` / ``up_proj``, columns of
    ``down_proj`` (:data:`_SHARED`). Everything else is the Llama rename.

    Raises:
        KeyError: ``fqn`` has no Qwen2-MoE name.
    """
    match = _MOE_KEY.match(fqn)
    if match is None:
        return hf_llama.hf_source(fqn, cfg, disk_keys)
    layer, name = match.groups()
    p, h = f"model.layers.{layer}.mlp", cfg.expert_hidden
    if name == "router.gate.weight":
        return HFSource((f"{p}.gate.weight",))
    if name == "shared_gate.weight":
        return HFSource((f"{p}.shared_expert_gate.weight",))
    shared = re.fullmatch(r"shared_experts\.(\d+)\.(w[123])\.weight", name)
    if shared is not None:
        return shared_expert_source(f"{p}.shared_expert.{{}}.weight", shared.group(2), int(shared.group(1)), h)
    routed = re.fullmatch(r"experts\.(w[123])", name)
    if routed is None:
        raise KeyError(f"{fqn!r} has no Qwen2MoeForCausalLM counterpart")
    return routed_experts_source(f"{p}.experts", routed.group(1), cfg.num_experts, h, disk_keys)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under ``Qwen2MoeForCausalLM`` keys (expert and shared-expert weights concatenated).

    Raises:
        ValueError: see :func:`check_qwen2_moe_compatible`.
        KeyError: naming a key with no Qwen2-MoE counterpart.
    """
    check_qwen2_moe_compatible(cfg)
    dense, out = {}, {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        match = _MOE_KEY.match(key)
        if match is None:
            dense[key] = value
        else:
            layers.setdefault(match.group(1), {})[match.group(2)] = value
    for layer, w in layers.items():
        p = f"model.layers.{layer}.mlp"
        out[f"{p}.gate.weight"] = w.pop("router.gate.weight")
        w.pop("router.expert_bias", None)  # selection bias of the sigmoid router: always zero under softmax
        out[f"{p}.experts.gate_up_proj"] = torch.cat([w.pop("experts.w1"), w.pop("experts.w3")], dim=1)
        out[f"{p}.experts.down_proj"] = w.pop("experts.w2")
        out[f"{p}.shared_expert_gate.weight"] = w.pop("shared_gate.weight")
        for ours, hf in _SHARED.items():
            parts = [w.pop(f"shared_experts.{s}.{ours}.weight") for s in range(cfg.n_shared_experts)]
            out[f"{p}.shared_expert.{hf}.weight"] = torch.cat(parts, dim=1 if ours == "w2" else 0)
        if w:
            raise KeyError(f"to_hf_state_dict: no Qwen2-MoE name for layers.{layer}.moe keys {sorted(w)}")
    out.update(hf_llama.to_hf_state_dict(dense, cfg))
    return out


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``Qwen2MoeForCausalLM`` state dict under our keys; loads with ``Transformer(cfg).load_state_dict``
    (``strict=True``; router ``expert_bias`` buffers are emitted as zeros).

    Raises:
        ValueError: see :func:`check_qwen2_moe_compatible`.
        KeyError: naming an HF key with no counterpart.
    """
    from kempnerforge.checkpoint.hf_mixtral import moe_from_hf

    check_qwen2_moe_compatible(cfg)
    shared_names = {f"shared_expert.{hf}.weight": o for o, hf in _SHARED.items()}

    def shared(prefix: str, name: str, value: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        if name == "shared_expert_gate.weight":
            out[f"{prefix}.shared_gate.weight"] = value
            return
        ours = shared_names.get(name)
        if ours is None:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {prefix}: mlp.{name!r}")
        for s, part in enumerate(value.chunk(cfg.n_shared_experts, dim=1 if ours == "w2" else 0)):
            out[f"{prefix}.shared_experts.{s}.{ours}.weight"] = part

    return moe_from_hf(sd, cfg, _HF_MOE_KEY, shared)
