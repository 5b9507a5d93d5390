"""MoE layer checks: grouped GEMM vs per-expert loop (check 3), capacity dropping (check 6),
aux-loss-free bias (check 5, single process), dense bit-identity at num_experts 0 (check 7),
config validation and active-parameter counting."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.moe import GroupedExperts, MoE, grouped_mm, grouped_mm_supported
from kempnerforge.model.router import Router
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.training.moe_balance import MoEStepTracker


def _cfg(**kw) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, ffn_hidden_dim=16, num_experts=8,
                top_k=2)  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


# -- check 3: grouped GEMM == per-expert loop ---------------------------------------------------------


def test_grouped_mm_is_available_on_this_build():
    # The fast path is what check 3 compares; if a build lacks it the loop runs and this says so.
    assert grouped_mm_supported(torch.zeros(1))


def test_grouped_experts_match_loop_with_zero_token_experts_values_and_grads():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden=24, num_experts=6)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.tensor([3, 0, 5, 0, 0, 4])  # experts 1, 3, 4 get no tokens
    x = torch.randn(12, 16)
    g = torch.randn(12, 16)

    def run(use_grouped):
        experts.use_grouped_mm = use_grouped
        xi = x.clone().requires_grad_(True)
        out = experts(xi, counts)
        out.backward(g)
        grads = [p.grad.clone() for p in experts.parameters()]
        experts.zero_grad()
        return out.detach(), xi.grad, grads

    out_g, dx_g, dw_g = run(True)
    out_l, dx_l, dw_l = run(False)
    torch.testing.assert_close(out_g, out_l, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_l, rtol=0, atol=1e-6)
    for a, b in zip(dw_g, dw_l, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert all(float(w[[1, 3, 4]].abs().max()) == 0 for w in dw_g)  # idle experts get zero gradient
    # A naive per-row reference (the expert index repeated by counts) agrees as well.
    owner = torch.repeat_interleave(torch.arange(6), counts)
    ref = torch.stack([x[i] @ experts.w1[owner[i]].T for i in range(12)])
    torch.testing.assert_close(grouped_mm(x, experts.w1, counts), ref, rtol=0, atol=1e-5)


def test_full_moe_grouped_equals_loop_values_and_grads():
    cfg = _cfg(num_experts=16, top_k=2, n_shared_experts=1, aux_loss_weight=0.01, z_loss_weight=0.001)
    torch.manual_seed(1)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 3, cfg.dim)  # 6 tokens * 2 = 12 assignments over 16 experts: some must be idle
    results = []
    for use_grouped in (True, False):
        m = copy.deepcopy(moe)
        m.experts.use_grouped_mm = use_grouped
        out = m(x)
        (out.square().sum() + m.aux_loss).backward()
        results.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert int((m.stats.counts == 0).sum()) >= 4
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], rtol=0, atol=1e-5)


# -- check 6: capacity --------------------------------------------------------------------------------


def test_capacity_drops_exactly_the_overflow_assignments():
    # dim 8, 2 experts, top_1; the router sends token t to expert argmax(x[t, :2]).
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, vocab_size=16, max_seq_len=8, ffn_hidden_dim=8,
                      num_experts=2, top_k=1, capacity_factor=1.0)  # fmt: skip
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = moe.router.gate.weight[1, 1] = 10.0
    owner = torch.tensor([0, 0, 1, 0, 0, 0, 1, 0])  # expert 0: 6 tokens, expert 1: 2
    x = torch.randn(1, 8, 8)
    x[0, :, :2] = 0
    x[0, torch.arange(8), owner] = 1.0
    # capacity = ceil(1.0 * 8 * 1 / 2) = 4: expert 0 keeps its first 4 tokens (0, 1, 3, 4), drops 5 and 7.
    out = moe(x)[0]
    free = copy.deepcopy(moe)
    free.config = copy.replace(cfg, capacity_factor=0.0) if hasattr(copy, "replace") else _no_cap(cfg)
    ref = free(x)[0]
    kept = torch.tensor([0, 1, 2, 3, 4, 6])
    dropped = torch.tensor([5, 7])
    torch.testing.assert_close(out[kept], ref[kept], rtol=0, atol=0)
    assert float(out[dropped].detach().abs().max()) == 0.0 and float(ref[dropped].detach().abs().max()) > 0
    assert float(moe.stats.dropped) == 2.0 and moe.stats.assignments == 8
    assert moe.stats.counts.tolist() == [6.0, 2.0]  # loads are counted before dropping
    tracker = MoEStepTracker()

    class _Holder(torch.nn.Module):
        def moe_layers(self):
            return {"layers.0.moe": moe}

    tracker.collect(_Holder(), new_step=True)
    moe(x)
    tracker.collect(_Holder(), new_step=False)
    metrics = tracker.metrics(_Holder())
    assert float(metrics["moe/layers.0.moe/dropped_frac"]) == pytest.approx(4 / 16)
    assert float(metrics["moe/layers.0.moe/load_max_ratio"]) == pytest.approx(1.5)
    assert float(metrics["moe/layers.0.moe/load_min_ratio"]) == pytest.approx(0.5)


def _explicit_capacity_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Oracle: loop over tokens then slots; an assignment runs its expert only while the expert has
    capacity left (the first ``capacity`` in token order, Switch Transformer sec. 2.2)."""
    cfg = moe.config
    tokens = x.reshape(-1, cfg.dim)
    route = moe.router(tokens)
    cap = math.ceil(cfg.capacity_factor * tokens.shape[0] * cfg.top_k / cfg.num_experts)
    used = [0] * cfg.num_experts
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(cfg.dim)
        for j in range(cfg.top_k):
            e = int(route.indices[t, j])
            if used[e] < cap:
                used[e] += 1
                w1, w2, w3 = (getattr(moe.experts, n)[e] for n in ("w1", "w2", "w3"))
                h = torch.nn.functional.silu(tokens[t] @ w1.T) * (tokens[t] @ w3.T)
                acc = acc + route.weights[t, j] * (h @ w2.T)
        rows.append(acc)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_capacity_values_and_gradients_equal_an_explicit_loop(grouped):
    """The fixed-shape capacity path (dropped rows kept after the groups and masked) gives the values
    and the gradients of x, experts and router of a per-token loop that really skips them."""
    cfg = _cfg(num_experts=4, top_k=2, capacity_factor=1.0)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.experts.use_grouped_mm = grouped
    x = torch.randn(2, 6, cfg.dim, requires_grad=True)
    out = moe(x)
    assert float(moe.stats.dropped) > 0
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    gx, x.grad = x.grad.clone(), None
    moe.zero_grad()
    ref = _explicit_capacity_moe(moe, x)
    _assert_same_up_to_summation_order(out, ref, "out")
    (ref * upstream).sum().backward()
    _assert_same_up_to_summation_order(gx, x.grad, "x.grad")
    for n, p in moe.named_parameters():
        _assert_same_up_to_summation_order(grads[n], p.grad, n)


