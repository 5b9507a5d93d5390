"""ModelConfig validation: every rule raises a ValueError naming the field and the allowed values."""

from __future__ import annotations

import dataclasses

import pytest

from kempnerforge.config import ModelConfig


@pytest.mark.parametrize("field", ["dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"])
@pytest.mark.parametrize("value", [0, -4])
def test_required_sizes_must_be_positive(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}={value} must be a positive integer$"):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("field", ["n_kv_heads", "ffn_hidden_dim"])
def test_optional_sizes_must_be_positive_or_none(field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}=0 must be a positive integer or None"):
        ModelConfig(**{field: 0})


def test_sizes_must_be_integers():
    with pytest.raises(ValueError, match=r"ModelConfig\.dim=256\.0 must be a positive integer"):
        ModelConfig(dim=256.0)
    with pytest.raises(ValueError, match=r"ModelConfig\.n_layers=True must be a positive integer"):
        ModelConfig(n_layers=True)


@pytest.mark.parametrize("field", ["init_std", "norm_eps", "rope_theta", "ffn_dim_multiplier"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_positive_floats(field, value):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}={value} must be a positive number \(> 0\)"):
        ModelConfig(**{field: value})


def test_dim_divisible_by_n_heads():
    msg = r"ModelConfig\.dim=250 must be divisible by n_heads=8 \(head_dim = dim / n_heads\); got remainder 2"
    with pytest.raises(ValueError, match=msg):
        ModelConfig(dim=250, n_heads=8)


def test_n_heads_divisible_by_n_kv_heads():
    msg = r"ModelConfig\.n_kv_heads=3 must divide n_heads=8 .*allowed: \[1, 2, 4, 8\]"
    with pytest.raises(ValueError, match=msg):
        ModelConfig(n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"n_kv_heads=16 must divide n_heads=8"):
        ModelConfig(n_heads=8, n_kv_heads=16)


def test_head_dim_must_be_even():
    with pytest.raises(ValueError, match=r"head_dim = dim / n_heads = 72 / 8 = 9 must be even"):
        ModelConfig(dim=72, n_heads=8)


def test_defaults_are_valid_and_round_trip():
    cfg = ModelConfig()
    assert cfg.n_kv_heads is None and cfg.n_kv_heads_resolved == cfg.n_heads == 8
    assert cfg.head_dim is None and cfg.head_dim_resolved == 32
    # None stays None: dataclasses.asdict / replace reproduce the same config.
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg


def test_flops_per_token_rejects_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        ModelConfig().flops_per_token(0)


def test_model_config_has_every_field_moe_validation_reads():
    # config/moe.py types its argument by the MoEFields protocol instead of importing ModelConfig
    # (no import circle); a field renamed in one place only would slip past the type checker's users.
    from kempnerforge.config.moe import MoEFields

    cfg = ModelConfig(num_experts=4, top_k=2)
    needed = set(MoEFields.__annotations__) | {"ffn_hidden", "expert_hidden"}
    assert all(hasattr(cfg, name) for name in needed), sorted(n for n in needed if not hasattr(cfg, n))


def test_explicit_head_dim_and_attention_bias():
    """head_dim None resolves to dim / n_heads; an explicit one frees dim from n_heads (Qwen 3); each refusal names
    its field."""
    assert ModelConfig(dim=64, n_heads=4).head_dim_resolved == 16
    cfg = ModelConfig(dim=48, n_heads=4, head_dim=32, attention_bias=True)  # 48 % 4 == 0 but 4 * 32 != 48
    assert cfg.head_dim_resolved == 32 and ModelConfig(dim=50, n_heads=4, head_dim=16).head_dim_resolved == 16
    # An unset head_dim follows dim and n_heads through dataclasses.replace (the CLI builds configs over the
    # default instance's values: a stored resolved width once gave every recipe the default's 256 / 8 = 32).
    wide = dataclasses.replace(ModelConfig(), dim=4096, n_heads=32)
    assert wide.head_dim is None and wide.head_dim_resolved == 128
    for kw, match in [({"head_dim": 15}, r"ModelConfig\.head_dim=15 must be even"),
                      ({"head_dim": 0}, r"ModelConfig\.head_dim=0 must be a positive even integer or None"),
                      ({"dim": 50}, r"ModelConfig\.dim=50 must be divisible by n_heads=4"),
                      ({"attention_bias": 1}, r"ModelConfig\.attention_bias=1 must be True or False")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            ModelConfig(**{"dim": 64, "n_heads": 4, **kw})
