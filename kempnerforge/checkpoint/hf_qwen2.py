"""Conversion between kempnerforge's dense ``Transformer`` with q/k/v biases and HF ``Qwen2ForCausalLM`` (Qwen 2 / 2.5).

Qwen 2 is the Llama block with biases on q_proj, k_proj and v_proj (never on o_proj): our ``attention_bias``.
Keys are the Llama mapping (:mod:`~kempnerforge.checkpoint.hf_llama`) plus ``self_attn.{q,k,v}_proj.bias`` <->
``attention.w{q,k,v}.bias``. Sliding-window layers (``use_sliding_window``) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kempnerforge.checkpoint import hf_llama
from kempnerforge.config.model import ModelConfig

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"


def check_compatible(cfg: ModelConfig) -> None:
    """Refuse what ``Qwen2ForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` != 0, ``attention_bias`` False (Qwen 2 always has q/k/v
            biases; a bias-free model is a LlamaForCausalLM), ``qk_norm`` True.
    """
    rules = (("num_experts", cfg.num_experts == 0, "0"), ("attention_bias", cfg.attention_bias, "True"),
             ("qk_norm", not cfg.qk_norm, "False"))  # fmt: skip
    for field, ok, allowed in rules:
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no Qwen2ForCausalLM equivalent; allowed: {allowed}"
            )


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.Qwen2Config`` for ``cfg`` (no sliding window; ``head_dim`` kept, which Qwen2 attention reads).

    Raises:
        ValueError: see :func:`check_compatible`.
    """
    from transformers import Qwen2Config  # local import: transformers is slow to import

    check_compatible(cfg)
    kwargs = hf_llama.without_derived_head_dim(hf_llama.decoder_hf_kwargs(cfg), cfg)
    return Qwen2Config(**kwargs, intermediate_size=cfg.ffn_hidden, use_sliding_window=False)


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``Qwen2Config`` (``attention_bias=True``).

    Raises:
        ValueError: sliding-window attention (:func:`hf_llama.refuse_sliding_window`), or
            :func:`hf_llama.dense_fields_from_hf`'s refusals (activation, RoPE type).
    """
    hf_llama.refuse_sliding_window(hf_cfg, "Qwen2Config")
    return ModelConfig(**hf_llama.dense_fields_from_hf(hf_cfg, "Qwen2Config"), attention_bias=True)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under ``Qwen2ForCausalLM`` keys (a rename, no copy).

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: a key with no Qwen 2 counterpart.
    """
    check_compatible(cfg)
    return hf_llama.to_hf_state_dict(sd, cfg)


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A ``Qwen2ForCausalLM`` state dict under our keys; loads with ``Transformer(cfg).load_state_dict(strict=True)``.

    Raises:
        ValueError: see :func:`check_compatible`.
        KeyError: an HF key with no counterpart, or a missing weight.
    """
    check_compatible(cfg)
    return hf_llama.from_hf_state_dict(sd, cfg)
