"""Check 1 and 2 of the MoE issue: our MoE block equals the HF reference blocks (fp32, 1e-5), and a
full softmax-routed MoE model exports to ``MixtralForCausalLM`` with equal logits."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.checkpoint import hf_mixtral
from kempnerforge.config import ModelConfig
from kempnerforge.model import RMSNorm, Transformer
from kempnerforge.model.moe import MoE
from kempnerforge.model.router import Router

transformers = pytest.importorskip("transformers")

DIM, HIDDEN, E, K = 32, 16, 8, 2


def _cfg(**kw) -> ModelConfig:
    base = dict(dim=DIM, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, ffn_hidden_dim=HIDDEN,
                num_experts=E, top_k=K)  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def _moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe.eval()


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 10, DIM, generator=torch.Generator().manual_seed(seed))


def _copy_experts(ours: MoE, hf_experts) -> None:
    e = ours.experts
    hf_experts.gate_up_proj.data.copy_(torch.cat([e.w1, e.w3], dim=1))
    hf_experts.down_proj.data.copy_(e.w2)


def _copy_mlp(ours, hf_mlp) -> None:
    hf_mlp.gate_proj.weight.data.copy_(ours.w1.weight)
    hf_mlp.up_proj.weight.data.copy_(ours.w3.weight)
    hf_mlp.down_proj.weight.data.copy_(ours.w2.weight)


def _compare(ours: MoE, hf_block, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected = hf_block(x.clone())
        got = ours(x)
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_softmax_router_matches_mixtral_block():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _cfg()
    ours = _moe(cfg)
    hf_cfg = hf_mixtral.to_hf_config(cfg)
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    hf.gate.weight.data.copy_(ours.router.gate.weight)
    _copy_experts(ours, hf.experts)
    _compare(ours, hf, _x())


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_router_with_gated_shared_expert_matches_qwen2_moe_block(norm_topk_prob):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = _cfg(n_shared_experts=1, shared_expert_gate=True, router_renormalize=norm_topk_prob)
    ours = _moe(cfg)
    hf_cfg = Qwen2MoeConfig(hidden_size=DIM, moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)  # fmt: skip
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    hf.gate.weight.data.copy_(ours.router.gate.weight)
    _copy_experts(ours, hf.experts)
    _copy_mlp(ours.shared_experts["0"], hf.shared_expert)
    hf.shared_expert_gate.weight.data.copy_(ours.shared_gate.weight)
    _compare(ours, hf, _x())


@pytest.mark.parametrize(("groups", "limited"), [(1, 1), (4, 2)], ids=["no-groups", "group-limited"])
def test_sigmoid_router_with_bias_and_shared_experts_matches_deepseek_v3_moe(groups, limited):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    n_shared = 2
    cfg = _cfg(router="sigmoid", n_shared_experts=n_shared, route_scale=2.5, bias_update_rate=0.01,
               num_expert_groups=groups, num_limited_groups=limited)  # fmt: skip
    ours = _moe(cfg)
    # A bias large enough to change the selection, so a bias applied to the weights (or not at all) shows.
    ours.router.expert_bias.copy_(torch.linspace(-0.4, 0.4, E))
    hf_cfg = DeepseekV3Config(hidden_size=DIM, moe_intermediate_size=HIDDEN, n_routed_experts=E, num_experts_per_tok=K,
                              n_shared_experts=n_shared, n_group=groups, topk_group=limited, norm_topk_prob=True,
                              routed_scaling_factor=2.5, hidden_act="silu")  # fmt: skip
    hf = DeepseekV3MoE(hf_cfg).eval()
    hf.gate.weight.data.copy_(ours.router.gate.weight)
    hf.gate.e_score_correction_bias.copy_(ours.router.expert_bias)
    _copy_experts(ours, hf.experts)
    # HF fuses the n shared experts into one MLP of width n * hidden; ours keeps n separate experts.
    shared = [ours.shared_experts[str(i)] for i in range(n_shared)]
    hf.shared_experts.gate_proj.weight.data.copy_(torch.cat([s.w1.weight for s in shared], 0))
    hf.shared_experts.up_proj.weight.data.copy_(torch.cat([s.w3.weight for s in shared], 0))
    hf.shared_experts.down_proj.weight.data.copy_(torch.cat([s.w2.weight for s in shared], 1))
    x = _x()
    _compare(ours, hf, x)
    # The bias changed the selection (else the test would not prove bias-only-for-selection).
    with torch.no_grad():
        routed = ours.router(x.view(-1, DIM)).indices
        ours.router.expert_bias.zero_()
        unbiased = ours.router(x.view(-1, DIM)).indices
    assert not torch.equal(routed.sort(-1).values, unbiased.sort(-1).values)
    if groups > 1:  # the group limit changed the selection too, and every choice lies in the allowed groups
        free = Router(DIM, E, K, "sigmoid", True, 2.5)
        free.gate.weight.data.copy_(ours.router.gate.weight)
        with torch.no_grad():
            assert not torch.equal(free(x.view(-1, DIM)).indices.sort(-1).values, unbiased.sort(-1).values)
        per_token_groups = [torch.unique(row // (E // groups)).numel() for row in unbiased]
        assert max(per_token_groups) <= limited


def _random_moe_model(cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(3)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=gen))
        for moe in model.moe_layers().values():  # larger router logits: a routing mismatch would show
            moe.router.gate.weight.mul_(20)
    return model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_full_model_exports_to_mixtral_with_equal_logits(tie):
    cfg = _cfg(n_kv_heads=2, tie_embeddings=tie)
    model = _random_moe_model(cfg)
    hf = transformers.MixtralForCausalLM._from_config(hf_mixtral.to_hf_config(cfg), attn_implementation="eager")
    result = hf.load_state_dict(hf_mixtral.to_hf_state_dict(model.state_dict(), cfg), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if tie else [])
    hf = hf.float().eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # And back: HF weights load into a fresh model of ours (strict) with the same logits.
    back = Transformer(cfg)
    back.load_state_dict(hf_mixtral.from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    back.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(tokens), ours, rtol=0, atol=0)


def test_mixtral_export_refuses_unrepresentable_configs():
    with pytest.raises(ValueError, match="n_shared_experts"):
        hf_mixtral.to_hf_config(_cfg(n_shared_experts=1))
    with pytest.raises(ValueError, match="router"):
        hf_mixtral.to_hf_config(_cfg(router="sigmoid"))
