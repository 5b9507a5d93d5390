"""Issue 20 (fine-tuning): ``model.init_from`` in one process, against ``transformers``.

- ``CausalLM(init_from=folder)`` gives the HF model's logits for Llama (tied, bf16 files), Mixtral (the per-expert keys
  ``save_pretrained`` writes, and the packed in-memory layout), Qwen2-MoE (per-expert routed and shared experts) and
  DeepSeek-V3 (MLA with interleaved RoPE rows or not, dense first layer, fused shared expert, the router's correction
  bias: a buffer, read and not zeroed); a DeepSeek-V3 folder with multi-token-prediction layers is refused up front.
- The config rules: a conflicting ``model.config`` field is refused naming it; training-only fields and a shorter
  ``max_seq_len`` are kept.
- A folder tensor of the wrong shape, a missing one, or one no parameter reads is an error, never skipped.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from kempnerforge.checkpoint.hf_source import HFSource
from kempnerforge.checkpoint.init_from import (
    check_hf_weights,
    load_hf_weights_,
    model_config_from_folder,
    resolve_model_config,
)
from kempnerforge.config import ModelConfig
from kempnerforge.errors import PathError, UserError
from kempnerforge.model.safetensors_shards import SafetensorsFolder
from kempnerforge.model.transformer import Transformer
from kempnerforge.module import CausalLM
from tests.hf_folders import save_random

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def _hf(kind: str, **extra):
    import transformers as tf

    cls, config = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig),
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig),
        "qwen2_moe": (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig),
    }[kind]
    return cls, config(**SMALL, **extra)


CASES = {
    "llama_tied_bf16": ("llama", {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "qkv_bias": False,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [],
        },
    ),  # fmt: skip
}


def _logits_diff(folder, hf_model, module=None) -> float:
    if module is None:
        module = CausalLM(init_from=str(folder))
        module.configure_model()
    ids = torch.randint(0, SMALL["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (module(ids) - hf_model(ids).logits).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_init_from_gives_the_hf_models_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    kind, extra = CASES[case]
    folder = save_random(*_hf(kind, **extra), tmp_path / case, dtype=torch.bfloat16 if "bf16" in case else None)
    if "bf16" in case:  # bf16 files are read into fp32 parameters exactly (as from_pretrained(dtype=float32))
        from safetensors import safe_open

        assert safe_open(str(folder / "model.safetensors"), "pt").get_slice("model.norm.weight").get_dtype() == "BF16"
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert _logits_diff(folder, hf_model) < 1e-5


def test_mixtral_in_the_packed_layout(tmp_path):
    """A folder holding transformers 5's in-memory keys (``mlp.experts.gate_up_proj``): w1 / w3 are blocks of it."""
    import json

    cls, config = _hf("mixtral", num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    hf_model = cls(config).eval()
    folder = tmp_path / "packed"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(folder / "model.safetensors"))
    assert _logits_diff(folder, hf_model) < 1e-5


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_deepseek_v3_gives_the_hf_models_logits(rope_interleave, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.deepseek_tiny import save_tiny_deepseek_v3

    folder = save_tiny_deepseek_v3(tmp_path / "dsv3", rope_interleave=rope_interleave)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module = CausalLM(init_from=str(folder))
    module.configure_model()
    bias = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(module.model.layers["1"].moe.router.expert_bias, bias)
    assert _logits_diff(folder, hf_model, module) < 1e-5


def test_deepseek_v3_mtp_layers_are_refused_before_loading(tmp_path):
    from safetensors.torch import load_file

    from kempnerforge.checkpoint.init_from import check_init_from
    from tests.deepseek_tiny import save_tiny_deepseek_v3

    folder = save_tiny_deepseek_v3(tmp_path / "dsv3")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, str(folder / "model.safetensors"))
    for check in (check_init_from, lambda f: resolve_model_config(f, ModelConfig())):
        with pytest.raises(UserError, match=r"num_nextn_predict_layers.*multi-token-prediction layers \[3\]") as err:
            check(folder)
        assert err.value.field == "model.init_from" and "\n" not in str(err.value)


@pytest.fixture
def llama_folder(tmp_path):
    return save_random(*_hf("llama", tie_word_embeddings=False), tmp_path / "llama")


