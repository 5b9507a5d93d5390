"""VLM backbones: cross-attention is the text model at init (check 2), padding never changes real outputs
(check 4, every registered arch), the wrapper's FQNs / init / TP plan, and length validation."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.errors import UserError
from kempnerforge.model import Transformer
from kempnerforge.model.vlm import ARCHS, build_backbone
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.module import VisionLanguage, check_vlm_lengths
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.training.freeze import FreezeSpec
from kempnerforge.training.loss import token_cross_entropy_sum
from tests.vlm_tiny import tiny_connector, tiny_encoder, tiny_mla_moe_text, tiny_text, tiny_vlm

ARCH_NAMES = sorted(ARCHS)


def _text_model(seed: int = 3, text: ModelConfig | None = None) -> Transformer:
    model = Transformer(text or tiny_text())
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("n_kv", [None, 2, 1], ids=["mha", "gqa2", "gqa1"])
@pytest.mark.parametrize("every", [1, 2])
def test_cross_attention_equals_the_text_model_at_init(n_kv, every):
    backbone = build_backbone(
        tiny_text(), tiny_vlm("cross_attention", cross_attn_n_kv_heads=n_kv, cross_attn_every=every)
    )
    backbone.init_weights(3)
    assert backbone.cross_layers == list(range(0, 2, every))
    ids = torch.randint(0, 128, (2, 10))
    visual = torch.randn(2, 6, 32)
    expected = _text_model(3)(ids)
    torch.testing.assert_close(backbone(ids, visual), expected, rtol=0, atol=0)
    # The cross blocks are live: opening a gate changes the output.
    with torch.no_grad():
        backbone.layers["0"].cross_attention_gate.fill_(0.5)
    assert not torch.allclose(backbone(ids, visual), expected)


@pytest.mark.parametrize("mla_moe", [False, True], ids=["gqa", "mla_moe"])
def test_joint_decoder_without_images_is_the_text_model(mla_moe):
    """Also with MLA + MoE blocks (issue 32 item 2): the same blocks, RoPE tables (qk_rope_head_dim wide), init and
    FQNs as the text Transformer."""
    text = tiny_mla_moe_text() if mla_moe else tiny_text()
    backbone = build_backbone(text, tiny_vlm("joint_decoder"))
    backbone.init_weights(3)
    ids = torch.randint(0, 128, (2, 10))
    torch.testing.assert_close(backbone(ids, None), _text_model(3, text)(ids), rtol=0, atol=0)
    assert set(backbone.state_dict()) == set(_text_model(3, text).state_dict())


@pytest.mark.parametrize("num_experts", [0, 4])
def test_mla_cross_attention_and_moma_start_as_the_text_model(num_experts):
    """Issue 32 item 2: with MLA (and MoE) text blocks, cross_attention is the text model at init whatever the images;
    MoMa's shared attention is the text model's MLA (its blocks' attention holds the same weights as the text
    model's under the same seed)."""
    text = tiny_mla_moe_text(num_experts=num_experts)
    cross = build_backbone(text, tiny_vlm("cross_attention"))
    cross.init_weights(3)
    ids = torch.randint(0, 128, (2, 10))
    torch.testing.assert_close(cross(ids, torch.randn(2, 6, 32)), _text_model(3, text)(ids), rtol=0, atol=0)
    if num_experts == 0:
        moma = build_backbone(text, tiny_vlm("moma"))
        moma.init_weights(3)
        dense = _text_model(3, text).state_dict()
        attention = {k: v for k, v in moma.state_dict().items() if ".attention." in k}
        assert {k.split(".")[-2] for k in attention} == {"wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo"}
        for k, v in attention.items():
            torch.testing.assert_close(v, dense[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention"])
def test_load_text_state_dict_copies_a_dense_checkpoint(arch):
    text = _text_model(7)
    backbone = build_backbone(tiny_text(), tiny_vlm(arch))
    backbone.init_weights(0)
    backbone.load_text_state_dict(text.state_dict())
    ids = torch.randint(0, 128, (1, 8))
    visual = None if arch == "joint_decoder" else torch.randn(1, 4, 32)  # zero gates: images add nothing yet
    torch.testing.assert_close(backbone(ids, visual), text(ids), rtol=0, atol=1e-6)
    with pytest.raises(KeyError, match="missing keys"):
        backbone.load_text_state_dict({k: v for k, v in text.state_dict().items() if k != "norm.weight"})


def _vlm(arch: str, seed: int = 0) -> VisionLanguageModel:
    torch.manual_seed(0)
    model = VisionLanguageModel(tiny_text(), tiny_vlm(arch), tiny_encoder(), tiny_connector())
    model.init_weights(seed)
    if arch == "cross_attention":  # open the gates: otherwise images could not influence anything
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_gate"):
                    p.fill_(0.7)
    return model


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_padding_never_changes_real_outputs_or_loss(arch):
    """Check 4: right-padded text and padded visual tokens change nothing at real text positions."""
    model = _vlm(arch).eval()
    pixels = torch.randn(2, 3, 32, 32)
    ids = torch.randint(0, 128, (2, 12))
    lengths = [12, 7]
    text_mask = torch.arange(12)[None] < torch.tensor(lengths)[:, None]
    labels = torch.where(text_mask, torch.randint(0, 128, (2, 12)), -100)
    out = model(ids, pixels, text_mask)
    # Other values at the padded text positions: same outputs at real ones, same loss.
    ids2 = torch.where(text_mask, ids, torch.randint(0, 128, (2, 12)))
    out2 = model(ids2, pixels, text_mask)
    torch.testing.assert_close(out2[text_mask], out[text_mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(token_cross_entropy_sum(out2, labels)[0], token_cross_entropy_sum(out, labels)[0])
    # Sample 1 alone, unpadded, equals its padded row.
    alone = model(ids[1:, :7], pixels[1:])
    torch.testing.assert_close(out[1, :7], alone[0], rtol=0, atol=1e-5)
    # Padded visual tokens: their values never reach real positions.
    backbone, visual = model.backbone, model.visual_tokens(pixels)
    visual_mask = torch.ones(2, visual.shape[1], dtype=torch.bool)
    visual_mask[:, -2:] = False
    noisy = visual.clone()
    noisy[:, -2:] = 100 * torch.randn_like(noisy[:, -2:])
    a = backbone(ids, visual, text_mask, visual_mask)
    b = backbone(ids, noisy, text_mask, visual_mask)
    torch.testing.assert_close(a[text_mask], b[text_mask], rtol=0, atol=1e-5)
    # ... while real visual tokens do matter.
    assert not torch.allclose(
        backbone(ids, visual + 1, text_mask)[text_mask], backbone(ids, visual, text_mask)[text_mask]
    )


def test_cross_attention_sample_without_real_visual_tokens_is_finite_and_text_only():
    backbone = build_backbone(tiny_text(), tiny_vlm("cross_attention"))
    backbone.init_weights(0)
    ids = torch.randint(0, 128, (1, 6))
    out = backbone(ids, torch.randn(1, 4, 32), visual_mask=torch.zeros(1, 4, dtype=torch.bool))
    assert torch.isfinite(out).all()


def test_wrapper_state_tree_init_and_tp_plan():
    model = _vlm("joint_decoder")
    keys = set(model.state_dict())
    assert {k.split(".")[0] for k in keys} == {"encoder", "connector", "backbone"}
    # Meta build + to_empty + init_weights == eager build + init_weights (weights are never lost to meta).
    with torch.device("meta"):
        meta = VisionLanguageModel(tiny_text(), tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
    meta.to_empty(device="cpu")
    meta.tie_weights()
    meta.init_weights(0)
    eager = VisionLanguageModel(tiny_text(), tiny_vlm("joint_decoder"), tiny_encoder(), tiny_connector())
    eager.init_weights(0)
    for (n, a), (_, b) in zip(meta.state_dict().items(), eager.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    plan = model.tp_plan()
    assert "backbone.tok_embeddings" in plan.root and "attention.wqkv" in plan.block
    assert model.layers is model.backbone.layers
    units = model.fsdp_units()
    assert units[-1] is model.connector and units[-2] is model.encoder and len(units) == 2 + 2


@pytest.mark.parametrize(
    ("arch", "n_text", "ok"),
    [("joint_decoder", 48, True), ("joint_decoder", 49, False), ("cross_attention", 64, True)],
)
def test_max_seq_len_covers_visual_and_text_per_arch(arch, n_text, ok):
    text = tiny_text(max_seq_len=64)
    if ok:
        check_vlm_lengths(text, tiny_vlm(arch), 16, n_text)
    else:
        with pytest.raises(ValueError, match=r"sees 65 positions \(16 visual \+ 49 text.*max_seq_len=64"):
            check_vlm_lengths(text, tiny_vlm(arch), 16, n_text)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tp_plan_matches_every_module_of_the_wrapper(arch):
    """The wrapper's TP plan (backbone root entries under ``backbone.``, cross blocks by full path) matches
    real modules, so apply_tp would not refuse it or silently skip a block."""
    from kempnerforge.parallel.tensor_parallel import unmatched_plan_entries

    with torch.device("meta"):
        model = VisionLanguageModel(tiny_text(), tiny_vlm(arch, cross_attn_every=2), tiny_encoder(), tiny_connector())
    plan = model.tp_plan()
    assert unmatched_plan_entries(model, plan.root) == []
    for block in model.layers.values():
        assert unmatched_plan_entries(block, plan.block) == []


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention", "moma"])
def test_tp_plan_covers_mla_and_moe_blocks(arch):
    """Issue 32 item 2: with MLA (every arch but mot) and MoE layers (joint_decoder, cross_attention) the wrapper's plan
    holds the text path's entries (MLA's heads split, ``LatentAttentionTensorParallel`` on the attention; the MoE
    blocks' ``moe_block`` plan: expert-TP, shared experts column/row-wise), and every entry matches a module."""
    from kempnerforge.parallel.tensor_parallel import unmatched_plan_entries

    text = tiny_mla_moe_text(num_experts=0 if arch == "moma" else 4)
    with torch.device("meta"):
        model = VisionLanguageModel(text, tiny_vlm(arch, cross_attn_every=2), tiny_encoder(), tiny_connector())
    plan = model.tp_plan()
    assert unmatched_plan_entries(model, plan.root) == []
    block_plan = plan.moe_block if text.num_experts else plan.block
    assert {"attention", "attention.wq_b", "attention.wkv_b", "attention.wo"} <= set(block_plan)
    if text.num_experts:
        assert {"moe", "moe.experts", "moe.shared_experts.0.w1"} <= set(block_plan)
        assert set(model.moe_layers()) == {"layers.0.moe", "layers.1.moe"}
    for block in model.layers.values():
        assert unmatched_plan_entries(block, block_plan) == []


def _module(arch: str, **text) -> VisionLanguage:
    return VisionLanguage(config=tiny_text(**text), vlm=tiny_vlm(arch), encoder=tiny_encoder())


def test_moma_with_decoder_moe_or_ep_is_refused():
    moe = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=128, num_experts=4, top_k=2)
    with pytest.raises(UserError, match=r"num_experts=4 is not taken by vlm.arch='moma', which has its own") as e:
        VisionLanguage(config=moe, vlm=tiny_vlm("moma"), encoder=tiny_encoder())
    assert e.value.field == "model.config.num_experts"
    with pytest.raises(MeshConfigError, match=r"got num_experts=0, ep=2"):
        _module("moma").validate_parallel(ParallelDims(dp_shard=2, ep=2, world_size=2))
    _module("joint_decoder").validate_parallel(ParallelDims(world_size=1))  # the other archs pass


def test_mot_refuses_mla_and_moe_in_one_line():
    """Issue 32 item 2: MoT unties GQA projections and a dense FFN per modality; each refusal names its field."""
    for text, field, match in (
        (
            tiny_mla_moe_text(num_experts=0),
            "model.config.attention",
            r"^ModelConfig.attention='mla' is not taken by vlm",
        ),
        (ModelConfig(**{**tiny_text().__dict__, "num_experts": 4}), "model.config.num_experts", r"a dense FFN per"),
    ):
        with pytest.raises(UserError, match=match) as err:
            VisionLanguage(config=text, vlm=tiny_vlm("mot"), encoder=tiny_encoder())
        assert err.value.field == field


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention"])
def test_vlm_with_mla_moe_passes_tp_and_ep_validation(arch):
    """Issue 32 item 2: MoE VLM backbones take tp > 1 (the text path's expert-TP plan) and ep, as CausalLM."""
    module = VisionLanguage(config=tiny_mla_moe_text(), vlm=tiny_vlm(arch), encoder=tiny_encoder())
    module.validate_parallel(ParallelDims(tp=2, world_size=2))
    module.validate_parallel(ParallelDims(dp_shard=2, ep=2, world_size=2))
    module.validate_parallel(ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4))
    # the same validation still refuses what the backbone cannot split (so the accepted cases above are decided,
    # not skipped): 4 experts over ep=8, 4 heads over tp=3
    with pytest.raises(ValueError, match=r"num_experts=4 must be divisible by ep=8"):
        module.validate_parallel(ParallelDims(dp_shard=8, ep=8, world_size=8))
    with pytest.raises(ValueError, match=r"tp=3 must divide n_heads=4"):
        module.validate_parallel(ParallelDims(tp=3, world_size=3))


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_fused_chunked_loss_equals_the_logits_loss_and_its_gradients(arch):
    """Issue 32, the text path's fused head + loss on every backbone: the ``chunked`` loss over 5-token chunks
    (text positions only; padded labels ignored) equals the full-logits cross-entropy, value and every gradient;
    ``loss_impl=auto`` picks it at tp=1, pp=1 as for text, and ``torch`` under tp=2."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 9))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[1, 5:] = -100
    batch = {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(2, 3, 32, 32)}
    out = {}
    for impl, chunk in (("torch", 0), ("chunked", 5)):
        module = VisionLanguage(config=tiny_text(), vlm=tiny_vlm(arch), encoder=tiny_encoder(), loss_impl=impl,
                                loss_chunk_size=chunk, freeze=FreezeSpec(encoder=False))  # fmt: skip
        module.configure_model()
        if impl == "torch":
            loss_sum, _ = token_cross_entropy_sum(module._logits(batch), labels)
        else:
            loss_sum, _ = module._fused_loss(batch, 0.0, "chunked")
        loss_sum.backward()
        out[impl] = loss_sum.detach(), {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    (want, want_grads), (got, got_grads) = out["torch"], out["chunked"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    auto = VisionLanguage(config=tiny_text(), vlm=tiny_vlm(arch), encoder=tiny_encoder())
    assert auto.resolved_loss_impl == "chunked"
    auto.validate_parallel(ParallelDims(tp=2, world_size=2))
    assert auto.resolved_loss_impl == "torch"


def test_vlm_module_refuses_what_it_does_not_support():
    vlm = VisionLanguage(
        config=tiny_text(), vlm=tiny_vlm("cross_attention", cross_attn_n_kv_heads=1), encoder=tiny_encoder()
    )
    with pytest.raises(MeshConfigError, match=r"tp=2 must divide vlm.cross_attn_n_kv_heads=1"):
        vlm.validate_parallel(ParallelDims(dp_shard=1, tp=2, world_size=2))
    assert _module("joint_decoder").n_visual() == 16
