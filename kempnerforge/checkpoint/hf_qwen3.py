"""Conversion between kempnerforge's dense ``Transformer`` with QK-norm and HF ``Qwen3ForCausalLM``.

Qwen 3 is the Llama block with an RMSNorm over ``head_dim`` on each query and key head before RoPE
(``self_attn.q_norm`` / ``k_norm``: our ``attention.q_norm`` / ``k_norm``, the same placement) and a ``head_dim``
that need not be ``hidden_size / num_attention_heads`` (Qwen3-0.6B: 16 heads x 128 != 1024). Qwen 3's
``attention_bias`` also biases o_proj, which our model does not: it is refused, as is sliding-window attention.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kempnerforge.checkpoint import hf_llama
from kempnerforge.config.model import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"


def check_qk_norm_attention(cfg: ModelConfig, name: str) -> None:
    """Refuse attention settings Qwen 3 (dense or MoE) cannot hold: ``qk_norm`` False, ``attention_bias`` True.

    Raises:
        ValueError: naming the field and ``name`` (the HF architecture).
    """
    for field, ok, allowed in (("qk_norm", cfg.qk_norm, "True"),
                               ("attention_bias", not cfg.attention_bias, "False (Qwen 3's bias includes o_proj)")):  # fmt: skip
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no {name} equivalent; allowed: {allowed}"
            )


def check_compatible(cfg: ModelConfig) -> None:
    """Refuse what ``Qwen3ForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` != 0 (that is Qwen3MoeForCausalLM), or
            :func:`check_qk_norm_attention`'s refusals.
    """
    if cfg.num_experts != 0:
        raise ValueError(f"ModelConfig.num_experts={cfg.num_experts} has no Qwen3ForCausalLM equivalent; allowed: 0")
    check_qk_norm_attention(cfg, ARCHITECTURE)


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.Qwen3Config`` for ``cfg`` (no attention bias, no sliding window).

    Raises:
        ValueError: see :func:`check_compatible`.
    """
    from transformers import Qwen3Config  # local import: transformers is slow to import

    check_compatible(cfg)
    return Qwen3Config(**hf_llama.decoder_hf_kwargs(cfg), intermediate_size=cfg.ffn_hidden, attention_bias=False,
                       use_sliding_window=False)  # fmt: skip


def from_hf_qwen3_attention(hf_cfg, name: str) -> dict:
    """The :class:`ModelConfig` fields of a Qwen 3 (dense or MoE) config: the Llama fields plus ``qk_norm=True``.

    Raises:
        ValueError: ``attention_bias`` True, a sliding window, or :func:`hf_llama.dense_fields_from_hf`'s refusals.
    """
    if getattr(hf_cfg, "attention_bias", False):
        raise ValueError(f"{name}.attention_bias=True is not supported (it biases o_proj too); allowed: False")
    hf_llama.refuse_sliding_window(hf_cfg, name)
    return {**hf_llama.dense_fields_from_hf(hf_cfg, name), "qk_norm": True}


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``Qwen3Config``.

    Raises:
        ValueError: see :func:`from_hf_qwen3_attention`.
    """
    return ModelConfig(**from_hf_qwen3_attention(hf_cfg, "Qwen3Config"))


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under ``Qwen3ForCausalLM`` keys (a rename, no copy).

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: a key with no Qwen 3 counterpart.
    """
    check_compatible(cfg)
    return hf_llama.to_hf_state_dict(sd, cfg)


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``Qwen3ForCausalLM`` state dict under our keys; loads with ``Transformer(cfg).load_state_dict(strict=True)``.

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: an HF key with no counterpart, or a missing weight.
    """
    check_compatible(cfg)
    return hf_llama.from_hf_state_dict(sd, cfg)
