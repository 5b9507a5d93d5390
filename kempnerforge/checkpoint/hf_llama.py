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
from kempnerforge.config.rope import RopeScaling
from kempnerforge.model.fused import (
    FUSED_QKV,
    FUSED_W13,
    config_qkv_rows,
    join_state_dict,
    split_state_dict,
    unfused_names,
    w13_rows,
)

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
#: transformers' ``rope_parameters`` keys of each scaling type, and the defaults transformers assumes when absent.
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}  # fmt: skip
_HF_ROPE_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}

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
# Present only with ModelConfig.attention_bias (Qwen 2) / qk_norm (Qwen 3); the families check the config first.
_BIAS_KEYS = {f"attention.w{c}.bias": f"self_attn.{c}_proj.bias" for c in "qkv"}
_QK_NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_BLOCK_KEYS.update(_BIAS_KEYS)
_BLOCK_KEYS.update(_QK_NORM_KEYS)
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
    """Where our parameter ``fqn`` lies in a ``save_pretrained`` Llama folder: a rename (:func:`hf_key`), or for a
    fused ``wqkv`` / ``w13`` (:mod:`kempnerforge.model.fused`) the row permutation of HF's separate
    ``q_proj``/``k_proj``/``v_proj`` / ``gate_proj``/``up_proj`` concatenated (each rank reads only its rows).

    Raises:
        KeyError: see :func:`hf_key`.
    """
    found = unfused_names(fqn)
    if found is None:
        return HFSource((hf_key(fqn),))
    names, kind = found
    rows = config_qkv_rows(cfg) if kind == "qkv" else w13_rows(cfg.ffn_hidden)
    return HFSource(tuple(hf_key(n) for n in names), rows=tuple(rows), concat=True)


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
        "head_dim": cfg.head_dim_resolved,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": hf_rope_parameters(cfg),
    }


def without_derived_head_dim(kwargs: dict, cfg: ModelConfig) -> dict:
    """``kwargs`` without ``head_dim`` when it is dim / n_heads: for configs with no ``head_dim`` field (Qwen2,
    Qwen2-MoE), whose attention still reads the attribute when present (``getattr(config, "head_dim", ...)``)."""
    if cfg.head_dim_resolved * cfg.n_heads == cfg.dim:
        return {k: v for k, v in kwargs.items() if k != "head_dim"}
    return kwargs


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """transformers >= 5 ``rope_parameters`` for ``cfg``: ``rope_type`` ('default', 'llama3' or 'yarn'),
    ``rope_theta`` and the scaling type's fields (yarn's optional ones only when set / not transformers' default)."""
    params: dict = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    scaling = cfg.rope_scaling
    if scaling is not None:
        params["rope_type"] = scaling.rope_type
        for key in _ROPE_KEYS[scaling.rope_type]:
            value = getattr(scaling, key)
            if value is not None and not (key in _HF_ROPE_DEFAULTS and value == _HF_ROPE_DEFAULTS[key]):
                params[key] = value
    return params


