"""Conversion between kempnerforge's MoE ``Transformer`` (softmax router) and HF ``MixtralForCausalLM``.

Attention, norms, embedding and head reuse the Llama mapping (:mod:`kempnerforge.checkpoint.hf_llama`).
Each MoE layer maps as (transformers >= 5 keeps Mixtral experts packed):

- ``layers.{i}.moe.router.gate.weight`` (E, dim) <-> ``model.layers.{i}.mlp.gate.weight``
- ``cat([moe.experts.w1, moe.experts.w3], dim=1)`` (E, 2 * hidden, dim) <-> ``mlp.experts.gate_up_proj``
- ``moe.experts.w2`` (E, dim, hidden) <-> ``mlp.experts.down_proj``

The softmax router's ``expert_bias`` buffer is always zero and has no HF counterpart.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from kempnerforge.checkpoint import hf_llama
from kempnerforge.checkpoint.hf_source import HFSource
from kempnerforge.config.model import ModelConfig
from kempnerforge.model.fused import join_state_dict

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"

_MOE_KEY = re.compile(r"^layers\.(\d+)\.moe\.(router\.gate\.weight|router\.expert_bias|experts\.w[123])$")
#: Per-expert names ``save_pretrained`` writes (transformers 5 packs them only in memory), ours -> HF.
_DISK_EXPERT = {"w1": "w1", "w2": "w2", "w3": "w3"}
_HF_MOE_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def check_mixtral_compatible(cfg: ModelConfig) -> None:
    """Refuse configs Mixtral cannot represent.

    Raises:
        ValueError: naming the field: ``num_experts`` == 0, ``moe_frequency`` != 1, ``n_shared_experts``
            != 0, ``n_dense_layers`` != 0, ``num_expert_groups`` != 1, ``router`` != 'softmax',
            ``router_renormalize`` False, ``route_scale`` != 1, ``capacity_factor`` != 0 (Mixtral never drops
            tokens), ``qk_norm``, ``attention_bias``.
    """
    rules = (
        ("num_experts", cfg.num_experts > 0, "> 0"),
        ("moe_frequency", cfg.moe_frequency == 1, "1"),
        ("n_dense_layers", cfg.n_dense_layers == 0, "0"),
        ("num_expert_groups", cfg.num_expert_groups == 1, "1"),
        ("n_shared_experts", cfg.n_shared_experts == 0, "0"),
        ("router", cfg.router == "softmax", "'softmax'"),
        ("router_renormalize", cfg.router_renormalize, "True"),
        ("route_scale", cfg.route_scale == 1.0, "1.0"),
        ("capacity_factor", cfg.capacity_factor == 0, "0"),
        ("qk_norm", not cfg.qk_norm, "False"),
        ("attention_bias", not cfg.attention_bias, "False"),
    )
    for field, ok, allowed in rules:
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no MixtralForCausalLM equivalent; allowed: {allowed}"
            )


check_compatible = check_mixtral_compatible


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``MixtralConfig``: the Llama fields plus ``num_local_experts`` /
    ``num_experts_per_tok`` (experts of width ``intermediate_size``, softmax router, renormalized top-k).

    Raises:
        ValueError: a sliding window shorter than the context, or :func:`hf_llama.dense_fields_from_hf`'s refusals.
    """
    hf_llama.refuse_sliding_window(hf_cfg, "MixtralConfig")
    fields = hf_llama.dense_fields_from_hf(hf_cfg, "MixtralConfig")
    fields.update(num_experts=hf_cfg.num_local_experts, top_k=hf_cfg.num_experts_per_tok)
    return ModelConfig(**fields)


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.MixtralConfig`` describing the same network as ``cfg`` (no sliding window,
    no router jitter).

    Raises:
        ValueError: see :func:`check_mixtral_compatible`.
    """
    from transformers import MixtralConfig  # local import: transformers is slow to import

    check_mixtral_compatible(cfg)
    return MixtralConfig(
        **hf_llama.decoder_hf_kwargs(cfg),
        intermediate_size=cfg.expert_hidden,
        sliding_window=None,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )


def hf_source(fqn: str, cfg: ModelConfig, disk_keys: set[str]) -> HFSource:
    """Where our parameter ``fqn`` lies in a ``save_pretrained`` Mixtral folder.

    transformers 5 writes the original per-expert layout (``block_sparse_moe.gate.weight``,
    ``block_sparse_moe.experts.{e}.w1.weight`` (hidden, dim), ...: our packed experts are a stack of them); a
    folder in the in-memory packed layout (``mlp.experts.gate_up_proj``) is read as blocks of it (w1 at hidden
    offset 0, w3 at ``expert_hidden``). Everything else is the Llama rename.

    Raises:
        KeyError: ``fqn`` has no Mixtral name.
    """
    match = _MOE_KEY.match(fqn)
    if match is None:
        return hf_llama.hf_source(fqn, cfg, disk_keys)
    layer, name = match.groups()
    legacy = f"model.layers.{layer}.block_sparse_moe"
    if name == "router.gate.weight":
        key = f"{legacy}.gate.weight"
        return HFSource((key if key in disk_keys else f"model.layers.{layer}.mlp.gate.weight",))
    if name == "router.expert_bias":
        raise KeyError(f"{fqn!r} (a buffer) has no Mixtral counterpart")
    w = name.removeprefix("experts.")
    if f"{legacy}.experts.0.{_DISK_EXPERT[w]}.weight" in disk_keys:
        return HFSource(
            tuple(f"{legacy}.experts.{e}.{_DISK_EXPERT[w]}.weight" for e in range(cfg.num_experts)), stacked=True
        )
    packed = f"model.layers.{layer}.mlp.experts"
    if w == "w2":
        return HFSource((f"{packed}.down_proj",))
    return HFSource((f"{packed}.gate_up_proj",), offset=(0, cfg.expert_hidden if w == "w3" else 0, 0))


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our MoE state dict under HF ``MixtralForCausalLM`` keys (expert w1/w3 are concatenated, a copy).

    Raises:
        ValueError: see :func:`check_mixtral_compatible`.
        KeyError: naming a key with no Mixtral counterpart.
    """
    check_mixtral_compatible(cfg)
    return moe_to_hf(sd, cfg)


