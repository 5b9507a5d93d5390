"""Other projects' models at our shape, loaded with our weights: what the benchmarks compare against.

Shared by ``cpu_throughput.py`` and ``gpu_mfu.py``. Every builder takes a ``ModelConfig`` and maps our state
dict (``Transformer(cfg).state_dict()``) onto the other model so that the same weights give the same
function; the benchmarks check it with the per-step loss difference.

torchtitan is not in the ``bench`` extra (its metadata pins ``datasets<4.8``, which would downgrade ours):
``pip install --no-deps "torchtitan>=0.3,<0.4" spmd_types torch_checkpointing tyro typeguard`` (plus
``triton`` on a CPU-only torch: torchtitan 0.3 imports it unconditionally).
"""

from __future__ import annotations

import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model.fused import FUSED_QKV, FUSED_W13, split_state_dict


def torchtitan_config(cfg: ModelConfig):
    """A ``Llama3Model.Config`` with ``cfg``'s shape: fused ``wqkv``, rotate-half RoPE (``CosSinRoPE``,
    no frequency scaling) and plain causal SDPA, so the same weights give the same function as ours.

    Raises:
        ImportError: torchtitan (0.3 layout) is not importable.
    """
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    # Weights come from ours (load_state_dict), so torchtitan's own init functions are not needed.
    keep = {"weight": lambda t: None}
    rope = CosSinRoPE.Config(dim=cfg.head_dim_resolved, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)

    def norm():
        return RMSNorm.Config(normalized_shape=cfg.dim, eps=cfg.norm_eps, param_init=keep)

    block = {
        "attention_norm": norm(),
        "ffn_norm": norm(),
        "attention": make_gqa_config(
            dim=cfg.dim,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads_resolved,
            wqkv_param_init=keep,
            wo_param_init=keep,
            inner_attention=ScaledDotProductAttention.Config(),
            fuse_qkv=True,
            rope=rope,
        ),
        "feed_forward": make_ffn_config(
            dim=cfg.dim, hidden_dim=cfg.ffn_hidden, w1_param_init=keep, w2w3_param_init=keep
        ),
    }
    return Llama3Model.Config(
        dim=cfg.dim,
        vocab_size=cfg.vocab_size,
        enable_weight_tying=cfg.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=keep),
        norm=norm(),
        lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=keep),
        layers=[Llama3TransformerBlock.Config(**block) for _ in range(cfg.n_layers)],
    )


def to_torchtitan_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Our keys -> ``Llama3Model`` keys: a rename (its state dict exposes the fused ``wqkv`` as
    ``qkv_linear.wq/wk/wv``, and its RoPE is rotate-half as ours, so no permutation). Our state dict may be in
    either layout: fused ``wqkv`` / ``w13`` (the default) are first split with ``cfg``
    (:func:`kempnerforge.model.fused.split_state_dict`; copies).

    Raises:
        ValueError: ``sd`` has a fused key and no ``cfg`` was given.
    """
    if cfg is not None:
        sd = split_state_dict(sd, cfg)
    elif fused := next((k for k in sd if FUSED_QKV.match(k) or FUSED_W13.match(k)), None):
        raise ValueError(f"to_torchtitan_state_dict: {fused!r} is fused; pass the ModelConfig to split it")
    out = {}
    for key, value in sd.items():
        for proj in ("wq", "wk", "wv"):
            key = key.replace(f".attention.{proj}.", f".attention.qkv_linear.{proj}.")
        out[key.replace("output.", "lm_head.", 1) if key.startswith("output.") else key] = value
    return out
