"""Model building blocks: the Llama-3 style decoder and its parts."""

from kempnerforge.model.attention import Attention
from kempnerforge.model.init import (
    canonical_fqn,
    copy_full_,
    normal_init_,
    param_seed,
    trunc_normal_init_,
    uniform_init_,
)
from kempnerforge.model.mlp import FeedForward
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.rope import apply_rope, rope_tables, rotate_half
from kempnerforge.model.transformer import Transformer, TransformerBlock

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "canonical_fqn",
    "copy_full_",
    "normal_init_",
    "param_seed",
    "rope_tables",
    "rotate_half",
    "trunc_normal_init_",
    "uniform_init_",
]
