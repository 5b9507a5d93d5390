"""Conversion between kempnerforge's MLA ``Transformer`` and HF ``DeepseekV3ForCausalLM`` (DeepSeek-V3,
arXiv:2412.19437).

Config: MLA widths map by name (``q_lora_rank`` None <-> 0); the sigmoid router with ``e_score_correction_bias``
(our ``expert_bias`` buffer, copied both ways), ``routed_scaling_factor`` (``route_scale``), ``norm_topk_prob``
(``router_renormalize``), ``n_group`` / ``topk_group`` (``num_expert_groups`` / ``num_limited_groups``),
``first_k_dense_replace`` (``n_dense_layers``; equal to ``num_hidden_layers``: a dense model), routed experts of
width ``moe_intermediate_size`` and ``n_shared_experts`` shared experts of that width (HF fuses them into one MLP
of width ``n * moe_intermediate_size``; summed SwiGLUs of width h are one of width n * h).

Weights, per block (``layers.{i}.`` <-> ``model.layers.{i}.``):

- ``attention.wq`` / ``wq_a`` / ``q_norm`` / ``wq_b`` <-> ``self_attn.q_proj`` / ``q_a_proj`` / ``q_a_layernorm`` /
  ``q_b_proj``; ``wkv_a`` / ``kv_norm`` / ``wkv_b`` / ``wo`` <-> ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
  ``kv_b_proj`` / ``o_proj``.
- RoPE layout: with ``rope_interleave=True`` (DeepSeek's checkpoints and the HF default) HF rotates channel pairs
  ``(2i, 2i + 1)`` and emits them as ``[evens | odds]``; our RoPE is rotate-half (pairs ``(i, i + d/2)``). So the
  output rows of the RoPE channels (each query head's last ``qk_rope_head_dim`` rows of ``q_proj`` / ``q_b_proj``,
  the last ``qk_rope_head_dim`` rows of ``kv_a_proj_with_mqa``) are permuted evens-then-odds on import and back on
  export: a permutation, so logits match HF's and the round trip is bit-exact. ``rope_interleave=False``
  checkpoints import unpermuted; exports always write ``rope_interleave=True``.
- MoE: ``moe.router.gate.weight`` / ``expert_bias`` <-> ``mlp.gate.weight`` / ``e_score_correction_bias``;
  ``cat([experts.w1, experts.w3], 1)`` / ``experts.w2`` <-> ``mlp.experts.gate_up_proj`` / ``down_proj``
  (transformers 5's in-memory layout; ``save_pretrained`` writes per-expert keys); ``cat(shared_experts.{s}.w*)``
  <-> ``mlp.shared_experts.*_proj``. Dense layers, norms, embedding and head as Llama.

Refused, naming the field: multi-token-prediction weights on disk (``num_nextn_predict_layers``), FP8
block-quantized checkpoints (``quantization_config``), an activation other than silu, attention biases or dropout,
``num_key_value_heads != num_attention_heads``, RoPE types other than default / llama3 / yarn, ``rms_norm_eps`` other
than 1e-6 (HF's latent norms hard-code 1e-6, ours use ``norm_eps``), no shared experts.

Sharded load (``model.init_from``): :func:`hf_source` maps each parameter, and the correction-bias buffer
(:data:`HF_BUFFERS`), to its tensor in a ``save_pretrained`` folder (per-expert keys on disk); the RoPE permutation
travels as ``HFSource.rows``, so each rank reads its own rows plus at most the rest of one head's RoPE rows.
:func:`check_hf_dir` (MTP layers) runs in the preflight.

YaRN (DeepSeek-V3's long-context RoPE): ``rope_parameters`` map to ``ModelConfig.rope_scaling`` (tables over the
``qk_rope_head_dim`` channels, cos/sin times the ``mscale / mscale_all_dim`` attention factor) and the softmax scale
is multiplied by ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` (:func:`kempnerforge.model.mla.mla_softmax_scale`),
as HF ``DeepseekV3Attention`` does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from kempnerforge.checkpoint import hf_llama
from kempnerforge.checkpoint.hf_source import SWIGLU_NAMES, HFSource, routed_experts_source, shared_expert_source
from kempnerforge.config.model import ModelConfig
from kempnerforge.model.fused import join_state_dict, split_state_dict, unfused_names

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
#: Key suffixes exported in fp32 whatever ``--dtype`` says: HF keeps the router in fp32
#: (``DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict``; a bf16 correction bias would move the routing).
KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
#: HF DeepseekV3RMSNorm's eps inside DeepseekV3Attention (q_a_layernorm, kv_a_layernorm): fixed, not rms_norm_eps.
HF_LATENT_NORM_EPS = 1e-6
_ATTN = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_DENSE = {k: v for k, v in hf_llama._BLOCK_KEYS.items() if not k.startswith("attention.")}
_SHARED = SWIGLU_NAMES  # ours -> HF projection names
_BLOCK = {**_ATTN, **_DENSE, "moe.router.gate.weight": "mlp.gate.weight",
          "moe.router.expert_bias": "mlp.gate.e_score_correction_bias"}  # fmt: skip
_BLOCK_INV = {hf: ours for ours, hf in _BLOCK.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
#: Buffers ``model.init_from`` reads from the folder (canonical FQN suffixes): the router's correction bias moves the
#: routing, so it is loaded, not zeroed (:func:`kempnerforge.checkpoint.hf_load.load_hf_weights_`).
HF_BUFFERS = ("moe.router.expert_bias",)


def check_deepseek_v3_compatible(cfg: ModelConfig) -> None:
    """Refuse configs ``DeepseekV3ForCausalLM`` cannot represent.

    Raises:
        ValueError: naming the field: ``attention`` != 'mla', ``qk_norm``, ``norm_eps`` != 1e-6, and with MoE
            layers ``router`` != 'sigmoid', ``moe_frequency`` != 1, ``n_shared_experts`` == 0,
            ``shared_expert_gate``, ``capacity_factor`` != 0.
    """
    rules = [
        ("attention", cfg.attention == "mla", "'mla'"),
        ("qk_norm", not cfg.qk_norm, "False"),
        ("norm_eps", cfg.norm_eps == HF_LATENT_NORM_EPS, f"{HF_LATENT_NORM_EPS} (HF's latent norms hard-code it)"),
    ]
    if cfg.num_experts:
        rules += [
            ("router", cfg.router == "sigmoid", "'sigmoid'"),
            ("moe_frequency", cfg.moe_frequency == 1, "1 (use n_dense_layers)"),
            ("n_shared_experts", cfg.n_shared_experts >= 1, ">= 1"),
            ("shared_expert_gate", not cfg.shared_expert_gate, "False"),
            ("capacity_factor", cfg.capacity_factor == 0, "0"),
        ]
    for field, ok, allowed in rules:
        if not ok:
            raise ValueError(
                f"ModelConfig.{field}={getattr(cfg, field)!r} has no DeepseekV3ForCausalLM equivalent; allowed: {allowed}"
            )


check_compatible = check_deepseek_v3_compatible


def to_hf_config(cfg: ModelConfig):
    """The ``transformers.DeepseekV3Config`` for ``cfg`` (``rope_interleave=True``, no MTP layers).

    Raises:
        ValueError: see :func:`check_deepseek_v3_compatible`.
    """
    from transformers import DeepseekV3Config  # local import: transformers is slow to import

    check_deepseek_v3_compatible(cfg)
    moe = cfg.num_experts > 0
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden,
        moe_intermediate_size=cfg.expert_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        n_shared_experts=cfg.n_shared_experts if moe else 1,
        n_routed_experts=cfg.num_experts if moe else 1,
        routed_scaling_factor=cfg.route_scale,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.num_expert_groups,
        topk_group=cfg.num_limited_groups,
        num_experts_per_tok=cfg.top_k if moe else 1,
        first_k_dense_replace=cfg.n_dense_layers if moe else cfg.n_layers,
        norm_topk_prob=cfg.router_renormalize,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=hf_llama.hf_rope_parameters(cfg),
        rope_interleave=True,
        attention_bias=False,
        num_nextn_predict_layers=0,
    )


def from_hf_config(hf_cfg) -> ModelConfig:
    """Our :class:`ModelConfig` for a ``DeepseekV3Config``.

    Raises:
        ValueError: naming the field: ``quantization_config`` set, ``hidden_act`` != silu, ``attention_bias``,
            ``attention_dropout`` != 0, ``num_key_value_heads`` != ``num_attention_heads``, ``rms_norm_eps`` != 1e-6,
            ``n_shared_experts`` == 0 with MoE layers; a RoPE type other than default / llama3 / yarn
            (:func:`~kempnerforge.checkpoint.hf_llama.rope_from_hf`).
    """
    heads = hf_cfg.num_attention_heads
    checks = (
        ("quantization_config", getattr(hf_cfg, "quantization_config", None) is None, "none (dequantize first)"),
        ("hidden_act", hf_cfg.hidden_act == "silu", "'silu'"),
        ("attention_bias", not hf_cfg.attention_bias, "False"),
        ("attention_dropout", not hf_cfg.attention_dropout, "0"),
        ("num_key_value_heads", hf_cfg.num_key_value_heads in (None, heads), f"num_attention_heads={heads}"),
        ("rms_norm_eps", hf_cfg.rms_norm_eps == HF_LATENT_NORM_EPS, f"{HF_LATENT_NORM_EPS}"),
    )
    for field, ok, allowed in checks:
        if not ok:
            raise ValueError(
                f"DeepseekV3Config.{field}={getattr(hf_cfg, field)!r} is not supported; allowed: {allowed}"
            )
    theta, scaling = hf_llama.rope_from_hf(hf_cfg, "DeepseekV3Config")
    n_dense = hf_cfg.first_k_dense_replace or 0
    moe = n_dense < hf_cfg.num_hidden_layers
    fields = dict(
        dim=hf_cfg.hidden_size,
        n_layers=hf_cfg.num_hidden_layers,
        n_heads=heads,
        vocab_size=hf_cfg.vocab_size,
        max_seq_len=hf_cfg.max_position_embeddings,
        ffn_hidden_dim=hf_cfg.intermediate_size,
        norm_eps=hf_cfg.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
        attention="mla",
        q_lora_rank=hf_cfg.q_lora_rank or 0,
        kv_lora_rank=hf_cfg.kv_lora_rank,
        qk_nope_head_dim=hf_cfg.qk_nope_head_dim,
        qk_rope_head_dim=hf_cfg.qk_rope_head_dim,
        v_head_dim=hf_cfg.v_head_dim,
    )
    if moe:
        if not hf_cfg.n_shared_experts:
            raise ValueError("DeepseekV3Config.n_shared_experts=0 is not supported; allowed: >= 1")
        expert, dense = hf_cfg.moe_intermediate_size, hf_cfg.intermediate_size
        multiplier = expert / dense
        if int(dense * multiplier) != expert:  # float rounding: nudge up to the exact width
            multiplier = (expert + 0.5) / dense
        fields.update(
            num_experts=hf_cfg.n_routed_experts,
            top_k=hf_cfg.num_experts_per_tok,
            n_dense_layers=n_dense,
            num_expert_groups=hf_cfg.n_group or 1,
            num_limited_groups=hf_cfg.topk_group or 1,
            n_shared_experts=hf_cfg.n_shared_experts,
            expert_width_multiplier=multiplier,
            router="sigmoid",
            router_renormalize=bool(hf_cfg.norm_topk_prob),
            route_scale=float(hf_cfg.routed_scaling_factor),
        )
    return ModelConfig(**fields)


def check_hf_dir(hf_dir: str | Path, hf_cfg) -> None:
    """Refuse a checkpoint directory holding weights our model would drop: DeepSeek-V3's multi-token-prediction
    modules are stored as extra layers ``model.layers.{num_hidden_layers + j}`` (``from_pretrained`` skips them
    silently). Reads only the safetensors index or file headers.

    Raises:
        ValueError: naming ``num_nextn_predict_layers``.
    """
    root = Path(hf_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        keys = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        keys = []
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                keys += list(f.keys())
    extra = sorted({int(m.group(1)) for k in keys if (m := _HF_LAYER.match(k))} - set(range(hf_cfg.num_hidden_layers)))
    if extra:
        raise ValueError(
            f"DeepseekV3Config.num_nextn_predict_layers={getattr(hf_cfg, 'num_nextn_predict_layers', None)!r}: "
            f"{root} holds multi-token-prediction layers {extra} kempnerforge cannot represent; allowed: a "
            "checkpoint without them (drop model.layers.{num_hidden_layers}+ from the safetensors files)"
        )


def _rope_order(n: int) -> torch.Tensor:
    """Interleaved -> half-split RoPE channel order: [0, 2, 4, ..., 1, 3, 5, ...] of n channels."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


