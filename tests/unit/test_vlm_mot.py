"""Mixture-of-Transformers backbone (arch ``mot``): issue 5 checks 2 and 4 on CPU.

Oracles: the dense kempnerforge Transformer on the same joint sequence (warm start and fresh init), a
naive MoT that runs every modality's weights on all tokens and selects (the dispatch), and the same
inputs with padded positions changed (padding invariance).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.vlm import IMAGE, TEXT, VLMConfig
from kempnerforge.model import Transformer
from kempnerforge.model.attention import causal_key_mask
from kempnerforge.model.fused import split_state_dict
from kempnerforge.model.rope import apply_rope
from kempnerforge.model.vlm import build_backbone
from kempnerforge.model.vlm.dispatch import MODALITY_NAMES, ModalityDispatch
from kempnerforge.model.vlm.mot import MoTBackbone, MoTBlock
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.parallel.tensor_parallel import unmatched_plan_entries
from tests.unit.vlm_backbone_utils import dense_joint_logits, grads, padding_masks, random_inputs, tiny_text_config

MOT = VLMConfig(arch="mot")
VARIANTS = {
    "gqa": {},
    "qk_norm_tied": {"qk_norm": True, "tie_embeddings": True},
}


def _mot(cfg, seed: int = 0) -> MoTBackbone:
    model = build_backbone(cfg, MOT)
    model.init_weights(seed)
    return model


def _perturb_image_weights(model: MoTBackbone, seed: int = 1) -> None:
    """Make every image-modality weight differ from the text one (a trained MoT)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".image." in name or name.endswith(".image"):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_warm_start_equals_dense_model_on_joint_sequence(variant):
    """Every modality's weights = the text weights (load_text_state_dict): MoT = dense model on [visual; text]."""
    cfg = tiny_text_config(**VARIANTS[variant])
    dense = Transformer(cfg)
    dense.init_weights(seed=3)
    mot = _mot(cfg, seed=11)  # a different init: the warm start must overwrite every weight
    ids, visual = random_inputs(cfg)
    with torch.no_grad():
        assert (mot(ids, visual) - dense_joint_logits(dense, ids, visual)).abs().max() > 1e-3
    mot.load_text_state_dict(dense.state_dict())
    text_mask, visual_mask = padding_masks(*ids.shape[:1], visual.shape[1], ids.shape[1])
    key_mask = torch.cat([visual_mask, text_mask], dim=1)
    with torch.no_grad():
        err = (mot(ids, visual) - dense_joint_logits(dense, ids, visual)).abs().max().item()
        err_masked = (
            (mot(ids, visual, text_mask, visual_mask) - dense_joint_logits(dense, ids, visual, key_mask))[text_mask]
            .abs()
            .max()
            .item()
        )
    assert err < 1e-6 and err_masked < 1e-6, (err, err_masked)
    separate = split_state_dict(dense.state_dict(), dense.config)  # MoT keeps separate projections
    for name, p in mot.named_parameters():  # every modality holds exactly the dense weight
        dense_name = ".".join(part for part in name.split(".") if part not in MODALITY_NAMES)
        assert torch.equal(p, separate[dense_name]), name


def test_fresh_init_is_the_dense_text_model_of_the_same_seed():
    """Check 2: at init (same seed) every MoT block is exactly the text model's block."""
    cfg = tiny_text_config()
    dense = Transformer(cfg)
    dense.init_weights(seed=7)
    mot = _mot(cfg, seed=7)
    ids, visual = random_inputs(cfg)
    with torch.no_grad():
        assert torch.allclose(mot(ids, visual), dense_joint_logits(dense, ids, visual), rtol=0, atol=1e-6)
    separate = split_state_dict(dense.state_dict(), cfg)  # the default dense model is fused; MoT keeps them separate
    assert torch.equal(mot.layers["0"].attention.wq["image"].weight, separate["layers.0.attention.wq.weight"])
    assert torch.equal(mot.layers["1"].feed_forward["text"].w2.weight, dense.layers["1"].feed_forward.w2.weight)


