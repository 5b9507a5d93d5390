"""Fused Q/K/V (``fuse_qkv``) and gate/up (``fuse_w13``) projections (issue 21 check 3).

The oracle is the unfused model (itself tested against transformers): for the same seed the fused model starts
bit-identical (its init draws every element as the separate projection would), gives the same logits, gradients
and cached decoding; the HF converters of every family split and join the fused weights (HF -> kforge -> HF
bit-exact, logits equal to transformers' at 1e-5), ``model.init_from`` reads HF's separate tensors into the fused
rows, and checkpoints written with separate projections load (or a resume names the flag).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kempnerforge.checkpoint.compat import layout_resume_flags, model_config_diff
from kempnerforge.checkpoint.hf_source import gather_source
from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.fused import join_state_dict, qkv_rows, split_state_dict, validate_fused_tp, w13_rows
from kempnerforge.parallel.mesh import MeshConfigError
from kempnerforge.parallel.tensor_parallel import _resolve

SHAPES = {
    "mha": dict(dim=32, n_heads=4),
    "gqa-bias": dict(dim=32, n_heads=4, n_kv_heads=2, attention_bias=True),
    "qk_norm-head_dim": dict(dim=32, n_heads=4, n_kv_heads=1, qk_norm=True, head_dim=16),
}


def _pair(shape: str, **over) -> tuple[ModelConfig, ModelConfig]:
    base = dict(n_layers=2, vocab_size=128, max_seq_len=32, multiple_of=16, **SHAPES[shape], **over)
    return ModelConfig(**base, fuse_qkv=False, fuse_w13=False), ModelConfig(**base, fuse_qkv=True, fuse_w13=True)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_model_is_the_unfused_model(shape):
    plain_cfg, fused_cfg = _pair(shape)
    plain, fused = Transformer(plain_cfg), Transformer(fused_cfg)
    plain.init_weights(seed=7)
    fused.init_weights(seed=7)
    joined = join_state_dict(plain.state_dict(), fused_cfg)
    assert joined.keys() == fused.state_dict().keys()
    assert all(torch.equal(joined[k], v) for k, v in fused.state_dict().items())  # bit-identical init
    assert fused_cfg.num_params() == plain_cfg.num_params() == sum(p.numel() for p in fused.parameters())
    assert fused_cfg.flops_per_token(32) == plain_cfg.flops_per_token(32)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (plain, fused):
        model(tokens).square().mean().backward()
    torch.testing.assert_close(fused(tokens), plain(tokens), rtol=0, atol=1e-6)
    grads = join_state_dict({n: p.grad for n, p in plain.named_parameters()}, fused_cfg)
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-6, msg=name)
    assert fused.layers["0"].attention.cache_dims() == plain.layers["0"].attention.cache_dims()


def test_generate_with_kv_cache_equals_unfused():
    from kempnerforge.model.generate import SamplingConfig, generate

    plain_cfg, fused_cfg = _pair("gqa-bias")
    plain, fused = Transformer(plain_cfg).eval(), Transformer(fused_cfg).eval()
    plain.init_weights(seed=1)
    fused.init_weights(seed=1)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0)
    a, b = generate(fused, prompt, sampling=greedy), generate(plain, prompt, sampling=greedy)
    assert torch.equal(a.tokens, b.tokens)


def test_layouts_keep_whole_groups_in_every_row_chunk():
    """A Shard(0) chunk of tp ranks holds whole KV groups / gate-up pairs: the TP-independent layout."""
    rows = qkv_rows(n_heads=8, n_kv_heads=4, head_dim=2)  # 4 groups of (2 q heads, k, v) x 2 rows
    assert rows[:8] == [0, 1, 2, 3, 16, 17, 24, 25]  # q heads 0-1, k head 0, v head 0
    assert sorted(rows) == list(range(32))
    assert w13_rows(3) == [0, 3, 1, 4, 2, 5]
    cfg = ModelConfig(dim=64, n_layers=1, n_heads=4, vocab_size=64, ffn_hidden_dim=96, fuse_w13=True)
    validate_fused_tp(cfg, 4)
    with pytest.raises(MeshConfigError, match=r"^model.fuse_w13=True needs tp=5 to divide .*ffn_hidden=96"):
        validate_fused_tp(cfg, 5)


def test_tp_plan_names_the_fused_linears():
    _, fused_cfg = _pair("qk_norm-head_dim")
    model = Transformer(fused_cfg)
    block = model.tp_plan(sequence_parallel=False, loss_parallel=True).block
    assert {"attention.wqkv", "feed_forward.w13"} <= set(block) and "attention.wq" not in block
    assert all(_resolve(model.layers["0"], key) for key in block)  # apply_tp refuses an entry matching nothing


def _families():
    from tests.hf_family_models import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("family", _families())
def test_hf_families_split_and_join(family, tmp_path):
    """Every family: import into the fused model (logits = transformers' at 1e-5), export bit-exact, and the
    per-key sources of ``model.init_from`` (the concatenated-rows form) give the same tensors."""
    pytest.importorskip("transformers")
    from kempnerforge.checkpoint.hf_families import family_for_hf_config
    from kempnerforge.checkpoint.hf_load import load_hf_weights_
    from tests.hf_family_models import build_hf_model, prompts

    hf = build_hf_model(family)
    module = family_for_hf_config(hf.config).module
    cfg = dataclasses.replace(module.from_hf_config(hf.config), fuse_qkv=True, fuse_w13=True)
    hf_sd = hf.state_dict()
    ours = module.from_hf_state_dict(hf_sd, cfg)
    assert "layers.0.attention.wqkv.weight" in ours and "layers.0.attention.wq.weight" not in ours
    assert ("layers.0.feed_forward.w13.weight" in ours) == (cfg.num_experts == 0 or not cfg.is_moe_layer(0))
    model = Transformer(cfg)
    model.load_state_dict(ours, strict=True)
    model.tie_weights()
    with torch.no_grad():
        for tokens in prompts():
            torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-5)
    back = module.to_hf_state_dict(model.state_dict(), cfg)
    expected = {k: v for k, v in hf_sd.items() if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)
    hf.save_pretrained(tmp_path)
    loaded = Transformer(cfg)
    loaded.init_weights(seed=0)
    load_hf_weights_(loaded, tmp_path, cfg)
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
    fused_source = module.hf_source("layers.0.attention.wqkv.weight", cfg, set(hf_sd))
    assert fused_source.concat and len(fused_source.keys) == 3
    assert torch.equal(gather_source(hf_sd, fused_source, ()), ours["layers.0.attention.wqkv.weight"])


def test_deepseek_v3_dense_layer_w13(tmp_path):
    """DeepSeek-V3 (MLA attention, which ``fuse_qkv`` leaves alone): its dense first layer's ``w13``."""
    pytest.importorskip("transformers")
    from kempnerforge.checkpoint import hf_deepseek_v3
    from kempnerforge.checkpoint.hf_load import load_hf_weights_, read_hf_config
    from tests.deepseek_tiny import save_tiny_deepseek_v3

    folder = save_tiny_deepseek_v3(tmp_path / "ds")
    cfg = dataclasses.replace(hf_deepseek_v3.from_hf_config(read_hf_config(folder)), fuse_qkv=True, fuse_w13=True)
    assert cfg.n_dense_layers >= 1
    model = Transformer(cfg)
    assert hasattr(model.layers["0"].feed_forward, "w13") and not hasattr(model.layers["0"].attention, "wqkv")
    model.init_weights(seed=0)
    load_hf_weights_(model, folder, cfg)
    from safetensors.torch import load_file

    disk = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    w13 = model.state_dict()["layers.0.feed_forward.w13.weight"]
    torch.testing.assert_close(w13[0::2], disk["model.layers.0.mlp.gate_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(w13[1::2], disk["model.layers.0.mlp.up_proj.weight"], rtol=0, atol=0)
    back = hf_deepseek_v3.to_hf_state_dict(model.state_dict(), cfg)
    assert torch.equal(back["model.layers.0.mlp.up_proj.weight"], disk["model.layers.0.mlp.up_proj.weight"])


def test_old_checkpoint_config_means_unfused():
    """A config saved before the fields existed is the unfused layout; a resume into a fused run names the flag."""
    from kempnerforge.checkpoint.load import model_config_from_meta

    old = {k: v for k, v in dataclasses.asdict(ModelConfig(dim=32, n_heads=4)).items() if not k.startswith("fuse_")}
    cfg = model_config_from_meta({"hyper_parameters": {"config": old}}, "ckpt")
    assert not cfg.fuse_qkv and not cfg.fuse_w13
    now = {**old, "fuse_qkv": True, "fuse_w13": False}
    assert model_config_diff({"config": old}, {"config": now}) == [
        "model.config.fuse_qkv: saved False, now True (set --model.config.fuse_qkv=False to resume it)"
    ]
    assert model_config_diff({"config": old}, {"config": {**old, "fuse_qkv": False}}) == []
    default = dataclasses.asdict(ModelConfig(dim=32, n_heads=4))  # now fused: resuming the old one needs both flags
    assert layout_resume_flags({"config": old}, {"config": default}) == [
        "--model.config.fuse_qkv=False",
        "--model.config.fuse_w13=False",
    ]
    assert layout_resume_flags({"config": old}, {"config": {**default, "dim": 64}}) == []  # another model


def test_split_state_dict_round_trip():
    _, cfg = _pair("gqa-bias")
    model = Transformer(cfg)
    model.init_weights(seed=2)
    sd = model.state_dict()
    split = split_state_dict(sd, cfg)
    assert "layers.1.attention.wk.bias" in split and "layers.1.feed_forward.w3.weight" in split
    again = join_state_dict(split, cfg)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize(("arch", "dense_fused", "backbone_fused"), [("mot", True, False), ("moma", True, True)])
def test_vlm_warm_start_across_layouts(arch, dense_fused, backbone_fused):
    """A VLM backbone warm-starts from a text model of the other layout (MoT keeps its own separate projections;
    MoMa's experts copy the dense w1/w3): the same logits as from the matching layout."""
    from kempnerforge.config.vlm import VLMConfig
    from kempnerforge.model.vlm import build_backbone
    from tests.unit.vlm_backbone_utils import random_inputs, tiny_text_config

    cfg = tiny_text_config(fuse_qkv=False, fuse_w13=False)
    fuse = dict(fuse_qkv=True, fuse_w13=True)
    dense = Transformer(dataclasses.replace(cfg, **fuse) if dense_fused else cfg)
    dense.init_weights(seed=3)
    plain = Transformer(cfg)
    plain.load_state_dict(split_state_dict(dense.state_dict(), dense.config))
    vlm = VLMConfig(arch=arch)
    ref, ours = (
        build_backbone(cfg, vlm),
        build_backbone(dataclasses.replace(cfg, **fuse) if backbone_fused else cfg, vlm),
    )
    for model in (ref, ours):
        model.init_weights(seed=5)  # what the warm start leaves alone (MoMa's routers) starts equal
    ref.load_text_state_dict(plain.state_dict())
    ours.load_text_state_dict(dense.state_dict())
    ids, visual = random_inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, visual), ref(ids, visual), rtol=0, atol=1e-6)


def test_float8_converts_the_fused_linears_with_float8_tp_styles():
    """FP8's filter is by module type and local GEMM shape: the fused Linears convert and get torchao's styles."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from kempnerforge.parallel import float8 as f8

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=96, max_seq_len=16, ffn_hidden_dim=32,
                      fuse_qkv=True, fuse_w13=True)  # fmt: skip
    model = Transformer(cfg)
    plan = model.tp_plan(sequence_parallel=True, loss_parallel=True)
    styles = f8.float8_tp_plan(model.layers["0"], plan.block, "tensorwise", tp=2, prefix="layers.0.")
    assert (
        type(styles["attention.wqkv"]).__name__ == type(styles["feed_forward.w13"]).__name__ == "Float8ColwiseParallel"
    )
    assert type(styles["attention"]).__name__ == type(styles["feed_forward"]).__name__ == "PrepareFloat8ModuleInput"
    assert isinstance(model.layers["0"].attention.wqkv, Float8Linear)
    assert isinstance(model.layers["0"].feed_forward.w13, Float8Linear)


def test_checkpoint_written_before_the_fields_loads_unfused(tmp_path, monkeypatch):
    """A DCP checkpoint whose saved config has no fuse_* fields (written the old way, wq/wk/wv keys) loads."""
    from kempnerforge.checkpoint import convert
    from kempnerforge.checkpoint.load import load_checkpoint_model

    cfg, _ = _pair("gqa-bias")
    model = Transformer(cfg)
    model.init_weights(seed=4)
    old_asdict = convert.asdict
    monkeypatch.setattr(convert, "asdict", lambda c: {k: v for k, v in old_asdict(c).items() if "fuse" not in k})
    convert.write_weights_checkpoint(model, cfg, tmp_path, "step=0.ckpt", source="test")
    loaded = load_checkpoint_model(tmp_path / "step=0.ckpt")
    assert "fuse_qkv" not in loaded.meta["hyper_parameters"]["config"] and not loaded.config.fuse_qkv
    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), model.eval()(tokens))


def test_attention_probs_hook_reads_the_fused_projection():
    from kempnerforge.model.hooks import attention_probs
    from kempnerforge.model.rope import model_rope_tables

    plain_cfg, fused_cfg = _pair("qk_norm-head_dim")
    plain, fused = Transformer(plain_cfg), Transformer(fused_cfg)
    plain.init_weights(seed=8)
    fused.init_weights(seed=8)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = (t[:6] for t in model_rope_tables(plain_cfg, "cpu"))
    a = attention_probs(fused.layers["0"].attention, x, cos, sin)
    torch.testing.assert_close(a, attention_probs(plain.layers["0"].attention, x, cos, sin), rtol=0, atol=1e-6)


def test_muon_refuses_fused_matrices():
    from kempnerforge.training.optimizers import OptimizerConfig, build_optimizer

    _, cfg = _pair("mha")
    with pytest.raises(ValueError, match=r"optimizer.name='muon' .* layers.0.attention.wqkv stacks several"):
        build_optimizer(Transformer(cfg), OptimizerConfig(name="muon"))


def test_fused_is_the_default_and_muon_asks_for_the_separate_projections():
    """Both fused by default; ``optimizer.name='muon'`` with the default config is refused at construction, before
    any model exists, naming both flags; with them False (as configs/recipes/muon_wsd.yaml sets) it builds."""
    from kempnerforge.module import CausalLM
    from kempnerforge.training.optimizers import OptimizerConfig, check_optimizer_model

    assert ModelConfig().fuse_qkv and ModelConfig().fuse_w13
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)
    with pytest.raises(ValueError, match=r"^model.config.fuse_qkv=True .* does not go with optimizer.name='muon'.*"
                       r"--model.config.fuse_qkv=False --model.config.fuse_w13=False") as err:  # fmt: skip
        CausalLM(cfg, optimizer=OptimizerConfig(name="muon"))
    from kempnerforge.cli_errors import error_line

    assert error_line(err.value).startswith("kforge: error: model.config.fuse_qkv: model.config.fuse_qkv=True (")
    with pytest.raises(ValueError, match=r"^model.config.fuse_w13=True "):
        check_optimizer_model(OptimizerConfig(name="muon"), dataclasses.replace(cfg, fuse_qkv=False))
    unfused = dataclasses.replace(cfg, fuse_qkv=False, fuse_w13=False)
    check_optimizer_model(OptimizerConfig(name="muon"), unfused)
    check_optimizer_model(OptimizerConfig(name="adamw"), cfg)
    module = CausalLM(unfused, optimizer=OptimizerConfig(name="muon"))
    module.configure_model()
    assert "attention.wq" in dict(module.model.layers["0"].named_modules())