def _permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, key: str, inverse: bool) -> torch.Tensor:
    """Reorder the RoPE output rows of ``w`` (our key ``key``): interleaved -> half (import) or back (export)."""
    order = _rope_order(cfg.qk_rope_head_dim)
    if inverse:
        order = torch.argsort(order)
    rope = cfg.qk_rope_head_dim
    if key in ("attention.wq.weight", "attention.wq_b.weight"):
        qk = cfg.qk_nope_head_dim + rope
        heads = w.view(-1, qk, w.shape[-1])
        return torch.cat([heads[:, :-rope], heads[:, -rope:][:, order]], dim=1).reshape(w.shape)
    if key == "attention.wkv_a.weight":
        return torch.cat([w[:-rope], w[-rope:][order]])
    return w


def _rope_rows(cfg: ModelConfig, key: str) -> tuple[int, ...]:
    """``HFSource.rows`` of our key ``key``: the HF row of each of our rows (:func:`_permute_rope_rows` on import),
    a permutation inside each RoPE row group; empty (identity) for a key without RoPE rows."""
    nope, rope, order = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, _rope_order(cfg.qk_rope_head_dim).tolist()
    if key in ("attention.wq.weight", "attention.wq_b.weight"):
        qk = nope + rope
        return tuple(h * qk + r for h in range(cfg.n_heads) for r in (*range(nope), *(nope + o for o in order)))
    if key == "attention.wkv_a.weight":
        return (*range(cfg.kv_lora_rank), *(cfg.kv_lora_rank + o for o in order))
    return ()


