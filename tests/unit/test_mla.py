"""Multi-head latent attention (kempnerforge.model.mla): HF ``DeepseekV3Attention`` parity (fp32, 1e-5), the latent
KV cache against the training forward, exact parameter / FLOP counts, packed documents, validation messages."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.generate import SamplingConfig, decoder_step, generate
from kempnerforge.model.kv_cache import KVCache
from kempnerforge.model.mla import MultiHeadLatentAttention
from kempnerforge.model.rope import rope_tables

MLA = dict(attention="mla", kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def _cfg(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32, ffn_hidden_dim=48, init_std=0.1,
                rope_theta=10000.0, norm_eps=1e-6, **MLA)  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def _model(cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed=3)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_mla_matches_hf_deepseek_v3_attention(q_lora_rank):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = _cfg(q_lora_rank=q_lora_rank)
    ours = _model(cfg).layers["0"].attention
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank or None,
        kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=False,
        max_position_embeddings=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    hf_cfg._attn_implementation = "sdpa"
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    names.update(
        {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if q_lora_rank else {"wq": "q_proj"}
    )
    with torch.no_grad():
        for o, h in names.items():
            getattr(hf, h).weight.copy_(getattr(ours, o).weight)
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, torch.arange(11)[None])
    with torch.no_grad():
        expected, _ = hf(x, (cos, sin), attention_mask=None)
        ours_cos, ours_sin = rope_tables(8, 11, 10000.0)
        got = ours(x, ours_cos, ours_sin)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_latent_cache_decoding_equals_training_forward(q_lora_rank):
    """Prefill of a left-padded batch and then one token at a time over the latent cache (absorbed ``wkv_b``) give
    the training forward's logits at every position, each row at its own RoPE positions."""
    model = _model(_cfg(q_lora_rank=q_lora_rank))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)  # (2, 9, vocab): row 1 is fed with 3 pads in front below
        attn = model.layers["0"].attention
        assert attn.cache_dims() == (1, 24 + 8, 0)
        cache = KVCache(2, 2, 1, 9 + 3, 32, value_dim=0)
        assert cache.values is None
        ids = torch.cat([torch.zeros(2, 3, dtype=torch.long), tokens[:, :4]], dim=1)
        valid = torch.ones(2, 7, dtype=torch.bool)
        valid[1, :3] = False
        ids[0, :3] = tokens[0, :3]  # row 0: 7 real tokens
        row0 = torch.cat([tokens[0, :3], tokens[0, :4]])
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        logits = decoder_step(model, model.tok_embeddings(ids), pos, valid, cache)
        torch.testing.assert_close(logits[0], model(row0[None])[0, -1], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[1], full[1, 3], rtol=0, atol=1e-5)
        for step in range(4, 9):  # row 1 continues with its own tokens
            nxt = tokens[1, step : step + 1].repeat(2)[:, None]
            logits = decoder_step(
                model, model.tok_embeddings(nxt), pos[:, -1:] + step - 3, torch.ones(2, 1, dtype=torch.bool), cache
            )
            torch.testing.assert_close(logits[1], full[1, step], rtol=0, atol=1e-5)


def test_generate_with_cache_equals_recomputation():
    model = _model(_cfg(q_lora_rank=16))
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    s = SamplingConfig(max_new_tokens=10)
    cached, fresh = generate(model, ids, sampling=s), generate(model, ids, sampling=s, use_cache=False)
    assert torch.equal(cached.tokens, fresh.tokens)
    # Greedy continuation equals argmax of the training forward on the growing sequence.
    seq = ids
    for _ in range(10):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached.tokens, seq[:, 5:])


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_num_params_and_flops_are_exact(q_lora_rank):
    cfg = _cfg(q_lora_rank=q_lora_rank)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    attn = model.layers["0"].attention
    per_layer = sum(p.numel() for p in attn.parameters())
    n = cfg.num_params(exclude_embedding=True)
    assert cfg.flops_per_token(32) == 6 * n + 6 * 2 * 4 * (16 + 8 + 12) * 32
    assert (
        per_layer == (64 * 16 + 16 + 16 * 4 * 24 if q_lora_rank else 64 * 4 * 24) + 64 * 32 + 24 + 24 * 4 * 28 + 48 * 64
    )