def moe_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our MoE state dict (router + packed routed experts, no shared experts) under the Mixtral / Qwen3-MoE keys of
    transformers 5 (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); every other key
    through the Llama mapping. No compatibility check: the family's ``to_hf_state_dict`` does it.

    Raises:
        KeyError: from the Llama mapping, naming a key without counterpart.
    """
    dense, out = {}, {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        match = _MOE_KEY.match(key)
        if match is None:
            dense[key] = value
            continue
        layer, name = match.groups()
        if name == "router.gate.weight":
            out[f"model.layers.{layer}.mlp.gate.weight"] = value
        elif name.startswith("experts."):
            experts.setdefault(layer, {})[name[-2:]] = value
    for layer, w in experts.items():
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"]
    out.update(hf_llama.to_hf_state_dict(dense, cfg))
    return out


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF ``MixtralForCausalLM`` state dict under our keys; loads with ``Transformer(cfg).load_state_dict``
    (``strict=True``; the router ``expert_bias`` buffers are emitted as zeros).

    Raises:
        ValueError: see :func:`check_mixtral_compatible`.
        KeyError: naming an HF key with no counterpart, or missing weights.
    """
    check_mixtral_compatible(cfg)
    return moe_from_hf(sd, cfg, _HF_MOE_KEY)


def moe_from_hf(
    sd: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    moe_key: re.Pattern,
    other: Callable[[str, str, torch.Tensor, dict[str, torch.Tensor]], None] | None = None,
) -> dict[str, torch.Tensor]:
    """HF MoE decoder state dict (Mixtral / Qwen2-MoE layout of transformers 5) under our keys.

    Keys matching ``moe_key`` (groups: layer, name after ``mlp.``) are the router and the packed
    routed experts; any other MLP name goes to ``other(prefix, name, value, out)`` (e.g. Qwen's shared
    experts); everything else through the dense Llama mapping.

    Raises:
        KeyError: an MLP name with no counterpart (and no ``other``), or from the dense mapping.
    """
    dense, out = {}, {}
    for key, value in sd.items():
        match = moe_key.match(key)
        if match is None:
            dense[key] = value
            continue
        layer, name = match.groups()
        prefix = f"layers.{layer}.moe"
        if name == "gate.weight":
            out[f"{prefix}.router.gate.weight"] = value
            out[f"{prefix}.router.expert_bias"] = torch.zeros(cfg.num_experts, dtype=torch.float32)
        elif name == "experts.gate_up_proj":
            out[f"{prefix}.experts.w1"], out[f"{prefix}.experts.w3"] = value.chunk(2, dim=1)
        elif name == "experts.down_proj":
            out[f"{prefix}.experts.w2"] = value
        elif other is not None:
            other(prefix, name, value, out)
        else:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {key!r}")
    out.update(_dense_from_hf(dense, cfg))
    return out


def _dense_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # Llama's renames; not hf_llama.from_hf_state_dict, whose missing-key check wants dense MLP weights.
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in hf_llama._TOP_KEYS_INV:
            if key == "lm_head.weight" and cfg.tie_embeddings:
                continue
            out[hf_llama._TOP_KEYS_INV[key]] = value
            continue
        match = hf_llama._HF_BLOCK.match(key)
        if match is None or match.group(2) not in hf_llama._BLOCK_KEYS_INV:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {key!r}")
        out[f"layers.{match.group(1)}.{hf_llama._BLOCK_KEYS_INV[match.group(2)]}"] = value
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return join_state_dict(out, cfg)  # fused wqkv / dense-layer w13 (kempnerforge.model.fused)
