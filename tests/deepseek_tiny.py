"""A tiny random-weight HF ``DeepseekV3ForCausalLM`` built with transformers' own ``DeepseekV3Config`` and a
character-level tokenizer of the bundled tiny-shakespeare text (vocab < 128), shared by the DeepSeek-V3 tests.

MLA with a query latent and interleaved RoPE, 1 dense + 2 MoE layers, group-limited (4 groups, 2 allowed) sigmoid
routing with a random correction bias, routed scaling 2.5, one shared expert; weights drawn large enough that
routing, RoPE and every norm matter.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAKESPEARE = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare" / "input.txt"

HF_KW = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=64, rope_interleave=True, eos_token_id=1, pad_token_id=0)  # fmt: skip


def char_tokenizer(path: Path) -> None:
    """Save a character-level ``PreTrainedTokenizerFast`` (``<pad>`` 0, ``<eos>`` 1, every character of the
    tiny-shakespeare text) into ``path``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models

    chars = sorted(set(SHAKESPEARE.read_text()))
    vocab = {"<pad>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(chars)}
    assert len(vocab) <= HF_KW["vocab_size"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)


#: DeepSeek-V3's long-context RoPE at this scale: yarn x4 over 16 original positions, attention factor
#: mscale / mscale_all_dim != 1 on cos/sin and yarn_get_mscale(4, mscale_all_dim)^2 on the softmax scale.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}  # fmt: skip


def save_tiny_deepseek_v3(path: Path, seed: int = 0, **overrides) -> Path:
    """``save_pretrained`` a random-weight tiny DeepseekV3ForCausalLM (``HF_KW`` updated with ``overrides``) and
    the character tokenizer into ``path``."""
    import transformers

    torch.manual_seed(seed)
    kw = {**HF_KW, **overrides}
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if p.ndim == 1 else 0.15 * noise)
        for layer in model.model.layers[kw["first_k_dense_replace"] :]:  # the MoE layers
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
    model.save_pretrained(path)
    char_tokenizer(path)
    return path
