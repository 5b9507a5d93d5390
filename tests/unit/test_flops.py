"""MFU math: FLOPs per token against a hand count and torch's FlopCounterMode (dense and MoE), peaks."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kempnerforge.config import ModelConfig
from kempnerforge.metrics import (
    device_peak_flops,
    gpu_peak_flops,
    matmul_peak,
    mfu,
    moe_active_params,
    sum_flops_per_token,
    transformer_flops_per_token,
)
from kempnerforge.model import Transformer

CFG = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "max_seq_len": 64, "multiple_of": 16}


def _counted_train_flops(model: nn.Module, tokens: torch.Tensor) -> int:
    """FLOPs torch counts for one forward + backward (SDPA as explicit bmm so attention is counted)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    return counter.get_total_flops()


def test_dense_flops_equal_hand_computation():
    cfg = ModelConfig(**CFG)
    seq = 64
    # By hand: head_dim 16; SwiGLU hidden = 16 * ceil(int(8 * 64 / 3) / 16) = 16 * ceil(170 / 16) = 176.
    attn = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # wq, wk, wv (2 KV heads of 16), wo
    mlp = 3 * 64 * 176
    block = attn + mlp + 2 * 64  # + two RMSNorm weights
    active = 2 * block + 64 + 512 * 64  # blocks, final norm, output head (the embedding lookup is no matmul)
    hand = 6 * active + 12 * 2 * 64 * seq
    assert active == 2 * 46_208 + 64 + 32_768 == 125_248 and hand == 6 * 125_248 + 98_304 == 849_792
    assert transformer_flops_per_token(active, 2, 64, seq) == hand
    assert cfg.flops_per_token(seq) == hand
    # Tied head: the head matmul still runs, so the count is unchanged.
    assert ModelConfig(**{**CFG, "tie_embeddings": True}).flops_per_token(seq) == hand


@pytest.mark.parametrize("over", [{"tie_embeddings": False}, {"tie_embeddings": True},
                                  {"head_dim": 24, "attention_bias": True}], ids=["untied", "tied", "head-dim-24-bias"])  # fmt: skip
def test_dense_flops_match_flop_counter(over):
    """The PaLM count against torch's FlopCounterMode, also for a Qwen-3-like head_dim (n_heads * head_dim != dim,
    the attention term uses n_heads * head_dim) with q/k/v biases."""
    cfg = ModelConfig(**{**CFG, **over})
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    counted = _counted_train_flops(model, tokens)
    predicted = cfg.flops_per_token(64) * tokens.numel()
    # Measured: 0.998 (the formula also counts the RMSNorm weights, which are no matmul).
    assert counted == pytest.approx(predicted, rel=0.05)
    assert counted == pytest.approx(predicted, rel=0.005)


def test_moe_active_params_on_a_synthetic_count():
    # 4 MoE layers, 8 experts of 3 * 64 * 128 = 24_576 params, top-2: 6 experts idle per layer.
    total = 1_000_000
    active = moe_active_params(total, n_moe_layers=4, num_experts=8, top_k=2, params_per_expert=24_576)
    assert active == 1_000_000 - 4 * 6 * 24_576 == 410_176
    assert transformer_flops_per_token(active, 4, 64, 128) == 6 * 410_176 + 12 * 4 * 64 * 128
    # top_k == num_experts is a dense model.
    assert moe_active_params(total, 4, 8, 8, 24_576) == total
    with pytest.raises(ValueError, match="top_k=9 must be <= num_experts=8"):
        moe_active_params(total, 4, 8, 9, 24_576)
    with pytest.raises(ValueError, match="count every expert"):
        moe_active_params(1000, 4, 8, 2, 24_576)