def _assert_same_up_to_summation_order(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Two fp32 computations of the same sums in other orders (grouped GEMM vs a per-token loop; MKL's AVX512
    and AVX2 kernels also order them differently) differ by rounding only: each summed term carries at most
    eps32 relative error per addition, so an element's difference is bounded by about n * eps32 * max|term|
    for n terms (here at most a few dozen tokens x expert slots). The bound used is 64 eps32 times the
    tensor's largest magnitude (about 7.6e-6 relative to it): a routing or masking error changes values by
    O(1) of that scale and still fails, while no machine's vector unit can."""
    scale = float(expected.abs().max())
    atol = 64 * torch.finfo(torch.float32).eps * max(scale, 1.0)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol, msg=name)


def _no_cap(cfg: ModelConfig) -> ModelConfig:
    out = copy.copy(cfg)
    out.capacity_factor = 0.0
    return out


def test_capacity_zero_drops_nothing():
    moe = MoE(_cfg())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe(torch.randn(2, 5, 32))
    assert float(moe.stats.dropped) == 0.0


# -- check 5: aux-loss-free bias ------------------------------------------------------------------------


def test_bias_update_moves_skewed_load_toward_uniform():
    torch.manual_seed(0)
    router = Router(dim=16, num_experts=8, top_k=2, score_func="sigmoid", renormalize=True, route_scale=1.0)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.5)
        router.gate.weight[0] += 0.3  # experts 0 and 1 favoured: the inputs have a positive mean
        router.gate.weight[1] += 0.2
    x = torch.randn(2048, 16) + 0.5

    def load():
        return torch.bincount(router(x).indices.flatten(), minlength=8).float()

    before = load()
    for _ in range(200):
        router.update_bias(load(), rate=0.01)
    after = load()
    assert float(before.max() / before.mean()) > 2.0
    assert float(after.max() / after.mean()) < 1.15
    assert float(router.expert_bias.sum().abs()) < 1e-5  # centered


