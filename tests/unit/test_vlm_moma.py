"""MoMa backbone (arch ``moma``): modality-aware expert groups with per-sequence expert choice.

Oracles: a per-sample, per-expert loop written from the expert-choice definition (arXiv:2202.09368)
for the routed FFN; the rows the experts actually receive (forward hooks) against the hidden states
at image / text positions; the same batch split in two (routing per sequence); padded positions
changed (padding invariance); the dense model's weights (warm start).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model import Transformer
from kempnerforge.model.fused import split_state_dict
from kempnerforge.model.vlm import build_backbone
from kempnerforge.model.vlm.expert_choice import ExpertChoiceFFN, expert_capacity
from kempnerforge.model.vlm.moma import MoMaBackbone, MoMaBlock
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.parallel.compile import apply_compile
from kempnerforge.parallel.tensor_parallel import unmatched_plan_entries
from tests.unit.vlm_backbone_utils import grads, padding_masks, random_inputs, tiny_text_config


def _moma(cfg=None, experts: int = 3, capacity_factor: float = 1.0, seed: int = 0) -> MoMaBackbone:
    vlm = VLMConfig(arch="moma", moma_experts_per_modality=experts, moma_capacity_factor=capacity_factor)
    model = build_backbone(cfg or tiny_text_config(), vlm)
    model.init_weights(seed)
    return model


def _reference_expert_choice(ffn: ExpertChoiceFFN, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Expert choice by its definition, one sample and one expert at a time."""
    out = torch.zeros_like(x)
    e_w1, e_w2, e_w3 = ffn.experts.w1, ffn.experts.w2, ffn.experts.w3
    for b in range(x.shape[0]):
        idx = real[b].nonzero().squeeze(1)
        cap = min(len(idx), math.ceil(ffn.capacity_factor * len(idx) / ffn.num_experts))
        gates = torch.sigmoid(x[b, idx] @ ffn.router.weight.T)  # (real tokens, experts)
        for e in range(ffn.num_experts):
            chosen = idx[gates[:, e].argsort(descending=True)[:cap]]
            xe = x[b, chosen]
            y = (F.silu(xe @ e_w1[e].T) * (xe @ e_w3[e].T)) @ e_w2[e].T
            out[b, chosen] += torch.sigmoid(xe @ ffn.router.weight[e])[:, None] * y
    return out


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_expert_choice_ffn_matches_definition_and_respects_capacity(capacity_factor):
    torch.manual_seed(0)
    ffn = ExpertChoiceFFN(dim=16, hidden=24, num_experts=4, capacity_factor=capacity_factor)
    with torch.no_grad():
        for p in ffn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(3, 9, 16)
    real = torch.ones(3, 9, dtype=torch.bool)
    real[1, 6:] = False
    real[2, 2:] = False
    with torch.no_grad():
        got, want = ffn(x, real), _reference_expert_choice(ffn, x, real)
    assert (got - want).abs().max().item() < 1e-5
    route = ffn.routing
    n_real = real.sum(1)
    assert torch.equal(route.capacity, expert_capacity(n_real, capacity_factor, 4))
    for b in range(3):
        expected = min(int(n_real[b]), math.ceil(capacity_factor * int(n_real[b]) / 4))
        assert route.capacity[b] == expected
        for e in range(4):
            chosen = route.token[b, e][route.valid[b, e]]
            assert len(chosen) == expected and len(set(chosen.tolist())) == expected  # capacity, no repeats
            assert bool(real[b, chosen].all())  # padded tokens never take capacity
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))


