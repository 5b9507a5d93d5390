"""Conversion between kempnerforge's MoE ``Transformer`` with QK-norm and HF ``Qwen3MoeForCausalLM``.

Qwen3-MoE: Qwen 3 attention (QK-norm, explicit ``head_dim``, see :mod:`~kempnerforge.checkpoint.hf_qwen3`), a
softmax router over ``num_experts`` experts of width ``moe_intermediate_size`` (our ``expert_hidden``), top-k
renormalized when ``norm_topk_prob`` (our ``router_renormalize``), no shared experts, MoE on every
``decoder_sparse_step``-th layer (our ``moe_frequency``) and dense SwiGLU layers of width ``intermediate_size``
elsewhere. The MoE keys are Mixtral's in transformers 5 (``mlp.gate.weight``, packed ``mlp.experts.gate_up_proj`` /
``down_proj``). ``mlp_only_layers`` (dense layers at arbitrary indices) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kempnerforge.checkpoint import hf_llama, hf_mixtral, hf_qwen3
from kempnerforge.checkpoint.hf_qwen2_moe import expert_width_multiplier
from kempnerforge.config.model import ModelConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"


def check_compatible(cfg: ModelConfig) -> None:
    """Refuse what ``Qwen3MoeForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` == 0, ``n_shared_experts`` != 0, ``router`` != 'softmax',
            ``route_scale`` != 1, ``capacity_factor`` != 0, or :func:`hf_qwen3.check_qk_norm_attention`'s refusals.
    """
    rules = (
        ("num_experts", cfg.num_experts > 0, "> 0"),
        ("n_shared_experts", cfg.n_shared_experts == 0, "0"),
        ("router", cfg.router == "softmax", "'softmax'"),
        ("route_scale", cfg.route_scale == 1.0, "1.0"),
        ("capacity_factor", cfg.capacity_factor == 0, "0"),
    )
    for field, ok, allowed in rules:
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no Qwen3MoeForCausalLM equivalent; allowed: {allowed}"
            )
    hf_qwen3.check_qk_norm_attention(cfg, ARCHITECTURE)


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.Qwen3MoeConfig`` for ``cfg``.

    Raises:
        ValueError: see :func:`check_compatible`.
    """
    from transformers import Qwen3MoeConfig  # local import: transformers is slow to import

    check_compatible(cfg)
    return Qwen3MoeConfig(
        **hf_llama.decoder_hf_kwargs(cfg),
        intermediate_size=cfg.ffn_hidden,
        moe_intermediate_size=cfg.expert_hidden,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.router_renormalize,
        decoder_sparse_step=cfg.moe_frequency,
        mlp_only_layers=[],
        attention_bias=False,
        use_sliding_window=False,
        output_router_logits=False,
    )


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``Qwen3MoeConfig``.

    Raises:
        ValueError: non-empty ``mlp_only_layers``, or :func:`hf_qwen3.from_hf_qwen3_attention`'s refusals.
    """
    only = list(getattr(hf_cfg, "mlp_only_layers", None) or [])
    if only:
        raise ValueError(
            f"Qwen3MoeConfig.mlp_only_layers={only} is not supported; allowed: [] (use decoder_sparse_step)"
        )
    fields = hf_qwen3.from_hf_qwen3_attention(hf_cfg, "Qwen3MoeConfig")
    fields.update(
        num_experts=hf_cfg.num_experts,
        top_k=hf_cfg.num_experts_per_tok,
        moe_frequency=hf_cfg.decoder_sparse_step,
        expert_width_multiplier=expert_width_multiplier(hf_cfg.intermediate_size, hf_cfg.moe_intermediate_size),
        router_renormalize=bool(hf_cfg.norm_topk_prob),
    )
    return ModelConfig(**fields)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under ``Qwen3MoeForCausalLM`` keys (expert w1/w3 concatenated into gate_up_proj, a copy).

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: a key with no Qwen3-MoE counterpart.
    """
    check_compatible(cfg)
    return hf_mixtral.moe_to_hf(sd, cfg)


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``Qwen3MoeForCausalLM`` state dict under our keys; loads with ``Transformer(cfg).load_state_dict`` (strict;
    router ``expert_bias`` buffers emitted as zeros).

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: an HF key with no counterpart.
    """
    check_compatible(cfg)
    return hf_mixtral.moe_from_hf(sd, cfg, hf_mixtral._HF_MOE_KEY)
