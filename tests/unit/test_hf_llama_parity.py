"""Logit parity with HF ``LlamaForCausalLM`` and key-mapping round trips."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.checkpoint.hf_llama import (
    from_hf_config,
    from_hf_state_dict,
    to_hf_config,
    to_hf_state_dict,
)
from kempnerforge.config import ModelConfig
from kempnerforge.model import RMSNorm, Transformer

transformers = pytest.importorskip("transformers")


def _cfg(n_kv_heads: int | None, tie: bool, **kw) -> ModelConfig:
    return ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=256, max_seq_len=32,
        multiple_of=32, tie_embeddings=tie, **kw,
    )  # fmt: skip


UNFUSED = dict(fuse_qkv=False, fuse_w13=False)  # our keys rename 1:1 to HF's (no copies, no cfg needed)


def _random_model(cfg: ModelConfig, seed: int = 7) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from ones so a wrong norm mapping would show
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=gen))
    return model.eval()


def _hf_model(cfg: ModelConfig, sd: dict[str, torch.Tensor]):
    hf = transformers.LlamaForCausalLM._from_config(to_hf_config(cfg), attn_implementation="eager")
    hf_sd = to_hf_state_dict(sd, cfg)
    result = hf.load_state_dict(hf_sd, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if cfg.tie_embeddings else [])
    if cfg.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    return hf.float().eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_logits_match_hf(n_kv_heads, tie):
    cfg = _cfg(n_kv_heads, tie)
    model = _random_model(cfg)
    hf = _hf_model(cfg, model.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    assert ours.shape == theirs.shape == (2, 16, cfg.vocab_size)
    assert ours.abs().max() > 0.1  # not a trivially zero comparison
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_state_dict_round_trip(tie):
    cfg = _cfg(2, tie, **UNFUSED)
    sd = _random_model(cfg).state_dict()
    hf_sd = to_hf_state_dict(sd, cfg)
    assert ("lm_head.weight" in hf_sd) is (not tie)
    assert hf_sd["model.layers.1.self_attn.k_proj.weight"] is sd["layers.1.attention.wk.weight"]
    back = from_hf_state_dict(hf_sd, cfg)
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        assert torch.equal(back[key], value), key
    # Without a config, tying is inferred from tensor identity of the live state dict.
    assert to_hf_state_dict(sd).keys() == hf_sd.keys()


def test_from_hf_accepts_hf_state_dict_and_loads_strict():
    cfg = _cfg(2, True)
    hf = _hf_model(cfg, _random_model(cfg).state_dict())
    hf_sd = dict(hf.state_dict())
    hf_sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old-checkpoint buffer
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state_dict(hf_sd, cfg), strict=True)
    assert torch.equal(model.tok_embeddings.weight, hf.model.embed_tokens.weight)


def test_unknown_and_missing_keys_raise():
    cfg = _cfg(None, False)
    sd = _random_model(cfg).state_dict()
    with pytest.raises(KeyError, match="'layers.0.attention.wqkv.weight' is a fused projection: pass cfg"):
        to_hf_state_dict(sd)  # the default fused layout cannot be split without the config
    plain = _random_model(_cfg(None, False, **UNFUSED)).state_dict()
    with pytest.raises(KeyError, match="layers.0.attention.bogus.weight"):
        to_hf_state_dict({**plain, "layers.0.attention.bogus.weight": torch.zeros(1)})
    hf_sd = to_hf_state_dict(sd, cfg)
    with pytest.raises(KeyError, match="model.layers.2.mlp.up_proj.weight"):
        from_hf_state_dict({**hf_sd, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, cfg)
    del hf_sd["model.norm.weight"]
    with pytest.raises(KeyError, match="norm.weight"):
        from_hf_state_dict(hf_sd, cfg)


def test_config_round_trip_and_fields():
    cfg = _cfg(2, True)
    hf_cfg = to_hf_config(cfg)
    assert hf_cfg.intermediate_size == cfg.ffn_hidden == 192
    assert hf_cfg.num_key_value_heads == 2 and hf_cfg.head_dim == 16
    assert hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf_cfg.rms_norm_eps == cfg.norm_eps and hf_cfg.tie_word_embeddings is True
    back = from_hf_config(hf_cfg)
    assert back.num_params() == cfg.num_params()
    assert (back.dim, back.n_kv_heads, back.ffn_hidden, back.rope_theta) == (64, 2, 192, cfg.rope_theta)


def test_qk_norm_bias_and_other_rope_types_refused():
    with pytest.raises(ValueError, match="qk_norm"):
        to_hf_config(ModelConfig(dim=64, n_heads=4, vocab_size=256, qk_norm=True))
    with pytest.raises(ValueError, match="attention_bias=True has no HF LlamaForCausalLM"):
        to_hf_config(ModelConfig(dim=64, n_heads=4, vocab_size=256, attention_bias=True))
    hf_cfg = to_hf_config(_cfg(None, False))
    hf_cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0}
    with pytest.raises(ValueError, match=r"LlamaConfig\.rope_parameters\.rope_type='dynamic'"):
        from_hf_config(hf_cfg)
    hf_cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    with pytest.raises(ValueError, match="original_max_position_embeddings is missing"):
        from_hf_config(hf_cfg)
    hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"LlamaConfig\.partial_rotary_factor=0\.5"):
        from_hf_config(hf_cfg)