def test_meta_init_covers_every_parameter_and_matches_eager():
    cfg = _cfg(q_lora_rank=16)
    eager = _model(cfg)
    with torch.device("meta"):
        meta = Transformer(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert eager.rope_cos.shape == (32, 8)


def test_packed_documents_do_not_attend_across():
    model = _model(_cfg())
    a = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    b = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    doc = torch.tensor([[0] * 5 + [1] * 6])
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), doc_ids=doc)
        torch.testing.assert_close(packed[:, :5], model(a), rtol=0, atol=1e-5)
        # RoPE scores depend on relative positions only: b at positions 5.. equals b alone.
        torch.testing.assert_close(packed[:, 5:], model(b), rtol=0, atol=1e-5)
        assert (model(torch.cat([a, b], 1))[:, 5:] - model(b)).abs().max() > 1e-3  # without the mask b sees a


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(attention="mha"), "ModelConfig.attention='mha' is not allowed"),
        (dict(kv_lora_rank=0), "ModelConfig.kv_lora_rank=0 must be >= 1 with attention='mla'"),
        (dict(qk_rope_head_dim=7), "ModelConfig.qk_rope_head_dim=7 must be even"),
        (dict(n_kv_heads=2), "ModelConfig.n_kv_heads=2 must be None or n_heads=4"),
        (dict(qk_norm=True), "ModelConfig.qk_norm=True is not allowed with attention='mla'"),
        (dict(q_lora_rank=-1), "ModelConfig.q_lora_rank=-1 must be an integer >= 0"),
        (dict(attention="gqa"), "ModelConfig.kv_lora_rank=24 is used only with attention='mla'"),
    ],
)
def test_validation_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(**kw)


