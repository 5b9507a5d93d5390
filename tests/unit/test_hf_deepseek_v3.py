"""Issue 20 checks 1 and 5 for DeepSeek-V3: a random-weight ``DeepseekV3ForCausalLM`` built with transformers' own
``DeepseekV3Config`` (MLA with a query latent, interleaved RoPE, 1 dense + 2 MoE layers, group-limited sigmoid
routing with a correction bias, routed scaling, a shared expert), saved with ``save_pretrained``:

1. ``kforge convert hf-to-dcp`` -> logits equal HF's within 1e-5 (fp32) on 3 prompts of different lengths; HF ->
   kforge -> HF (``kforge convert dcp-to-hf``) writes bit-identical tensors, every one of the saved files.
5. ``kforge generate`` greedy == ``transformers`` greedy ``generate`` for 20 tokens.

Plus the refusals (MTP weights on disk, FP8 checkpoints, other activations, ...) and the routing fields' validation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kempnerforge.checkpoint import hf_deepseek_v3
from kempnerforge.checkpoint.convert import dcp_to_hf, hf_family, model_config_from_hf
from kempnerforge.checkpoint.load import load_checkpoint_model
from kempnerforge.cli import main
from kempnerforge.config import ModelConfig
from kempnerforge.model.generate import SamplingConfig, generate
from tests.deepseek_tiny import HF_KW, YARN, save_tiny_deepseek_v3

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek") / "hf")


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deepseek_dcp")
    main(["convert", "hf-to-dcp", "--hf_dir", str(hf_dir), "--output_dir", str(out)])
    return out


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def test_imported_config(imported):
    cfg = load_checkpoint_model(imported).config
    assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == ("mla", 16, 24, 8)
    assert (cfg.num_experts, cfg.n_dense_layers, cfg.num_expert_groups, cfg.num_limited_groups) == (8, 1, 4, 2)
    assert (cfg.router, cfg.route_scale, cfg.n_shared_experts, cfg.expert_hidden) == ("sigmoid", 2.5, 1, 32)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_logits_match_hf_on_three_prompt_lengths(hf_dir, imported):
    ours, hf = load_checkpoint_model(imported).model, _hf(hf_dir)
    gen = torch.Generator().manual_seed(2)
    for length in (5, 17, 40):
        tokens = torch.randint(0, 128, (1, length), generator=gen)
        with torch.no_grad():
            a, b = ours(tokens), hf(input_ids=tokens).logits
        assert a.abs().max() > 1.0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    bias = ours.layers["1"].moe.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)


def test_round_trip_hf_kforge_hf_is_bit_exact(hf_dir, imported, tmp_path):
    from safetensors.torch import load_file

    main(["convert", "dcp-to-hf", "--ckpt", str(imported), "--output_dir", str(tmp_path / "back"),
          "--tokenizer", str(hf_dir)])  # fmt: skip
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back) and len(original) == 91  # per-expert keys, as save_pretrained writes
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["rope_interleave"] is True
    assert config["num_nextn_predict_layers"] == 0


def test_kforge_generate_equals_transformers_greedy(hf_dir, imported, capsys):
    hf = _hf(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    prompt = "ROMEO: what"
    ids = torch.tensor([tok.encode(prompt)])
    hf.generation_config.eos_token_id = None  # 20 tokens whatever they are (ours: --ignore_eos)
    expected = hf.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    assert expected.numel() == 20 and expected.unique().numel() > 3
    ours = load_checkpoint_model(imported).model
    got = generate(ours, ids, sampling=SamplingConfig(max_new_tokens=20))
    assert got.row(0) == expected.tolist()
    capsys.readouterr()
    main(["generate", "--ckpt", str(imported), "--tokenizer", str(hf_dir), "--prompt", prompt,
          "--max_new_tokens", "20", "--ignore_eos", "--device", "cpu"])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"--- [0] {prompt}{tok.decode(expected)}" in printed


def test_yarn_deepseek_v3_logits_generation_and_round_trip(tmp_path):
    """YaRN RoPE scaling as DeepSeek-V3 uses it (mscale / mscale_all_dim on cos/sin, mscale_all_dim^2 on the softmax
    scale): logits at positions past original_max_position_embeddings, 20 greedy tokens over the latent cache, and
    a bit-exact round trip of every tensor and of rope_parameters."""
    from safetensors.torch import load_file

    from kempnerforge.checkpoint.convert import hf_to_dcp
    from kempnerforge.model.mla import mla_softmax_scale
    from kempnerforge.model.rope import yarn_get_mscale

    hf_dir = save_tiny_deepseek_v3(tmp_path / "hf", seed=5, rope_parameters=YARN)
    loaded = load_checkpoint_model(hf_to_dcp(hf_dir, tmp_path / "dcp"))
    ours, cfg, hf = loaded.model, loaded.config, _hf(hf_dir)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.mscale == 0.8
    assert mla_softmax_scale(cfg) == hf.model.layers[0].self_attn.scaling != 24**-0.5
    assert mla_softmax_scale(cfg) == 24**-0.5 * yarn_get_mscale(4.0, 1.0) ** 2
    gen = torch.Generator().manual_seed(6)
    for length in (5, 17, 40):  # 17 and 40 run past the 16 original positions
        tokens = torch.randint(0, 128, (1, length), generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-5)
    ids = torch.randint(2, 128, (1, 24), generator=gen)
    hf.generation_config.eos_token_id = None
    expected = hf.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 24:]
    assert generate(ours, ids, sampling=SamplingConfig(max_new_tokens=20)).row(0) == expected.tolist()
    back = dcp_to_hf(loaded.path, tmp_path / "back")
    original, again = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(original) == sorted(again)
    assert all(torch.equal(again[k], v) for k, v in original.items())
    rope = json.loads((back / "config.json").read_text())["rope_parameters"]
    assert rope == {k: v for k, v in YARN.items() if k not in ("beta_fast", "beta_slow")}  # HF's defaults omitted


def test_mtp_weights_on_disk_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.layers.2.eh_proj.weight": torch.zeros(2, 2), "model.layers.0.x": torch.zeros(1)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    hf_cfg = transformers.DeepseekV3Config(**{**HF_KW, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=1: .* multi-token-prediction layers \[2\]"):
        hf_deepseek_v3.check_hf_dir(tmp_path, hf_cfg)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.layers.1.x": "a"}}))
    hf_deepseek_v3.check_hf_dir(tmp_path, hf_cfg)  # the index is what counts when present


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(hidden_act="gelu"), "DeepseekV3Config.hidden_act='gelu' is not supported; allowed: 'silu'"),
        (dict(rms_norm_eps=1e-5), "DeepseekV3Config.rms_norm_eps=1e-05 is not supported; allowed: 1e-06"),
        (dict(attention_bias=True), "DeepseekV3Config.attention_bias=True is not supported"),
        (dict(num_key_value_heads=2), "DeepseekV3Config.num_key_value_heads=2 is not supported"),
    ],
)
def test_unrepresentable_hf_configs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model_config_from_hf(transformers.DeepseekV3Config(**{**HF_KW, **kw}))


def test_fp8_checkpoints_and_unrepresentable_configs_are_refused():
    hf_cfg = transformers.DeepseekV3Config(**HF_KW)
    hf_cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="DeepseekV3Config.quantization_config=.* allowed: none"):
        model_config_from_hf(hf_cfg)
    cfg = hf_deepseek_v3.from_hf_config(transformers.DeepseekV3Config(**HF_KW))
    for field, value in (("router", "softmax"), ("shared_expert_gate", True), ("norm_eps", 1e-5)):
        bad = ModelConfig(**{**cfg.__dict__, field: value})
        with pytest.raises(ValueError, match=f"ModelConfig.{field}=.* has no DeepseekV3ForCausalLM equivalent"):
            hf_family(bad)


def test_dense_mla_model_round_trips(tmp_path):
    """first_k_dense_replace = num_hidden_layers: a dense MLA model (no routed experts) both ways."""
    cfg = model_config_from_hf(transformers.DeepseekV3Config(**{**HF_KW, "first_k_dense_replace": 3}))
    assert cfg.num_experts == 0 and cfg.attention == "mla"
    hf_cfg = hf_deepseek_v3.to_hf_config(cfg)
    assert hf_cfg.first_k_dense_replace == 3 and model_config_from_hf(hf_cfg) == cfg


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(n_dense_layers=2), "ModelConfig.n_dense_layers=2 leaves no MoE layer among n_layers=2"),
        (dict(num_expert_groups=3), "ModelConfig.num_expert_groups=3 must divide num_experts=8"),
        (dict(num_expert_groups=8), "ModelConfig.num_expert_groups=8 gives groups of 1 expert"),
        (dict(num_expert_groups=4, num_limited_groups=5), "ModelConfig.num_limited_groups=5 must be in 1..num_"),
        (dict(num_expert_groups=4, num_limited_groups=1, top_k=3), "ModelConfig.top_k=3 exceeds the 2 experts"),
        (dict(n_dense_layers=-1), "ModelConfig.n_dense_layers=-1 must be an integer >= 0"),
    ],
)
def test_routing_fields_are_validated(kw, message):
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ModelConfig(**{**base, **kw})


def test_dcp_to_hf_library_call_and_bf16_keeps_the_router_fp32(imported, tmp_path):
    from safetensors.torch import load_file

    out = dcp_to_hf(imported, tmp_path / "lib")
    assert type(_hf(out)).__name__ == "DeepseekV3ForCausalLM"
    saved = load_file(dcp_to_hf(imported, tmp_path / "bf16", dtype="bfloat16") / "model.safetensors")
    router = {k for k in saved if k.endswith(hf_deepseek_v3.KEEP_FP32)}
    assert len(router) == 4 and all(saved[k].dtype == torch.float32 for k in router)
    assert all(v.dtype == torch.bfloat16 for k, v in saved.items() if k not in router)


def test_the_real_deepseek_v3_config():
    """DeepSeek-V3's own config (transformers' defaults are its shapes; its yarn x40 RoPE): 671.0B parameters,
    37.6B active (the paper's 671B / 37B, arXiv:2412.19437), RoPE tables bitwise HF's, HF's softmax scale."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    from kempnerforge.model.mla import mla_softmax_scale
    from kempnerforge.model.rope import model_rope_tables

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    hf_cfg = transformers.DeepseekV3Config(rope_parameters=yarn, max_position_embeddings=163840)
    cfg = model_config_from_hf(hf_cfg)
    assert (cfg.n_dense_layers, cfg.num_expert_groups, cfg.num_limited_groups, cfg.top_k) == (3, 8, 4, 8)
    assert round(cfg.num_params() / 1e9, 1) == 671.0 and round(cfg.num_active_params() / 1e9, 1) == 37.6
    assert mla_softmax_scale(cfg) == yarn_apply_mscale(hf_cfg.rope_parameters, 192**-0.5)
    positions = torch.tensor([[0, 1, 4095, 4096, 100_000, 163_839]])
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = model_rope_tables(dataclasses.replace(cfg, max_seq_len=163_840))
    assert torch.equal(cos[positions[0]], hf_cos[0]) and torch.equal(sin[positions[0]], hf_sin[0])