class _ToyMoE(nn.Module):
    """Embedding -> n_layers x (top-k routed SwiGLU experts, residual) -> head; each token runs only its
    top_k experts (gathered rows), as a real MoE does."""

    def __init__(self, vocab: int, dim: int, hidden: int, n_layers: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.emb = nn.Embedding(vocab, dim)
        self.routers = nn.ModuleList(nn.Linear(dim, num_experts, bias=False) for _ in range(n_layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(
                nn.ModuleDict(
                    {
                        "w1": nn.Linear(dim, hidden, bias=False),
                        "w3": nn.Linear(dim, hidden, bias=False),
                        "w2": nn.Linear(hidden, dim, bias=False),
                    }
                )
                for _ in range(num_experts)
            )
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).flatten(0, 1)
        for router, experts in zip(self.routers, self.experts, strict=True):
            weights, chosen = router(h).softmax(-1).topk(self.top_k, dim=-1)
            out = torch.zeros_like(h)
            for e, ex in enumerate(experts):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel():
                    x = h[rows]
                    y = ex["w2"](torch.nn.functional.silu(ex["w1"](x)) * ex["w3"](x))
                    out = out.index_add(0, rows, y * weights[rows, slot, None])
            h = h + out
        return self.head(h)


def test_moe_flops_match_flop_counter_through_active_params():
    vocab, dim, hidden, layers, experts, top_k = 256, 32, 64, 2, 8, 2
    torch.manual_seed(0)
    model = _ToyMoE(vocab, dim, hidden, layers, experts, top_k)
    total = layers * (dim * experts + experts * 3 * dim * hidden) + dim * vocab  # routers, all experts, head
    active = moe_active_params(total, layers, experts, top_k, 3 * dim * hidden)
    tokens = torch.randint(0, vocab, (4, 32))
    counted = _counted_train_flops(model, tokens)
    # No attention in the toy: the 6 * active term alone is predicted (the attention term is tested above).
    predicted = (transformer_flops_per_token(active, layers, dim, 32) - 12 * layers * dim * 32) * tokens.numel()
    assert counted == pytest.approx(predicted, rel=0.05)
    assert counted < 0.5 * 6 * total * tokens.numel()  # counting all experts would be far off


def test_sum_and_mfu():
    assert sum_flops_per_token(100, 20, 3) == 123
    assert mfu(1000.0, 6e6, 1e10) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="term 1"):
        sum_flops_per_token(1, -2)
    with pytest.raises(ValueError, match="peak_flops_per_device"):
        mfu(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="seq_len=0"):
        transformer_flops_per_token(10, 1, 8, 0)


def test_peaks():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Some Future GPU") is None
    assert device_peak_flops(torch.device("cpu"), override=5e9) == 5e9
    with pytest.raises(ValueError, match="peak_flops=-1"):
        device_peak_flops(torch.device("cpu"), override=-1)
    peak = matmul_peak(256, reps=2, rounds=1)
    assert 1e8 < peak < 1e13  # a CPU does between 0.1 GFLOP/s and 10 TFLOP/s


def test_config_active_params_equal_the_generic_moe_formula():
    # ModelConfig counts MoE layers itself; metrics.flops.moe_active_params is the formula for models
    # without a ModelConfig: both must give the same number for every MoE layout.
    from kempnerforge.metrics.flops import moe_active_params

    for kw in ({}, {"moe_frequency": 2}, {"n_shared_experts": 2, "top_k": 1}, {"expert_width_multiplier": 0.5}):
        cfg = ModelConfig(
            dim=32, n_layers=4, n_heads=4, vocab_size=97, max_seq_len=16, multiple_of=16, num_experts=8, **kw
        )
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        per_expert = 3 * cfg.dim * cfg.expert_hidden
        expected = moe_active_params(cfg.num_params(), n_moe, cfg.num_experts, cfg.top_k, per_expert)
        assert cfg.num_active_params() == expected, kw


def test_cpu_peak_is_measured_once_per_process_and_the_best_cached(tmp_path, monkeypatch):
    """One measurement per process; the cache keeps the highest (a busy measurement never lowers it); a corrupt
    or unwritable cache measures around it."""
    from kempnerforge.metrics import peak as peak_mod

    monkeypatch.setenv("KFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(peak_mod, "_MEASURED", {})
    measured = iter([1.5e11, 7.0e10, 9.0e10, 8.0e10])
    calls = []

    def fake_matmul_peak(n, reps, rounds, dtype):
        calls.append((n, reps * rounds, dtype))
        return next(measured)

    monkeypatch.setattr(peak_mod, "matmul_peak", fake_matmul_peak)
    assert peak_mod.peak_cache_path() == tmp_path / "cache" / "cpu_peak_flops.json"
    assert device_peak_flops(torch.device("cpu")) == 1.5e11
    assert device_peak_flops(torch.device("cpu")) == 1.5e11  # this process measured already
    assert calls == [(1024, 15, torch.float32)]
    entry = json.loads(peak_mod.peak_cache_path().read_text())[peak_mod.cpu_peak_key()]
    assert entry["flops"] == 1.5e11 and peak_mod.cpu_model() in peak_mod.cpu_peak_key()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert f"{threads + 1} threads" in peak_mod.cpu_peak_key()
        assert peak_mod.cpu_peak_flops() == 7.0e10  # another key: measured and added
    finally:
        torch.set_num_threads(threads)
    # A new process on a busy machine measures 9e10: the cached 1.5e11 stays (MFU is not inflated).
    monkeypatch.setattr(peak_mod, "_MEASURED", {})
    assert peak_mod.cpu_peak_flops() == 1.5e11 and len(calls) == 3
    assert peak_mod.cpu_peak_flops(cache=False) == 9.0e10
    # A stale low cache (measured under load) is raised by the next quiet measurement.
    path = peak_mod.peak_cache_path()
    path.write_text(json.dumps({peak_mod.cpu_peak_key(): {"flops": 5.0e10}}))
    monkeypatch.setattr(peak_mod, "_MEASURED", {})
    assert peak_mod.cpu_peak_flops() == 8.0e10 and len(calls) == 4
    assert json.loads(path.read_text())[peak_mod.cpu_peak_key()]["flops"] == 8.0e10
    path.write_text("{not json")
    assert peak_mod.cpu_peak_flops() == 8.0e10 and len(calls) == 4  # corrupt file: rewritten, no new measurement
    assert json.loads(path.read_text())[peak_mod.cpu_peak_key()]["flops"] == 8.0e10


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    from kempnerforge.metrics.peak import cache_dir

    monkeypatch.delenv("KFORGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kempnerforge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kempnerforge"