def test_mla_dims_need_not_divide_dim():
    cfg = _cfg(dim=60, n_heads=8)  # 60 / 8 is not whole: MLA's head widths are explicit
    assert isinstance(Transformer(cfg).layers["0"].attention, MultiHeadLatentAttention)


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_tp_plan_names_real_modules(q_lora_rank):
    """Every key of the MLA block plan is a module of the block (apply_tp refuses unmatched keys at run time)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from kempnerforge.model.tp_plan import LatentAttentionTensorParallel

    model = _model(_cfg(q_lora_rank=q_lora_rank, num_experts=4, top_k=2, n_dense_layers=1))
    for sp in (False, True):
        plan = model.tp_plan(sequence_parallel=sp)
        for block_plan, block in ((plan.block, model.layers["0"]), (plan.moe_block, model.layers["1"])):
            names = dict(block.named_modules())
            assert set(block_plan) <= set(names), set(block_plan) - set(names)
            assert isinstance(block_plan["attention"], LatentAttentionTensorParallel)
            assert isinstance(block_plan["attention.wkv_b"], ColwiseParallel)
            assert isinstance(block_plan["attention.wo"], RowwiseParallel)
            assert isinstance(block_plan["attention.wq_b" if q_lora_rank else "attention.wq"], ColwiseParallel)
            assert not any(k.endswith(("wq_a", "wkv_a", "q_norm", "kv_norm", "wk", "wv")) for k in block_plan)


def test_flex_block_mask_with_narrower_values_equals_dense_on_cpu(monkeypatch):
    """MLA's packed-document path on the FlexAttention kernel (q/k width 24, v width 12, the MLA scale), forward on
    CPU through eager flex_attention: equal to the dense-mask SDPA path."""
    import warnings

    import kempnerforge.model.attention as attention
    from kempnerforge.model.attention import BlockMask, document_attention_mask, flex_attention

    def eager(q, k, v, block_mask, scale, enable_gqa):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": the reference path
            return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(attention, "_FLEX", [eager])
    model = _model(_cfg(q_lora_rank=16, max_seq_len=160))
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(7))
    doc = (torch.arange(150)[None] >= torch.tensor([[40], [90]])).long()
    block = document_attention_mask(doc, flex=True)
    assert isinstance(block, BlockMask)
    monkeypatch.setattr(attention, "flex_attention_supported", lambda device: True)
    with torch.no_grad():
        flex = model(ids, doc_ids=doc)
        monkeypatch.setattr(attention, "flex_attention_supported", lambda device: False)
        torch.testing.assert_close(flex, model(ids, doc_ids=doc), rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_mla_on_cuda_flex_and_bf16(monkeypatch):
    """CUDA: packed documents on the compiled FlexAttention kernel (v narrower than q/k) equal the dense-mask path in
    loss and gradients (fp32), and the bf16 SDPA kernels (is_causal) stay within bf16 rounding of fp32."""
    import kempnerforge.model.attention as attention

    cfg = _cfg(q_lora_rank=16, max_seq_len=256, num_experts=0)
    ids = torch.randint(0, 128, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    doc = (torch.arange(200, device="cuda")[None] >= torch.tensor([[60], [130]], device="cuda")).long()

    def run(flex: bool):
        monkeypatch.setattr(attention, "flex_attention_supported", lambda device: flex)
        model = Transformer(cfg).cuda()
        model.init_weights(0)
        loss = model(ids, doc_ids=doc).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (fl, fg), (dl, dg) = run(True), run(False)
    torch.testing.assert_close(fl, dl, rtol=1e-5, atol=1e-5)
    for name, g in dg.items():
        torch.testing.assert_close(fg[name], g, rtol=1e-4, atol=1e-5, msg=name)
    model = Transformer(cfg).cuda()
    model.init_weights(0)
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(ids).float()
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()


def test_vision_language_takes_mla_except_mot():
    """The VLM backbones built from the text blocks take MLA (tests/unit/test_vlm_archs.py); MoT refuses it in one line."""
    from kempnerforge.config.vlm import VLMConfig
    from kempnerforge.module import VisionLanguage

    assert VisionLanguage(config=_cfg()).vlm_config.arch == "joint_decoder"
    with pytest.raises(ValueError, match="ModelConfig.attention='mla' is not taken by vlm.arch='mot'"):
        VisionLanguage(config=_cfg(), vlm=VLMConfig(arch="mot"))


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_flops_per_token_matches_flop_counter(q_lora_rank):
    """MLA's count (6 N + 6 L H (qk + v) S) against torch's FlopCounterMode over one forward + backward (SDPA as
    explicit matmuls so attention is counted): exact once the norm gains (in N, but no matmul) are taken out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = _cfg(q_lora_rank=q_lora_rank, max_seq_len=64)
    model = _model(cfg).train()
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert counter.get_total_flops() == (cfg.flops_per_token(64) - 6 * norms) * tokens.numel()


def test_attention_probs_hook_reproduces_the_mla_output():
    """The interpretability hook (ActivationCapture) on an MLA layer: its probabilities times the per-head values,
    through ``wo``, give the layer's output."""
    from kempnerforge.model.hooks import attention_probs

    attn = _model(_cfg(q_lora_rank=16)).layers["0"].attention
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(8))
    cos, sin = rope_tables(8, 9, 10000.0)
    with torch.no_grad():
        probs = attention_probs(attn, x, cos, sin)
        _, _, v = attn.qkv(x, cos, sin)
        out = attn.wo((probs @ v.transpose(1, 2)).transpose(1, 2).reshape(2, 9, -1))
        torch.testing.assert_close(out, attn(x, cos, sin), rtol=0, atol=1e-5)
    assert probs.shape == (2, 4, 9, 9) and torch.allclose(probs.sum(-1), torch.ones(2, 4, 9))