def test_conflicting_model_config_is_refused_and_training_fields_are_kept(llama_folder):
    with pytest.raises(UserError, match=r"64 conflicts with .*config.json.* gives 32") as err:
        resolve_model_config(llama_folder, ModelConfig(dim=64, n_heads=4))
    assert err.value.field in ("model.config.dim", "model.config.n_heads")
    with pytest.raises(UserError, match="allowed: <= 32") as err:
        resolve_model_config(llama_folder, ModelConfig(max_seq_len=64))
    assert err.value.field == "model.config.max_seq_len"
    cfg = resolve_model_config(llama_folder, ModelConfig(max_seq_len=16, init_std=0.01, multiple_of=64, n_layers=2))
    want = model_config_from_folder(llama_folder)
    assert (cfg.max_seq_len, cfg.init_std, cfg.dim, cfg.ffn_hidden) == (16, 0.01, want.dim, 48)


def test_bad_folder_tensors_are_errors(llama_folder, tmp_path):
    from safetensors.torch import load_file

    cfg = model_config_from_folder(llama_folder)
    tensors = load_file(str(llama_folder / "model.safetensors"))
    with SafetensorsFolder(llama_folder) as folder:
        with pytest.raises(ValueError, match="model.norm.weight.*shape"):
            folder.read_source_(torch.empty(31), HFSource(("model.norm.weight",)))
        with pytest.raises(KeyError, match="model.nope"):
            folder.read_source_(torch.empty(32), HFSource(("model.nope",)))
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((llama_folder / "config.json").read_text())
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_hf_weights_(Transformer(cfg), extra, cfg)
    del tensors["model.norm.weight"]
    save_file(tensors, str(extra / "model.safetensors"))
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf_weights_(Transformer(cfg), extra, cfg)