def _is_row_of(rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """(rows,) bool: row i equals some row of ``pool`` exactly."""
    return (rows[:, None, :] == pool[None, :, :]).all(-1).any(1)


def test_image_tokens_only_reach_image_experts_and_text_only_text_experts():
    """Check 2 (MoMa): the rows each group's experts receive are hidden states of its modality only."""
    model = _moma()
    ids, visual = random_inputs(model.config)
    n_vis = visual.shape[1]
    seen: dict[str, list[torch.Tensor]] = {"normed": [], "text": [], "image": []}
    block = model.layers["1"]
    hooks = [block.ffn_norm.register_forward_hook(lambda m, i, o: seen["normed"].append(o.detach()))]
    for name in ("text", "image"):
        hook = lambda m, i, o, name=name: seen[name].append(i[0].detach())  # noqa: E731
        hooks.append(block.feed_forward[name].experts.register_forward_hook(hook))
    with torch.no_grad():
        model(ids, visual)
    for h in hooks:
        h.remove()
    normed = seen["normed"][0]
    image_rows, text_rows = normed[:, :n_vis].reshape(-1, 32), normed[:, n_vis:].reshape(-1, 32)
    for name, own, other in (("image", image_rows, text_rows), ("text", text_rows, image_rows)):
        rows = seen[name][0]
        assert rows.shape[0] > 0
        assert bool(_is_row_of(rows, own).all()), name  # each row is exactly one of its own modality's
        assert not bool(_is_row_of(rows, other).any()), name  # never another modality's
    image_route, text_route = block.feed_forward["image"].routing, block.feed_forward["text"].routing
    assert int(image_route.token.max()) < n_vis  # positions among the image tokens only
    assert torch.equal(image_route.capacity, torch.full((3,), math.ceil(n_vis / 3)))
    assert torch.equal(text_route.capacity, torch.full((3,), math.ceil(ids.shape[1] / 3)))


def test_routing_is_per_sequence_so_batch_split_does_not_matter():
    """A batch of 4 equals its two halves run apart (data parallel over 2 ranks sees the halves)."""
    model = _moma()
    ids, visual = random_inputs(model.config, batch=4)
    text_mask, visual_mask = padding_masks(4, visual.shape[1], ids.shape[1])
    with torch.no_grad():
        whole = model(ids, visual, text_mask, visual_mask)
        halves = torch.cat([model(ids[s], visual[s], text_mask[s], visual_mask[s]) for s in (slice(0, 2), slice(2, 4))])
    assert (whole - halves).abs().max().item() < 1e-6


def test_padding_never_changes_real_positions():
    """Check 4: padded text / visual tokens take no capacity and are never attended; an unmasked
    change of the same tokens changes the outputs (control)."""
    model = _moma(capacity_factor=1.0)
    ids, visual = random_inputs(model.config)
    text_mask, visual_mask = padding_masks(ids.shape[0], visual.shape[1], ids.shape[1])
    ids2 = torch.where(text_mask, ids, (ids + 17) % model.config.vocab_size)
    visual2 = torch.where(visual_mask[..., None], visual, visual + 3.0)
    with torch.no_grad():
        base = model(ids, visual, text_mask, visual_mask)
        image_route = model.layers["0"].feed_forward["image"].routing
        changed = model(ids2, visual2, text_mask, visual_mask)
        unmasked = model(ids, visual2, text_mask)
    assert torch.equal(base[text_mask], changed[text_mask])
    assert (unmasked - base)[text_mask].abs().max() > 1e-3
    # capacity from the real tokens of each sample: 5, 4, 3 real visual tokens over 3 experts
    assert image_route.capacity.tolist() == [math.ceil(n / 3) for n in visual_mask.sum(1).tolist()] == [2, 2, 1]


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_activation_checkpointing_gives_equal_grads(mode):
    model = _moma()
    ac = copy.deepcopy(model)
    assert apply_ac(ac, mode) == ["0", "1"]
    ids, visual = random_inputs(model.config)
    text_mask, visual_mask = padding_masks(ids.shape[0], visual.shape[1], ids.shape[1])
    for m in (model, ac):
        m(ids, visual, text_mask, visual_mask).square().mean().backward()
    g0, g1 = grads(model), grads(ac)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-7)
    assert any(g.abs().sum() > 0 for n, g in g0.items() if "image.experts" in n)
    assert MoMaBlock in {type(b._checkpoint_wrapped_module) for b in ac.layers.values()}


def test_warm_start_upcycles_the_dense_ffn_into_every_expert():
    cfg = tiny_text_config()
    dense = Transformer(cfg)
    dense.init_weights(seed=5)
    model = _moma(cfg, seed=1)
    router_before = model.layers["0"].feed_forward["text"].router.weight.clone()
    model.load_text_state_dict(dense.state_dict())
    block, dense_block = model.layers["0"], dense.layers["0"]
    assert torch.equal(block.attention.wqkv.weight, dense_block.attention.wqkv.weight)  # both the default fused
    assert torch.equal(model.output.weight, dense.output.weight)
    separate = split_state_dict(dense.state_dict(), cfg)  # the dense w13 holds the gate / up the experts copy
    for name in ("text", "image"):
        experts = block.feed_forward[name].experts
        for w in ("w1", "w2", "w3"):
            want = separate[f"layers.0.feed_forward.{w}.weight"]
            assert all(torch.equal(getattr(experts, w)[e], want) for e in range(3))
    assert torch.equal(block.feed_forward["text"].router.weight, router_before)  # routers keep their init
    wide = _moma(tiny_text_config(expert_width_multiplier=0.5))
    with pytest.raises(ValueError, match="expert_width_multiplier=1"):
        wide.load_text_state_dict(dense.state_dict())


def test_text_only_batch_gives_image_experts_zero_grads():
    """visual=None: the image group still runs (on no tokens), so its parameters get zero gradients and
    FSDP2 ranks with and without images reduce the same tensors."""
    model = _moma()
    ids, _ = random_inputs(model.config)
    model(ids, None).sum().backward()
    image = model.layers["0"].feed_forward["image"]
    for p in (image.router.weight, image.experts.w1, image.experts.w2):
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    assert torch.count_nonzero(model.layers["0"].feed_forward["text"].experts.w1.grad) > 0


def test_config_refusals_tp_plan_and_training_only():
    with pytest.raises(ValueError, match="num_experts=0"):
        build_backbone(tiny_text_config(num_experts=4), VLMConfig(arch="moma"))
    model = _moma(tiny_text_config(qk_norm=True))
    assert model.training_only is True
    plan = model.tp_plan(loss_parallel=False)
    assert set(plan.block) == {f"attention.{w}" for w in ("wqkv", "wo", "q_norm", "k_norm")}
    assert not unmatched_plan_entries(model.layers["0"], plan.block)
    with pytest.raises(ValueError, match="sequence_parallel"):
        model.tp_plan(sequence_parallel=True)
    with pytest.raises(ValueError, match="compile=True is not supported"):  # data-dependent expert rows
        apply_compile(model)


def test_capacity_rounds_exact_products_down_and_caps_at_real_tokens():
    # 1.1 * 90 / 3 is 33.00000000000001 in floating point: capacity 33, not 34; never more than n_real.
    assert expert_capacity(torch.tensor([90, 91, 0, 1, 2]), 1.1, 3).tolist() == [33, 34, 0, 1, 1]
    assert expert_capacity(torch.tensor([4]), 8.0, 2).tolist() == [4]
