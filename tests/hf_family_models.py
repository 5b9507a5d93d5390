"""Tiny random-weight transformers models of the families issue 20 converts, built with transformers' own config classes.

Shared by tests/unit/test_hf_families.py (logits, round trip, generate) and the distributed parity script.
Weights are transformers' init at ``initializer_range=0.1`` with the parts it initializes to constants (q/k/v
biases zero, norm gains one, Qwen3-MoE's router zero) redrawn, so every converted tensor carries information.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, MAX_POS, ORIGINAL_MAX_POS = 512, 64, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=MAX_POS, initializer_range=0.1, rms_norm_eps=1e-6,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip

#: family name -> (transformers config class name, its keyword arguments).
FAMILIES = {
    # Llama 3.1: llama3 RoPE scaling over an original context of 16 (prompts reach position 63).
    "llama31": ("LlamaConfig", dict(**_COMMON, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_MAX_POS})),
    # Qwen 2.5: q/k/v biases, tied embeddings (as the 0.5B-3B models).
    "qwen2": ("Qwen2Config", dict(**_COMMON, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen 3: QK-norm, head_dim 32 with 4 heads on width 64 (n_heads * head_dim != dim), YaRN.
    "qwen3": ("Qwen3Config", dict(**_COMMON, head_dim=32, tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX_POS})),
    # Qwen3-MoE: layer 0 dense, layer 1 MoE (decoder_sparse_step 2), 4 experts top-2 renormalized.
    "qwen3_moe": ("Qwen3MoeConfig", dict(**_COMMON, head_dim=16, tie_word_embeddings=False, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                                         norm_topk_prob=True, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})),
    # Qwen1.5/2-MoE with q/k/v biases (qkv_bias, as the released checkpoints) and a gated shared expert of 2 widths.
    "qwen2_moe": ("Qwen2MoeConfig", dict(**_COMMON, qkv_bias=True, tie_word_embeddings=False, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, norm_topk_prob=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}  # fmt: skip
#: The families of issue 20's checks (the distributed and generate checks run these).
ISSUE_FAMILIES = ("llama31", "qwen2", "qwen3", "qwen3_moe")


def hf_config(family: str, **over):
    """The transformers config of ``family`` (see :data:`FAMILIES`), with ``over`` applied."""
    import transformers

    name, kwargs = FAMILIES[family]
    return getattr(transformers, name)(**{**kwargs, **over})


def build_hf_model(family: str, seed: int = 0, **over):
    """A random-weight transformers model of ``family`` in fp32, eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **over), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith(".bias") or name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def save_hf_model(family: str, path: Path, seed: int = 0, **over) -> Path:
    """``build_hf_model`` written with ``save_pretrained`` to ``path``; returns ``path``."""
    build_hf_model(family, seed, **over).save_pretrained(path)
    return path


def prompts(lengths=(7, 29, MAX_POS), seed: int = 3) -> list[torch.Tensor]:
    """Token prompts (1, length) of the given lengths (the longest reaches position MAX_POS - 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