def rope_from_hf(hf_cfg, name: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` for a transformers config (``rope_parameters``, or the older ``rope_scaling``).

    Args:
        hf_cfg: a transformers config.
        name: its class name for error messages (e.g. "LlamaConfig").

    Raises:
        ValueError: naming the field: a ``rope_type`` other than default / llama3 / yarn (linear, dynamic,
            longrope, ...), ``partial_rotary_factor`` != 1, or a yarn config without ``original_max_position_embeddings``.
    """
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    legacy = dict(getattr(hf_cfg, "rope_scaling", None) or {})
    rope = {**legacy, **rope}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", getattr(hf_cfg, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"{name}.partial_rotary_factor={partial} is not supported; allowed: 1.0 (RoPE on every channel)"
        )
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_KEYS:
        raise ValueError(
            f"{name}.rope_parameters.rope_type={rope_type!r} is not supported; allowed: 'default', 'llama3', 'yarn'"
        )
    if rope.get("original_max_position_embeddings") is None:
        raise ValueError(f"{name}.rope_parameters.original_max_position_embeddings is missing (needed by {rope_type})")
    fields = {k: rope[k] for k in _ROPE_KEYS[rope_type] if rope.get(k) is not None}
    if rope_type == "yarn" and fields.get("factor") is None:  # transformers: the context ratio
        fields["factor"] = hf_cfg.max_position_embeddings / fields["original_max_position_embeddings"]
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if key in fields:
            fields[key] = float(fields[key])
    return theta, RopeScaling(rope_type=rope_type, **fields)


def dense_fields_from_hf(hf_cfg, name: str) -> dict:
    """The :class:`ModelConfig` fields every Llama-like transformers config shares (Llama, Mistral/Mixtral, Qwen 2/3,
    Qwen-MoE): sizes, ``head_dim`` (None when it is hidden_size / num_attention_heads), norm eps, RoPE and tying.

    Raises:
        ValueError: ``hidden_act`` other than silu, or :func:`rope_from_hf`'s refusals (naming ``name``'s field).
    """
    if hf_cfg.hidden_act != "silu":
        raise ValueError(f"{name}.hidden_act={hf_cfg.hidden_act!r} is not supported; allowed: 'silu'")
    theta, scaling = rope_from_hf(hf_cfg, name)
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    derived = (
        hf_cfg.hidden_size % hf_cfg.num_attention_heads == 0
        and head_dim * hf_cfg.num_attention_heads == hf_cfg.hidden_size
    )
    return dict(
        dim=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=hf_cfg.num_attention_heads,
        n_kv_heads=hf_cfg.num_key_value_heads,
        vocab_size=hf_cfg.vocab_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        ffn_hidden_dim=hf_cfg.intermediate_size,
        norm_eps=hf_cfg.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        head_dim=None if derived else head_dim,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
    )


def refuse_sliding_window(hf_cfg, name: str) -> None:
    """Refuse sliding-window attention (kempnerforge attends to the full causal context).

    Raises:
        ValueError: ``use_sliding_window`` True, a ``sliding_window`` shorter than the context (Mistral style,
            without the flag), or ``layer_types`` holding a layer other than 'full_attention'.
    """
    if getattr(hf_cfg, "use_sliding_window", False):
        raise ValueError(
            f"{name}.use_sliding_window=True is not supported (full causal attention only); allowed: False"
        )
    window = getattr(hf_cfg, "sliding_window", None)
    if window is not None and not hasattr(hf_cfg, "use_sliding_window") and window < hf_cfg.max_position_embeddings:
        raise ValueError(
            f"{name}.sliding_window={window} is not supported (full causal attention only); allowed: None or "
            f">= max_position_embeddings={hf_cfg.max_position_embeddings}"
        )
    other = sorted(set(getattr(hf_cfg, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if other:
        raise ValueError(f"{name}.layer_types holds {other}; allowed: only 'full_attention'")


def check_compatible(cfg: ModelConfig) -> None:
    """Refuse what ``LlamaForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` != 0, ``qk_norm`` True, ``attention_bias`` True (HF Llama's
            ``attention_bias`` also puts a bias on o_proj, ours does not).
    """
    for field, ok, allowed in (("num_experts", cfg.num_experts == 0, "0"), ("qk_norm", not cfg.qk_norm, "False"),
                               ("attention_bias", not cfg.attention_bias, "False (Qwen2ForCausalLM has q/k/v biases)")):  # fmt: skip
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no HF LlamaForCausalLM equivalent; allowed: {allowed}"
            )


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.LlamaConfig`` describing the same network as ``cfg``.

    Uses transformers>=5 ``rope_parameters={"rope_type": "default", "rope_theta": ...}`` (the
    ``rope_theta`` keyword of transformers 4 is gone from the signature).

    Raises:
        ValueError: see :func:`check_compatible`.
    """
    from transformers import LlamaConfig  # local import: transformers is slow to import

    check_compatible(cfg)
    return LlamaConfig(
        **decoder_hf_kwargs(cfg),
        intermediate_size=cfg.ffn_hidden,
        attention_bias=False,
        mlp_bias=False,
    )


def from_hf_config(hf_cfg) -> ModelConfig:
    """The ``ModelConfig`` for a ``transformers.LlamaConfig`` (inverse of :func:`to_hf_config`), with ``llama3``
    (Llama 3.1-3.3) or ``yarn`` RoPE scaling and an explicit ``head_dim``.

    Raises:
        ValueError: for features our model does not implement: attention/MLP biases (HF Llama's include o_proj),
            an activation other than silu, another RoPE type (:func:`rope_from_hf`).
    """
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_cfg, field, False):
            raise ValueError(f"LlamaConfig.{field}=True is not supported; allowed: False")
    return ModelConfig(**dense_fields_from_hf(hf_cfg, "LlamaConfig"))


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
    """Rename our state dict to HF ``LlamaForCausalLM`` keys (tensors are not copied, except fused ``wqkv`` / ``w13``,
    which are split into HF's separate projections: that needs ``cfg``).

    With tied embeddings (``cfg.tie_embeddings``, or without ``cfg`` when ``output.weight`` is
    missing or shares memory with ``tok_embeddings.weight``) no ``lm_head.weight`` is emitted: HF
    re-ties it from ``model.embed_tokens.weight``.

    Raises:
        KeyError: naming a key that is not a Transformer parameter (e.g. a qk_norm weight), or a fused key
            without ``cfg``.
    """
    tied = _is_tied(sd, cfg)
    if cfg is not None:
        sd = split_state_dict(sd, cfg)  # fused wqkv / w13 -> HF's separate projections (copies)
    elif fused := next((k for k in sd if FUSED_QKV.match(k) or FUSED_W13.match(k)), None):
        raise KeyError(f"to_hf_state_dict: {fused!r} is a fused projection: pass cfg to split it into HF's tensors")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key == "output.weight" and tied:
            continue
        out[hf_key(key)] = value
    return out


def _expected_keys(cfg: ModelConfig) -> set[str]:
    keys = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    block = set(_BLOCK_KEYS)
    block -= set() if cfg.attention_bias else set(_BIAS_KEYS)
    block -= set() if cfg.qk_norm else set(_QK_NORM_KEYS)
    keys |= {f"layers.{i}.{k}" for i in range(cfg.n_layers) for k in block}
    return keys


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename an HF ``LlamaForCausalLM`` state dict to our keys (tensors are not copied, except that with
    ``cfg.fuse_qkv`` / ``cfg.fuse_w13`` the separate projections are joined into ``wqkv`` / ``w13``).

    The result loads with ``Transformer(cfg).load_state_dict(..., strict=True)``: with
    ``cfg.tie_embeddings`` any ``lm_head.weight`` is dropped and ``output.weight`` is the same tensor
    as ``tok_embeddings.weight``. RoPE ``inv_freq`` buffers of old checkpoints are skipped.
    Also the dense Qwen 2 / Qwen 3 mapping: q/k/v biases and q_norm/k_norm keep their HF names under
    ``self_attn``; which of them must be present follows ``cfg.attention_bias`` / ``cfg.qk_norm``.

    Raises:
        KeyError: naming an HF key with no counterpart (or a layer index >= cfg.n_layers), an
            expected key that is missing, or one the config has no place for (e.g. a bias without attention_bias).
    """
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
    extra = sorted(out.keys() - _expected_keys(cfg))
    if extra:
        raise KeyError(f"from_hf_state_dict: HF weights {extra} have no place in this config")
    return join_state_dict(out, cfg)
