"""RoPE scaling (``ModelConfig.rope_scaling``: llama3, yarn) against transformers' own RoPE code."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kempnerforge.checkpoint.load import model_config_from_meta
from kempnerforge.config import ModelConfig
from kempnerforge.config.rope import RopeScaling
from kempnerforge.model.rope import model_rope_tables, rope_inv_freq

SCALINGS = [
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    RopeScaling("llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=8),
    RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
    RopeScaling("yarn", factor=40.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.707),
    RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=16.0, beta_slow=2.0, truncate=False),
    RopeScaling("yarn", factor=2.0, original_max_position_embeddings=16, attention_factor=1.3),
]


def hf_rope_parameters(scaling: RopeScaling, theta: float) -> dict:
    used = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}.get(
        scaling.rope_type, ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                            "mscale_all_dim", "attention_factor", "truncate"))  # fmt: skip
    params = {k: getattr(scaling, k) for k in used if getattr(scaling, k) is not None}
    return {"rope_type": scaling.rope_type, "rope_theta": theta, **params}


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{s.rope_type}-{s.factor}")
def test_tables_bitwise_equal_transformers(scaling):
    """Inverse frequencies, attention factor and the rotary embedding's cos/sin (which carry yarn's factor)
    equal transformers' exactly, at positions well past original_max_position_embeddings."""
    hf_cfg = transformers.LlamaConfig(hidden_size=96, num_attention_heads=3, head_dim=32, max_position_embeddings=64,
                                      rope_parameters=hf_rope_parameters(scaling, 10000.0))  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling.rope_type](hf_cfg, "cpu")
    ours, our_factor = rope_inv_freq(32, 10000.0, scaling)
    assert torch.equal(ours, inv_freq) and our_factor == factor
    cfg = ModelConfig(dim=96, n_heads=3, vocab_size=16, max_seq_len=64, rope_theta=10000.0, rope_scaling=scaling)
    cos, sin = model_rope_tables(cfg)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(64)[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    plain = model_rope_tables(ModelConfig(dim=96, n_heads=3, vocab_size=16, max_seq_len=64, rope_theta=10000.0))
    assert not torch.equal(cos, plain[0])  # the scaling changed the tables


def test_rope_scaling_dict_round_trip_through_checkpoint_meta():
    """``asdict`` (checkpoint hyperparameters, model.yaml) gives a dict; the loader rebuilds the dataclass."""
    cfg = ModelConfig(dim=64, n_heads=2, vocab_size=16, max_seq_len=64, rope_scaling=SCALINGS[3])
    back = model_config_from_meta({"hyper_parameters": {"config": asdict(cfg)}}, Path("x"))
    assert back == cfg and isinstance(back.rope_scaling, RopeScaling)


def test_rope_scaling_parses_from_the_command_line():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ModelConfig, "config")
    args = parser.parse_args(["--config.rope_scaling.rope_type=yarn", "--config.rope_scaling.factor=4",
                              "--config.rope_scaling.original_max_position_embeddings=1024"])  # fmt: skip
    cfg = parser.instantiate(args).config
    assert cfg.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=1024)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rope_type": "linear"}, r"rope_scaling\.rope_type='linear'"),
        ({"factor": 0.5}, r"rope_scaling\.factor=0\.5 must be a number >= 1"),
        ({"original_max_position_embeddings": 0}, r"rope_scaling\.original_max_position_embeddings=0"),
        ({"low_freq_factor": 4.0, "high_freq_factor": 4.0}, r"rope_scaling\.high_freq_factor=4\.0 must be >"),
        ({"mscale": 1.0}, r"rope_scaling\.mscale=1\.0 is not used by rope_type='llama3'"),
        ({"rope_type": "yarn", "low_freq_factor": 2.0}, r"rope_scaling\.low_freq_factor=2\.0 is not used"),
        ({"rope_type": "yarn", "beta_fast": -1.0}, r"rope_scaling\.beta_fast=-1\.0 must be a positive"),
    ],
)
def test_rope_scaling_validation_names_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(dim=64, n_heads=2, vocab_size=16, max_seq_len=64, rope_scaling=fields)
    with pytest.raises(ValueError, match=r"unknown fields \['scale'\]"):
        ModelConfig(dim=64, n_heads=2, vocab_size=16, max_seq_len=64, rope_scaling={"scale": 2.0})
