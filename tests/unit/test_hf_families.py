"""Issue 20 checks 1 and 5 for Llama 3.1 (llama3 RoPE scaling), Qwen 2.5 (q/k/v biases), Qwen 3 (QK-norm, head_dim
!= dim / n_heads, YaRN) and Qwen3-MoE, on random-weight models built with transformers' own config classes:

1. ``kforge convert hf-to-dcp`` of a ``save_pretrained`` directory gives logits equal to transformers' (fp32, 1e-5) on
   3 prompts of 7, 29 and 64 tokens (positions up to 63, past original_max_position_embeddings=16), and
   ``dcp-to-hf`` writes back every tensor bit-exact (and the same config.json). Also Qwen2-MoE with its q/k/v biases.
5. greedy generation on the imported checkpoint (the library and ``kforge generate``) equals transformers' for 20 tokens.

Qwen 3's q_norm / k_norm placement (per head, before RoPE) is proven by its logits matching here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kempnerforge.checkpoint.convert import model_config_from_hf
from kempnerforge.checkpoint.hf_families import FAMILY_API, HFFamily, families, family_for_config, register_family
from kempnerforge.checkpoint.load import load_checkpoint_model
from kempnerforge.cli import main
from kempnerforge.config import ModelConfig
from kempnerforge.model.generate import SamplingConfig, generate, left_pad
from tests.hf_family_models import FAMILIES, MAX_POS, hf_config, prompts, save_hf_model

transformers = pytest.importorskip("transformers")
ARCHITECTURES = {"llama31": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF source dir, imported checkpoint dir, re-exported HF dir), all through the CLI."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        src = save_hf_model(family, root / f"{family}_hf")
        main(["convert", "hf-to-dcp", "--hf_dir", str(src), "--output_dir", str(root / f"{family}_dcp")])
        main(["convert", "dcp-to-hf", "--ckpt", str(root / f"{family}_dcp"), "--output_dir", str(root / f"{family}_back")])  # fmt: skip
        out[family] = (src, root / f"{family}_dcp", root / f"{family}_back")
    return out


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_logits_equal_transformers(family, converted):
    src, ckpt, _ = converted[family]
    hf, ours = _hf(src), load_checkpoint_model(ckpt).model
    assert type(hf).__name__ == ARCHITECTURES[family]
    with torch.no_grad():
        for tokens in prompts():
            torch.testing.assert_close(ours(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-5)
    cfg = load_checkpoint_model(ckpt).config
    if cfg.rope_scaling is not None:  # the scaling matters at these positions: plain RoPE would fail the check
        from kempnerforge.checkpoint.load import build_model

        plain = build_model(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            longest = prompts()[-1]
            assert (plain(longest) - hf(input_ids=longest).logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact(family, converted):
    """HF -> kforge -> HF: every tensor of the saved safetensors files (keys, dtype, bits) and config.json."""
    src, _, back = converted[family]
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert files == sorted(p.name for p in back.glob("*.safetensors")) and files
    for name in files:
        a, b = load_file(src / name), load_file(back / name)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    config_a, config_b = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert config_a == config_b


@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_gives_transformers_logits(family, converted):
    """``model.init_from`` (the per-rank safetensors load of the finetune branch) reads these families' folders too."""
    pytest.importorskip("kempnerforge.checkpoint.init_from", reason="model.init_from is not on this branch yet")
    from kempnerforge.module import CausalLM

    src = converted[family][0]
    module = CausalLM(init_from=str(src))
    module.configure_model()
    hf = _hf(src)
    with torch.no_grad():
        for tokens in prompts():
            torch.testing.assert_close(module(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-5)


def _hf_greedy(hf, ids, mask, n):
    out = hf.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("family", ["llama31", "qwen2", "qwen3"])
def test_generate_greedy_equals_transformers(family, converted):
    """20 new tokens for a left-padded batch (rows reach position 53, past the original 16), KV cache on both sides."""
    src, ckpt, _ = converted[family]
    ids, mask = left_pad([p[0].tolist() for p in prompts((9, 33))], pad_token_id=0)
    ours = generate(load_checkpoint_model(ckpt).model, ids, mask, SamplingConfig(max_new_tokens=20))
    assert torch.equal(ours.tokens, _hf_greedy(_hf(src), ids, mask, 20))


def test_kforge_generate_cli_equals_transformers(tmp_path, gpt2_tokenizer_dir, capsys):
    """``kforge generate`` on an imported Llama-3.1-scaled model prints transformers' greedy 20 tokens."""
    src = save_hf_model("llama31", tmp_path / "hf", vocab_size=50257)
    main(["convert", "hf-to-dcp", "--hf_dir", str(src), "--output_dir", str(tmp_path / "dcp")])
    capsys.readouterr()
    prompt = "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet"
    main(["generate", "--ckpt", str(tmp_path / "dcp"), "--prompt", prompt, "--max_new_tokens", "20", "--ignore_eos",
          "--tokenizer", str(gpt2_tokenizer_dir)])  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(gpt2_tokenizer_dir, local_files_only=True)
    ids = torch.tensor([tok.encode(prompt)])
    assert ids.shape[1] > 16 and ids.shape[1] + 20 <= MAX_POS  # decoding runs past the original context
    theirs = _hf_greedy(_hf(src), ids, torch.ones_like(ids, dtype=torch.bool), 20)
    assert f"--- [0] {prompt}{tok.decode(theirs[0].tolist())}\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("family", "over", "match"),
    [
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, r"Qwen2Config\.use_sliding_window=True"),
        ("qwen3", {"attention_bias": True}, r"Qwen3Config\.attention_bias=True .*o_proj"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, r"Qwen3MoeConfig\.mlp_only_layers=\[0\]"),
        ("qwen3_moe", {"use_sliding_window": True}, r"Qwen3MoeConfig\.use_sliding_window=True"),
        (
            "llama31",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            r"LlamaConfig\.rope_parameters\.rope_type='linear'",
        ),
        ("llama31", {"mlp_bias": True}, r"LlamaConfig\.mlp_bias=True"),
        ("llama31", {"hidden_act": "gelu"}, r"LlamaConfig\.hidden_act='gelu'"),
    ],
)
def test_import_refuses_what_the_model_cannot_represent(family, over, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(hf_config(family, **over))
    with pytest.raises(
        ValueError, match=r"model_type='gpt2' is not supported; allowed: 'deepseek_v3', 'llama', .*'qwen3_moe'"
    ):
        model_config_from_hf(transformers.GPT2Config())


BASE = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, multiple_of=16)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 16}}, "LlamaForCausalLM"),
        ({"attention_bias": True}, "Qwen2ForCausalLM"),
        ({"qk_norm": True, "head_dim": 16}, "Qwen3ForCausalLM"),
        ({"qk_norm": True, "num_experts": 4, "moe_frequency": 2}, "Qwen3MoeForCausalLM"),
        ({"num_experts": 4}, "MixtralForCausalLM"),
        (
            {"num_experts": 4, "n_shared_experts": 1, "shared_expert_gate": True, "attention_bias": True},
            "Qwen2MoeForCausalLM",
        ),
        ({"qk_norm": True, "attention_bias": True}, r"ModelConfig\.attention_bias=True has no Qwen3ForCausalLM"),
        ({"qk_norm": True, "num_experts": 4, "router": "sigmoid"}, r"ModelConfig\.router='sigmoid' has no Qwen3Moe"),
        ({"qk_norm": True, "num_experts": 4, "capacity_factor": 1.5}, r"ModelConfig\.capacity_factor=1\.5 has no"),
        ({"num_experts": 4, "attention_bias": True}, r"ModelConfig\.attention_bias=True has no MixtralForCausalLM"),
    ],
)
def test_export_dispatch_and_refusals(fields, expected):
    """Our config -> the family it exports as, or the refusal naming the field."""
    cfg = ModelConfig(**BASE, **fields)
    if not expected.startswith("ModelConfig"):
        assert family_for_config(cfg).architecture == expected
    else:
        with pytest.raises(ValueError, match=expected):
            family_for_config(cfg)


def test_registry_checks_the_family_api():
    import types

    with pytest.raises(TypeError, match=r"lacks \['ARCHITECTURE'"):
        HFFamily(types.ModuleType("empty"), claims=lambda c: False)
    assert [f.model_type for f in families()][-2:] == ["llama", "mixtral"]  # the generic ones are tried last
    existing = families()[0]
    register_family(existing)  # re-registering replaces, never duplicates
    assert len(families()) == len({f.model_type for f in families()}) and set(FAMILY_API) >= {"to_hf_state_dict"}