def test_bad_folder_weights_are_refused_from_the_headers_before_any_load(llama_folder, tmp_path):
    """What load_hf_weights_ would find after sharding (a cut or missing file, a missing, extra or misshapen tensor)
    check_hf_weights finds from the file headers, for preflight to refuse as one line (field model.init_from)."""
    import json
    import shutil

    from safetensors.torch import load_file

    cfg = model_config_from_folder(llama_folder)
    check_hf_weights(llama_folder, cfg)  # the folder save_pretrained wrote passes
    tensors = load_file(str(llama_folder / "model.safetensors"))

    def variant(name, sd=None, cut=0, config=None):
        folder = tmp_path / name
        shutil.copytree(llama_folder, folder)
        if config is not None:
            (folder / "config.json").write_text(config)
        if sd is not None:
            save_file(sd, str(folder / "model.safetensors"))
        if cut:
            data = (folder / "model.safetensors").read_bytes()
            (folder / "model.safetensors").write_bytes(data[:-cut])
        return folder

    no_norm = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}
    wider = (llama_folder / "config.json").read_text().replace('"intermediate_size": 48', '"intermediate_size": 40')
    cases = {
        "truncated": (variant("truncated", cut=100), PathError, "cannot be opened.*not fully covered"),
        "missing_tensor": (variant("missing", sd=no_norm), UserError, "no tensor 'model.norm.weight'"),
        "extra_tensor": (variant("extra", sd=extra), UserError, "no kempnerforge parameter.*q_proj.bias"),
        # The default fused w13 reads gate_proj and up_proj as one (2 * 40, 32) tensor.
        "shape": (
            variant("shape", config=wider),
            UserError,
            r"\['model.layers.0.mlp.gate_proj.weight', "
            r"'model.layers.0.mlp.up_proj.weight'\] of shapes \[\(48, 32\), \(48, 32\)\] cannot be "
            r"concatenated into \(80, 32\)",
        ),  # fmt: skip
    }
    for name, (folder, error, pattern) in cases.items():
        with pytest.raises(error, match=pattern) as err:
            check_hf_weights(folder, model_config_from_folder(folder))
        assert err.value.field == "model.init_from", name
    unfused = dataclasses.replace(model_config_from_folder(tmp_path / "shape"), fuse_qkv=False, fuse_w13=False)
    with pytest.raises(UserError, match=r"gate_proj.weight' has shape \(48, 32\).*\(40, 32\)"):
        check_hf_weights(tmp_path / "shape", unfused)
    index = variant("sharded")
    (index / "model.safetensors").rename(index / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(tensors, "model-00001-of-00002.safetensors") | {
        "lm_head.weight": "model-00002-of-00002.safetensors"
    }
    (index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(PathError, match="model-00002-of-00002.safetensors"):
        check_hf_weights(index, cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_load_their_own_part(tied, tmp_path):
    """Each pipeline stage (a pruned model: its blocks; embedding / norm + head on the end stages, a tied head's
    embedding on the last) reads exactly the unsplit load's values for the parameters it keeps."""
    from kempnerforge.parallel.pipeline import prune_to_stages

    folder = save_random(*_hf("llama", tie_word_embeddings=tied), tmp_path / "llama")
    cfg = model_config_from_folder(folder)
    whole = Transformer(cfg, init_from=str(folder))
    whole.init_weights()
    want = dict(whole.named_parameters())
    for stage in (0, 1):
        with torch.device("meta"):
            model = Transformer(cfg, init_from=str(folder))
        prune_to_stages(model, [range(0, 1), range(1, 2)], [stage])
        model.to_empty(device="cpu")
        if model.tok_embeddings is not None and model.output is not None:
            model.tie_weights()
        model.init_weights()
        got = dict(model.named_parameters())
        assert got and all(torch.equal(p, want[n]) for n, p in got.items()), stage


def _moe(**kw) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32, num_experts=4, top_k=2)
    return ModelConfig(**{**base, **kw})


FAMILY_CONFIGS = {
    "llama": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32),
    "llama_tied": ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32, tie_embeddings=True),
    "mixtral": _moe(),
    "qwen2_moe": _moe(n_shared_experts=2, shared_expert_gate=True, moe_frequency=2),
}
_MLA = dict(attention="mla", kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, norm_eps=1e-6)
FAMILY_CONFIGS |= {
    "deepseek_v3": _moe(n_kv_heads=None, **_MLA, q_lora_rank=8, n_layers=3, n_dense_layers=1, n_shared_experts=2,
                        router="sigmoid", num_expert_groups=2, num_limited_groups=1, expert_width_multiplier=0.5),
    "deepseek_v3_no_q_lora": _moe(n_kv_heads=None, **_MLA, n_shared_experts=1, router="sigmoid"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_per_key_sources_agree_with_the_state_dict_converters(name):
    """One source of truth: every parameter's ``hf_source``, gathered from the family's ``to_hf_state_dict`` output
    (transformers 5's in-memory layout), is the parameter itself, and every HF tensor is read by some parameter (or
    by a buffer the family loads: ``HF_BUFFERS``)."""
    from kempnerforge.checkpoint.convert import hf_family
    from kempnerforge.checkpoint.hf_source import gather_source

    cfg = FAMILY_CONFIGS[name]
    model = Transformer(cfg)
    model.init_weights(seed=1)
    family = hf_family(cfg)
    suffixes = getattr(family, "HF_BUFFERS", ())
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith(suffixes)]
    for _, b in buffers:  # a loaded buffer (DeepSeek-V3's correction bias): nonzero, so a wrong source shows
        b.copy_(torch.randn(b.shape))
    hf_sd = family.to_hf_state_dict(model.state_dict(), cfg)
    used = set()
    for fqn, param in [*model.named_parameters(), *buffers]:
        source = family.hf_source(fqn, cfg, set(hf_sd))
        assert torch.equal(gather_source(hf_sd, source, tuple(param.shape)), param), fqn
        used.update(source.keys)
    assert used == set(hf_sd)


def test_a_family_without_a_per_key_mapping_is_refused(llama_folder, monkeypatch):
    import types

    from kempnerforge.checkpoint import init_from

    monkeypatch.setattr(init_from, "hf_family_of", lambda cfg: types.ModuleType("kempnerforge.checkpoint.hf_new"))
    with pytest.raises(UserError, match="hf_new checkpoint, whose converter has no per-key mapping") as err:
        init_from.resolve_model_config(llama_folder, ModelConfig())
    assert err.value.field == "model.init_from"