def _tiny_model(**kw) -> Transformer:
    cfg = _cfg(router="sigmoid", bias_update_rate=0.05, n_layers=2, **kw)
    model = Transformer(cfg)
    model.init_weights(0)
    return model


def test_bias_is_a_buffer_in_the_state_dict_never_seen_by_the_optimizer():
    model = _tiny_model()
    names = {n for n, _ in model.named_parameters()}
    assert not any("expert_bias" in n for n in names)
    assert {"layers.0.moe.router.expert_bias", "layers.1.moe.router.expert_bias"} <= set(model.state_dict())
    # Optimizer steps (with weight decay) alone leave the bias untouched; only update_bias moves it.
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    tracker = MoEStepTracker()
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    replay = {n: torch.zeros(8) for n in model.moe_layers()}
    for _ in range(3):
        model(tokens).sum().backward()
        tracker.collect(model, new_step=True)
        loads = {n: m.stats.counts.clone() for n, m in model.moe_layers().items()}
        opt.step()
        opt.zero_grad()
        for n, m in model.moe_layers().items():
            assert torch.equal(m.router.expert_bias, replay[n])  # the optimizer step did not touch it
        tracker.finish_step(model, None, rate=0.05)
        for n in replay:  # the update rule, replayed by hand
            replay[n] = replay[n] + 0.05 * torch.sign(loads[n].mean() - loads[n])
            replay[n] -= replay[n].mean()
        for n, m in model.moe_layers().items():
            torch.testing.assert_close(m.router.expert_bias, replay[n], rtol=0, atol=1e-7)
    assert any(float(m.router.expert_bias.abs().max()) > 0 for m in model.moe_layers().values())


def test_bias_updates_once_per_optimizer_step_from_all_micro_batches():
    model = _tiny_model()
    tracker = MoEStepTracker()
    gen = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 97, (2, 16), generator=gen) for _ in range(3)]
    total = {n: torch.zeros(8) for n in model.moe_layers()}
    for i, tokens in enumerate(micro):
        model(tokens)
        tracker.collect(model, new_step=i == 0)
        for n, m in model.moe_layers().items():
            total[n] += m.stats.counts
            assert float(m.router.expert_bias.abs().max()) == 0  # no update inside the accumulation window
    expected = {}
    for n, m in model.moe_layers().items():
        ref = copy.deepcopy(m.router)
        ref.update_bias(total[n], 0.05)
        expected[n] = ref.expert_bias
    tracker.finish_step(model, None, rate=0.05)
    for n, m in model.moe_layers().items():
        torch.testing.assert_close(m.router.expert_bias, expected[n], rtol=0, atol=0)


def test_activation_checkpointing_keeps_routing_bias_and_grads_identical():
    plain = _tiny_model(aux_loss_weight=0.01, z_loss_weight=0.001, capacity_factor=1.0)
    ckpt = copy.deepcopy(plain)
    apply_ac(ckpt, "full")
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (plain, ckpt):
        tracker = MoEStepTracker()
        for _ in range(3):
            out = model(tokens)
            aux = tracker.collect(model, new_step=True)
            (out.float().square().mean() + aux).backward()
            tracker.finish_step(model, None, rate=0.05)
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
        biases = {n: m.router.expert_bias.clone() for n, m in model.moe_layers().items()}
        results.append((grads, biases))
    assert results[0][1].keys() == results[1][1].keys()
    for n in results[0][1]:
        assert torch.equal(results[0][1][n], results[1][1][n])
    assert any(float(b.abs().max()) > 0 for b in results[0][1].values())
    for n in results[0][0]:
        torch.testing.assert_close(results[0][0][n], results[1][0][n], rtol=0, atol=0)


# -- aux losses -----------------------------------------------------------------------------------


