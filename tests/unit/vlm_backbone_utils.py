"""Helpers shared by the MoT / MoMa backbone tests: a tiny text config, random VLM inputs, and the dense
Transformer run on the joint ``[visual; text]`` sequence (the oracle of the warm-start tests)."""

from __future__ import annotations

import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.rope import pack_rope


def tiny_text_config(**overrides) -> ModelConfig:
    """dim 32, 2 layers, 4 query / 2 KV heads (GQA), vocab 64, SwiGLU hidden 48."""
    fields = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
                  ffn_hidden_dim=48, rope_theta=10000.0)  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


def random_inputs(cfg: ModelConfig, batch: int = 3, n_visual: int = 5, n_text: int = 7, seed: int = 0):
    """``(input_ids (batch, n_text), visual (batch, n_visual, dim))`` from a private generator."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, n_text), generator=gen)
    visual = torch.randn(batch, n_visual, cfg.dim, generator=gen)
    return ids, visual


def dense_joint_logits(
    dense: Transformer, ids: torch.Tensor, visual: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The dense text model fed ``[visual; embed(ids)]``: text-position logits (batch, n_text, vocab)."""
    h = torch.cat([visual, dense.tok_embeddings(ids)], dim=1)
    seq = h.shape[1]
    for layer in dense.layers.values():
        h = layer(h, pack_rope(dense.rope_cos[:seq], dense.rope_sin[:seq]), key_mask)
    return dense.output(dense.norm(h[:, visual.shape[1] :]))


def padding_masks(batch: int, n_visual: int, n_text: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(text_mask, visual_mask)``: sample 0 unpadded; sample i > 0 has its last i text and last i
    visual positions padded."""
    text_mask = torch.ones(batch, n_text, dtype=torch.bool)
    visual_mask = torch.ones(batch, n_visual, dtype=torch.bool)
    for i in range(1, batch):
        text_mask[i, n_text - i :] = False
        visual_mask[i, n_visual - i :] = False
    return text_mask, visual_mask


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients by canonical FQN (wrapper parts dropped)."""
    from kempnerforge.model.init import canonical_fqn

    return {canonical_fqn(n): p.grad.clone() for n, p in model.named_parameters()}