def _naive_mot_logits(model: MoTBackbone, ids, visual, key_mask) -> torch.Tensor:
    """Every modality's weights on ALL tokens, then ``torch.where`` by modality: the dispatch's oracle."""
    n_vis = visual.shape[1]
    h = torch.cat([visual, model.tok_embeddings(ids)], dim=1)
    is_img = torch.zeros(h.shape[:2], dtype=torch.bool)
    is_img[:, :n_vis] = True

    def sel(mods, x, post=lambda t: t):
        out_t, out_i = post(mods["text"](x)), post(mods["image"](x))
        shape = (*is_img.shape, *([1] * (out_t.dim() - 2)))
        return torch.where(is_img.view(shape), out_i, out_t)

    seq = h.shape[1]
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    for block in model.layers.values():
        att = block.attention
        x = sel(block.attention_norm, h)
        heads = lambda t, hd=att.head_dim: t.view(*t.shape[:2], -1, hd)  # noqa: E731
        q, k, v = sel(att.wq, x, heads), sel(att.wk, x, heads), sel(att.wv, x, heads)
        if att.q_norm is not None:
            q, k = sel(att.q_norm, q), sel(att.k_norm, k)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        mask = causal_key_mask(key_mask) if key_mask is not None else torch.ones(seq, seq, dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        h = h + sel(att.wo, o.transpose(1, 2).reshape(*h.shape[:2], -1))
        h = h + sel(
            torch.nn.ModuleDict(
                {m: torch.nn.Sequential(block.ffn_norm[m], block.feed_forward[m]) for m in MODALITY_NAMES}
            ),
            h,
        )
    return model.output(model.norm(h[:, n_vis:]))


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_dispatch_equals_every_modality_on_all_tokens(variant):
    """Image weights act on image tokens only, text weights on text tokens only (gather/scatter exact)."""
    cfg = tiny_text_config(**VARIANTS[variant])
    mot = _mot(cfg)
    _perturb_image_weights(mot)
    ids, visual = random_inputs(cfg)
    text_mask, visual_mask = padding_masks(ids.shape[0], visual.shape[1], ids.shape[1])
    key_mask = torch.cat([visual_mask, text_mask], dim=1)
    with torch.no_grad():
        got = mot(ids, visual, text_mask, visual_mask)
        want = _naive_mot_logits(mot, ids, visual, key_mask)
    assert (got - want)[text_mask].abs().max().item() < 1e-6


def test_padding_never_changes_real_positions():
    """Check 4: changing padded text ids / padded visual tokens leaves real text logits unchanged;
    the same change at unmasked positions does change them (control)."""
    cfg = tiny_text_config()
    mot = _mot(cfg)
    _perturb_image_weights(mot)
    ids, visual = random_inputs(cfg)
    text_mask, visual_mask = padding_masks(ids.shape[0], visual.shape[1], ids.shape[1])
    ids2 = torch.where(text_mask, ids, (ids + 17) % cfg.vocab_size)
    visual2 = torch.where(visual_mask[..., None], visual, visual + 3.0)
    with torch.no_grad():
        base = mot(ids, visual, text_mask, visual_mask)
        changed = mot(ids2, visual2, text_mask, visual_mask)
        unmasked = mot(ids, visual2, text_mask)  # padded visual tokens now visible
    assert torch.equal(base[text_mask], changed[text_mask])
    assert (unmasked - base)[text_mask].abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_activation_checkpointing_gives_equal_grads(mode):
    cfg = tiny_text_config()
    mot = _mot(cfg)
    _perturb_image_weights(mot)
    ac = copy.deepcopy(mot)
    assert apply_ac(ac, mode) == ["0", "1"]
    ids, visual = random_inputs(cfg)
    text_mask, visual_mask = padding_masks(ids.shape[0], visual.shape[1], ids.shape[1])
    for model in (mot, ac):
        model(ids, visual, text_mask, visual_mask).square().mean().backward()
    g0, g1 = grads(mot), grads(ac)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-7)
    assert MoTBlock in {type(b._checkpoint_wrapped_module) for b in ac.layers.values()}


