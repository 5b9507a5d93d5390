"""Key mapping between kempnerforge's ``Transformer`` and Hugging Face ``LlamaForCausalLM``.

Our RoPE uses HF's non-interleaved "rotate_half" layout, so conversion is a pure rename: no
q/k weight permutation (unlike Meta's original checkpoints, which HF's converter permutes).
Weights keep their ``(out_features, in_features)`` layout on both sides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kempnerforge.checkpoint.hf_source import HFSource
from kempnerforge.config.model import ModelConfig

# Per-block renames: ours -> HF, relative to "layers.{i}." / "model.layers.{i}.".
_BLOCK_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_KEYS_INV = {hf: ours for ours, hf in _BLOCK_KEYS.items()}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_KEYS_INV = {hf: ours for ours, hf in _TOP_KEYS.items()}
_OURS_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Old HF checkpoints saved the RoPE inverse frequencies; we recompute RoPE, so they carry nothing.
_HF_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq$")


def hf_key(fqn: str) -> str:
    """The HF ``LlamaForCausalLM`` key of our canonical FQN ``fqn`` (a pure rename, from the same tables as
    :func:`to_hf_state_dict`).

    Raises:
        KeyError: ``fqn`` is not a Transformer parameter with a Llama name (e.g. a qk_norm weight).
    """
    if fqn in _TOP_KEYS:
        return _TOP_KEYS[fqn]
    match = _OURS_BLOCK.match(fqn)
    if match is None or match.group(2) not in _BLOCK_KEYS:
        raise KeyError(f"to_hf_state_dict: no HF Llama name for key {fqn!r}")
    return f"model.layers.{match.group(1)}.{_BLOCK_KEYS[match.group(2)]}"


def hf_source(fqn: str, cfg: ModelConfig, disk_keys: set[str]) -> HFSource:
    """Where our parameter ``fqn`` lies in a ``save_pretrained`` Llama folder: a rename (:func:`hf_key`).

    Raises:
        KeyError: see :func:`hf_key`.
    """
    return HFSource((hf_key(fqn),))


def decoder_hf_kwargs(cfg: ModelConfig) -> dict:
    """The ``transformers`` config fields every Llama-family decoder shares (Llama, Mixtral), from ``cfg``.

    The feed-forward width is left to the caller (dense ``intermediate_size`` vs expert width).
    """
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads_resolved,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
    }


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.LlamaConfig`` describing the same network as ``cfg``.

    Uses transformers>=5 ``rope_parameters={"rope_type": "default", "rope_theta": ...}`` (the
    ``rope_theta`` keyword of transformers 4 is gone from the signature).

    Raises:
        ValueError: if ``cfg.qk_norm`` is set (HF Llama has no QK-norm).
    """
    from transformers import LlamaConfig  # local import: transformers is slow to import

    if cfg.qk_norm:
        raise ValueError("ModelConfig.qk_norm=True has no HF LlamaForCausalLM equivalent; allowed: False")
    return LlamaConfig(
        **decoder_hf_kwargs(cfg),
        intermediate_size=cfg.ffn_hidden,
        attention_bias=False,
        mlp_bias=False,
    )


def from_hf_config(hf_cfg) -> ModelConfig:
    """The ``ModelConfig`` for a ``transformers.LlamaConfig`` (inverse of :func:`to_hf_config`).

    Raises:
        ValueError: for features our model does not implement: RoPE scaling (``rope_type`` other
            than "default", e.g. Llama-3.1's "llama3"), attention/MLP biases, an activation other
            than silu, or ``head_dim != hidden_size / num_attention_heads``.
    """
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"LlamaConfig rope_type={rope.get('rope_type')!r} is not supported; allowed: 'default'")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_cfg, field, False):
            raise ValueError(f"LlamaConfig.{field}=True is not supported; allowed: False")
    if hf_cfg.hidden_act != "silu":
        raise ValueError(f"LlamaConfig.hidden_act={hf_cfg.hidden_act!r} is not supported; allowed: 'silu'")
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size:
        raise ValueError(
            f"LlamaConfig.head_dim={head_dim} must equal hidden_size / num_attention_heads "
            f"= {hf_cfg.hidden_size} / {hf_cfg.num_attention_heads}"
        )
    return ModelConfig(
        dim=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=hf_cfg.num_key_value_heads,
        vocab_size=hf_cfg.vocab_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        ffn_hidden_dim=hf_cfg.intermediate_size,
        norm_eps=hf_cfg.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
    )


def _is_tied(sd: Mapping[str, torch.Tensor], cfg: ModelConfig | None) -> bool:
    if cfg is not None:
        return cfg.tie_embeddings
    # Without a config, infer tying from shared memory: a live tied model's state_dict holds two
    # detached views of one storage.
    head, emb = sd.get("output.weight"), sd.get("tok_embeddings.weight")
    if head is None:
        return True
    return emb is not None and head.shape == emb.shape and head.data_ptr() == emb.data_ptr() != 0


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Rename our state dict to HF ``LlamaForCausalLM`` keys (tensors are not copied).

    With tied embeddings (``cfg.tie_embeddings``, or without ``cfg`` when ``output.weight`` is
    missing or shares memory with ``tok_embeddings.weight``) no ``lm_head.weight`` is emitted: HF
    re-ties it from ``model.embed_tokens.weight``.

    Raises:
        KeyError: naming a key that is not a Transformer parameter (e.g. a qk_norm weight).
    """
    tied = _is_tied(sd, cfg)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "output.weight" and tied:
            continue
        out[hf_key(key)] = value
    return out


def _expected_keys(cfg: ModelConfig) -> set[str]:
    keys = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    keys |= {f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in _BLOCK_KEYS}
    return keys


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename an HF ``LlamaForCausalLM`` state dict to our keys (tensors are not copied).

    The result loads with ``Transformer(cfg).load_state_dict(..., strict=True)``: with
    ``cfg.tie_embeddings`` any ``lm_head.weight`` is dropped and ``output.weight`` is the same tensor
    as ``tok_embeddings.weight``. RoPE ``inv_freq`` buffers of old checkpoints are skipped.

    Raises:
        KeyError: naming an HF key with no counterpart (or a layer index >= cfg.n_layers), or an
            expected key that is missing.
        ValueError: if ``cfg.qk_norm`` is set (HF Llama checkpoints have no QK-norm weights).
    """
    if cfg.qk_norm:
        raise ValueError("ModelConfig.qk_norm=True has no HF LlamaForCausalLM equivalent; allowed: False")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if _HF_IGNORED.match(key):
            continue
        if key in _TOP_KEYS_INV:
            if key == "lm_head.weight" and cfg.tie_embeddings:
                continue
            out[_TOP_KEYS_INV[key]] = value
            continue
        match = _HF_BLOCK.match(key)
        if match is None or match.group(2) not in _BLOCK_KEYS_INV or int(match.group(1)) >= cfg.n_layers:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {key!r} (n_layers={cfg.n_layers})")
        out[f"layers.{match.group(1)}.{_BLOCK_KEYS_INV[match.group(2)]}"] = value
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    missing = sorted(_expected_keys(cfg) - out.keys())
    if missing:
        raise KeyError(f"from_hf_state_dict: HF state dict lacks weights for {missing}")
    return out
