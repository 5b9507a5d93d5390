"""Tiny VLM configs shared by the VLM unit, distributed and e2e tests (CPU-sized: dims 32-64, 2 layers)."""

from __future__ import annotations

from pathlib import Path

from kempnerforge.config import ModelConfig
from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "data" / "images"  # bundled copy of ../shared/data/images (CI clones lack ../shared)
IMAGE_PARQUET = REPO / "data" / "hf" / "image_text" / "train.parquet"
GPT2 = REPO / "data" / "tokenizers" / "gpt2"


def tiny_text(vocab_size: int = 128, max_seq_len: int = 64, tie: bool = False) -> ModelConfig:
    """A 2-layer GQA decoder, dim 32."""
    return ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, max_seq_len=max_seq_len,
        multiple_of=32, rope_theta=10000.0, tie_embeddings=tie,
    )  # fmt: skip


#: DeepSeek-V3's attention at the tiny width: multi-head latent attention with a query latent (MLA heads are n_heads).
MLA = dict(attention="mla", n_kv_heads=None, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)  # fmt: skip


def tiny_mla_moe_text(**kw) -> ModelConfig:
    """``tiny_text`` with :data:`MLA` and MoE blocks (4 experts, top-2, a shared expert); ``kw`` overrides
    (``num_experts=0``: MLA alone)."""
    return ModelConfig(**{**tiny_text().__dict__, **MLA, "num_experts": 4, "top_k": 2, "n_shared_experts": 1, **kw})


def tiny_encoder(family: str = "siglip", image_size: int = 32, patch_size: int = 8) -> VisionEncoderConfig:
    """A 2-layer random vision tower, width 32 (a 4x4 patch grid at 32 px / 8 px patches)."""
    return VisionEncoderConfig(
        family=family, image_size=image_size, patch_size=patch_size, hidden_size=32, n_layers=2, n_heads=2,
        intermediate_size=64,
    )  # fmt: skip


def tiny_vlm(arch: str, **kw) -> VLMConfig:
    """``VLMConfig`` for ``arch`` with small MoMa groups (cross-attention every layer by default)."""
    return VLMConfig(arch=arch, cross_attn_every=kw.pop("cross_attn_every", 1), moma_experts_per_modality=2, **kw)


def tiny_connector(type: str = "mlp2") -> ConnectorConfig:
    """A connector of ``type`` (avg_pool 2x2, attn_pool 4 queries)."""
    return ConnectorConfig(type=type, pool_size=2, n_queries=4, n_heads=2)