def hf_source_options(hf_cfg) -> dict:
    """The extra :func:`hf_source` arguments a folder's ``DeepseekV3Config`` sets: ``rope_interleave``."""
    return {"rope_interleave": bool(getattr(hf_cfg, "rope_interleave", True))}


def hf_source(fqn: str, cfg: ModelConfig, disk_keys: set[str], rope_interleave: bool = True) -> HFSource:
    """Where our parameter (or :data:`HF_BUFFERS` buffer) ``fqn`` lies in a ``save_pretrained`` DeepSeek-V3 folder.

    - Attention: renames; with ``rope_interleave`` the RoPE output rows of ``wq`` / ``wq_b`` (each head's last
      ``qk_rope_head_dim`` rows) and ``wkv_a`` (its last ``qk_rope_head_dim`` rows) carry the import permutation as
      ``HFSource.rows``: a rank reads the rows it keeps plus at most the rest of a head's RoPE rows.
    - Dense first layers (``n_dense_layers``), norms, embedding, head: the Llama renames.
    - Router ``gate.weight`` and ``expert_bias`` (``e_score_correction_bias``, a buffer): renames.
    - Routed experts: per-expert ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (what transformers 5
      ``save_pretrained`` writes; a stack along our dim 0), or blocks of the packed ``gate_up_proj`` / ``down_proj``.
    - Shared expert ``s`` of width h: rows ``[s * h, (s + 1) * h)`` of the fused ``shared_experts.gate_proj`` /
      ``up_proj``, columns of ``down_proj``.

    Raises:
        KeyError: ``fqn`` has no DeepSeek-V3 name.
    """
    match = _OURS.match(fqn)
    if match is None or unfused_names(fqn) is not None:  # a fused dense-layer w13: HF's gate_proj / up_proj rows
        return hf_llama.hf_source(fqn, cfg, disk_keys)
    layer, name = match.groups()
    p, h = f"model.layers.{layer}", cfg.expert_hidden
    if name in _BLOCK:
        return HFSource((f"{p}.{_BLOCK[name]}",), rows=_rope_rows(cfg, name) if rope_interleave else ())
    shared = re.fullmatch(r"moe\.shared_experts\.(\d+)\.(w[123])\.weight", name)
    if shared is not None:
        return shared_expert_source(f"{p}.mlp.shared_experts.{{}}.weight", shared.group(2), int(shared.group(1)), h)
    routed = re.fullmatch(r"moe\.experts\.(w[123])", name)
    if routed is None:
        raise KeyError(f"{fqn!r} has no DeepseekV3ForCausalLM counterpart")
    return routed_experts_source(f"{p}.mlp.experts", routed.group(1), cfg.num_experts, h, disk_keys)


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under ``DeepseekV3ForCausalLM`` keys (RoPE rows in the interleaved layout, experts packed).

    Raises:
        ValueError: see :func:`check_deepseek_v3_compatible`.
        KeyError: naming a key with no DeepSeek-V3 counterpart.
    """
    check_deepseek_v3_compatible(cfg)
    sd = split_state_dict(sd, cfg)  # a fused dense-layer w13 -> gate_proj / up_proj (kempnerforge.model.fused)
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        if key in hf_llama._TOP_KEYS:
            if not (key == "output.weight" and cfg.tie_embeddings):
                out[hf_llama._TOP_KEYS[key]] = value
            continue
        match = _OURS.match(key)
        if match is None:
            raise KeyError(f"to_hf_state_dict: no DeepSeek-V3 name for key {key!r}")
        layer, name = match.groups()
        if name in _BLOCK:
            out[f"model.layers.{layer}.{_BLOCK[name]}"] = _permute_rope_rows(value, cfg, name, inverse=True)
        elif name.startswith(("moe.experts.", "moe.shared_experts.")):
            experts.setdefault(layer, {})[name] = value
        else:
            raise KeyError(f"to_hf_state_dict: no DeepSeek-V3 name for key {key!r}")
    for layer, w in experts.items():
        p = f"model.layers.{layer}.mlp"
        out[f"{p}.experts.gate_up_proj"] = torch.cat([w.pop("moe.experts.w1"), w.pop("moe.experts.w3")], dim=1)
        out[f"{p}.experts.down_proj"] = w.pop("moe.experts.w2")
        for ours, hf in _SHARED.items():
            parts = [w.pop(f"moe.shared_experts.{s}.{ours}.weight") for s in range(cfg.n_shared_experts)]
            out[f"{p}.shared_experts.{hf}.weight"] = torch.cat(parts, dim=1 if ours == "w2" else 0)
        if w:
            raise KeyError(f"to_hf_state_dict: no DeepSeek-V3 name for layers.{layer} keys {sorted(w)}")
    return out


def from_hf_state_dict(
    sd: Mapping[str, torch.Tensor], cfg: ModelConfig, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """``DeepseekV3ForCausalLM`` state dict (transformers 5 in-memory layout) under our keys; loads with
    ``Transformer(cfg).load_state_dict(..., strict=True)``.

    Args:
        sd: the HF model's ``state_dict()``.
        cfg: the matching config (:func:`from_hf_config`).
        rope_interleave: the HF config's ``rope_interleave`` (True: permute the RoPE rows to the half layout).

    Raises:
        ValueError: see :func:`check_deepseek_v3_compatible`.
        KeyError: naming an HF key with no counterpart (or a layer >= n_layers).
    """
    check_deepseek_v3_compatible(cfg)
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if hf_llama._HF_IGNORED.match(key):
            continue
        if key in hf_llama._TOP_KEYS_INV:
            if not (key == "lm_head.weight" and cfg.tie_embeddings):
                out[hf_llama._TOP_KEYS_INV[key]] = value
            continue
        match = _HF.match(key)
        if match is None or int(match.group(1)) >= cfg.n_layers:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {key!r} (n_layers={cfg.n_layers})")
        layer, name = match.groups()
        prefix = f"layers.{layer}"
        if name in _BLOCK_INV:
            ours = _BLOCK_INV[name]
            out[f"{prefix}.{ours}"] = _permute_rope_rows(value, cfg, ours, inverse=False) if rope_interleave else value
        elif name == "mlp.experts.gate_up_proj":
            out[f"{prefix}.moe.experts.w1"], out[f"{prefix}.moe.experts.w3"] = value.chunk(2, dim=1)
        elif name == "mlp.experts.down_proj":
            out[f"{prefix}.moe.experts.w2"] = value
        elif (
            name.startswith("mlp.shared_experts.")
            and name.removeprefix("mlp.shared_experts.").removesuffix(".weight") in _SHARED.values()
        ):
            hf = name.removeprefix("mlp.shared_experts.").removesuffix(".weight")
            ours = next(o for o, h in _SHARED.items() if h == hf)
            for s, part in enumerate(value.chunk(cfg.n_shared_experts, dim=1 if ours == "w2" else 0)):
                out[f"{prefix}.moe.shared_experts.{s}.{ours}.weight"] = part
        else:
            raise KeyError(f"from_hf_state_dict: no kempnerforge name for HF key {key!r}")
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return join_state_dict(out, cfg)