def test_aux_losses_equal_one_under_perfect_balance_and_are_not_in_state_dict():
    from kempnerforge.model.router import load_balancing_loss, sequence_balance_loss

    probs = torch.full((8, 4), 0.25)
    indices = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(load_balancing_loss(probs, torch.tensor([4, 4, 4, 4]), 2)) == pytest.approx(1.0)
    assert float(sequence_balance_loss(probs, indices, batch=2)) == pytest.approx(1.0)
    # Skewed: all tokens on expert 0 with prob 1 -> E * 1 * 1 = 4.
    skew = torch.zeros(8, 4)
    skew[:, 0] = 1
    assert float(load_balancing_loss(skew, torch.tensor([8, 0, 0, 0]), 1)) == pytest.approx(4.0)
    model = _tiny_model(aux_loss_weight=0.1)
    model(torch.randint(0, 97, (1, 8)))
    assert not any("aux" in k or "stats" in k for k in model.state_dict())


# -- check 7: num_experts 0 is the dense model ---------------------------------------------------------


def test_num_experts_zero_is_bit_identical_to_dense():
    dense_cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, multiple_of=16)
    off_cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, multiple_of=16,
                          num_experts=0, top_k=3, moe_frequency=2, router="sigmoid", aux_loss_weight=0.5,
                          z_loss_weight=0.1, capacity_factor=1.25)  # fmt: skip
    dense, off = Transformer(dense_cfg), Transformer(off_cfg)
    dense.init_weights(5)
    off.init_weights(5)
    assert list(dense.state_dict()) == list(off.state_dict())
    assert all(".moe." not in k for k in off.state_dict()) and off.moe_layers() == {}
    for k, v in dense.state_dict().items():
        assert torch.equal(v, off.state_dict()[k])
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = dense(tokens), off(tokens)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    for (n, p), (_, q) in zip(dense.named_parameters(), off.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    assert dense_cfg.num_params() == off_cfg.num_params() == off_cfg.num_active_params()
    assert dense_cfg.flops_per_token(16) == off_cfg.flops_per_token(16)


# -- config ---------------------------------------------------------------------------------------


def test_param_counts_match_the_model_and_active_counts_top_k():
    cfg = _cfg(n_layers=4, moe_frequency=2, n_shared_experts=2, shared_expert_gate=True,
               expert_width_multiplier=0.5, top_k=3)  # fmt: skip
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert sorted(model.moe_layers()) == ["layers.1.moe", "layers.3.moe"]
    assert len(model.layers["1"].moe.shared_experts) == 2  # really two experts
    per_expert = 3 * 32 * 8  # expert width int(16 * 0.5) = 8
    assert cfg.num_params() - cfg.num_active_params() == 2 * (8 - 3) * per_expert
    # Untied head: exclude_embedding keeps the head, which is a matmul every token pays.
    assert cfg.flops_per_token(16) - 12 * 4 * 32 * 16 == 6 * cfg.num_active_params(exclude_embedding=True)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_experts": -1}, "num_experts"),
        ({"top_k": 9}, "top_k=9 must be <= num_experts=8"),
        ({"top_k": 0}, "top_k"),
        ({"moe_frequency": 3}, "moe_frequency=3 leaves no MoE layer"),
        ({"router": "relu"}, "router='relu' is not allowed"),
        ({"bias_update_rate": 0.1}, "bias_update_rate=0.1 needs router='sigmoid'"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"aux_loss_weight": -0.1}, "aux_loss_weight"),
        ({"expert_width_multiplier": 0.01}, "expert width"),
        ({"shared_expert_gate": True}, "shared_expert_gate=True needs n_shared_experts"),
        ({"route_scale": 0.0}, "route_scale"),
    ],
)
def test_config_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_expert_width_multiplier_sets_fine_grained_width():
    assert _cfg(expert_width_multiplier=0.25).expert_hidden == 4
    assert math.isclose(_cfg().expert_hidden, 16)


def test_activation_checkpointing_recompute_reuses_the_saved_routing():
    """Change the selection bias between forward and backward: the checkpointed model's recomputation
    must still route as its forward did (grads equal the non-checkpointed model's)."""
    plain = _tiny_model(aux_loss_weight=0.01)
    ckpt = copy.deepcopy(plain)
    apply_ac(ckpt, "full")
    assert all(m.save_routing for m in ckpt.moe_layers().values())
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    grads = []
    for model in (plain, ckpt):
        out = model(tokens)
        aux = MoEStepTracker().collect(model, new_step=True)
        for m in model.moe_layers().values():  # would reroute most tokens if the recompute re-selected
            m.router.expert_bias.copy_(torch.linspace(-5, 5, 8))
        (out.square().mean() + aux).backward()
        grads.append({n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=0)
    assert all(not m._saved_indices for m in ckpt.moe_layers().values())  # consumed by the recompute