def test_meta_build_and_text_only_batch():
    """Built on meta, materialized and initialized like the strategy does: equals an eager build; a
    text-only batch (visual=None) gives image weights zero gradients (so FSDP2 ranks stay in step)."""
    cfg = tiny_text_config()
    with torch.device("meta"):
        meta = build_backbone(cfg, MOT)
    meta.to_empty(device="cpu")
    meta.tie_weights()
    meta.init_weights(0)
    eager = _mot(cfg)
    for (n, a), (_, b) in zip(meta.state_dict().items(), eager.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    ids, _ = random_inputs(cfg)
    eager(ids, None).sum().backward()
    img = eager.layers["0"].attention.wq["image"].weight.grad
    assert img is not None and torch.count_nonzero(img) == 0


def test_tp_plan_covers_every_modality_and_refuses_sequence_parallel():
    cfg = tiny_text_config(qk_norm=True)
    mot = _mot(cfg)
    plan = mot.tp_plan(loss_parallel=False)
    assert {"attention.wq.image", "attention.wo.text", "feed_forward.image.w1", "feed_forward.text.w2"} <= set(
        plan.block
    )
    assert not unmatched_plan_entries(mot.layers["0"], plan.block)
    assert not unmatched_plan_entries(mot, plan.root)
    with pytest.raises(ValueError, match="sequence_parallel"):
        mot.tp_plan(sequence_parallel=True)


def test_bad_inputs_and_configs_are_refused():
    cfg = tiny_text_config()
    mot = _mot(cfg)
    ids, visual = random_inputs(cfg, n_visual=20, n_text=13)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        mot(ids, visual)
    with pytest.raises(ValueError, match="visual must be"):
        mot(ids[:, :4], visual[:, :4, :16])
    with pytest.raises(ValueError, match="text_mask"):
        mot(ids[:, :4], visual[:, :4], text_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_experts=0"):
        build_backbone(tiny_text_config(num_experts=4), MOT)
    state = Transformer(cfg).state_dict()
    with pytest.raises(KeyError, match="missing keys \\['norm.weight'\\]"):
        mot.load_text_state_dict({k: v for k, v in state.items() if k != "norm.weight"})
    with pytest.raises(KeyError, match="unexpected keys \\['extra'\\]"):
        mot.load_text_state_dict({**state, "extra": torch.zeros(1)})


def test_dispatch_rejects_unequal_modality_counts():
    modality = torch.tensor([[IMAGE, 0, 0], [IMAGE, IMAGE, 0]])
    with pytest.raises(ValueError, match="same number of tokens"):
        ModalityDispatch.from_modality(modality)


@pytest.mark.parametrize(
    "segments", [[(IMAGE, 3), (TEXT, 4)], [(TEXT, 2), (IMAGE, 2), (TEXT, 1)], [(TEXT, 5)]], ids=str
)
def test_dispatch_from_the_host_layout_gathers_and_scatters_exactly(segments):
    """The host layout (slices) picks the same tokens as the modality ids select, in sequence order,
    and scatter inverts gather; from_modality reads the same layout back from the tensor."""
    ids = torch.tensor([m for m, n in segments for _ in range(n)]).expand(2, -1)
    x = torch.randn(2, ids.shape[1], 5)
    host, read = ModalityDispatch(segments), ModalityDispatch.from_modality(ids)
    assert host.lengths == read.lengths == [int((ids[0] == m).sum()) for m in range(len(MODALITY_NAMES))]
    parts = [host.gather(x, m) for m in range(len(MODALITY_NAMES))]
    for m, part in enumerate(parts):
        torch.testing.assert_close(part, x[:, ids[0] == m], rtol=0, atol=0)
        torch.testing.assert_close(read.gather(x, m), part, rtol=0, atol=0)
    torch.testing.assert_close(host.scatter(parts), x, rtol=0, atol=0)
