"""The sharded init on CUDA (skipped on machines without a GPU by tests/conftest.py): it runs on the device, its
integer bits equal the CPU's exactly, and its values equal the CPU init up to erfinv's last float64 bits (at most
1 fp32 ulp, on a tiny fraction of the elements), as kempnerforge.model.init documents."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import init as kinit
from kempnerforge.model.init import param_seed, trunc_normal_init_
from kempnerforge.model.transformer import Transformer

pytestmark = pytest.mark.gpu


def test_bits_are_identical_on_cuda_and_cpu():
    key = param_seed(0, "layers.0.attention.wq.weight")
    index = torch.arange(1 << 20, dtype=torch.int64) * 4099 + (1 << 33)
    cpu = kinit._bits_(index.clone(), key, torch.empty_like(index), torch.empty_like(index))
    gpu = index.cuda()
    cuda = kinit._bits_(gpu, key, torch.empty_like(gpu), torch.empty_like(gpu))
    assert torch.equal(cuda.cpu(), cpu)


def test_cuda_init_stays_on_device_and_matches_cpu_within_one_ulp():
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, vocab_size=1000, max_seq_len=64, multiple_of=64)
    with torch.device("meta"):
        on_gpu, on_cpu = Transformer(cfg), Transformer(cfg)
    on_gpu.to_empty(device="cuda")
    on_cpu.to_empty(device="cpu")
    on_gpu.init_weights(seed=3)
    on_cpu.init_weights(seed=3)
    for (name, g), c in zip(on_gpu.named_parameters(), on_cpu.parameters(), strict=True):
        assert g.device.type == "cuda", name
        g = g.detach().cpu()
        ulp = torch.finfo(torch.float32).eps * c.detach().abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((g - c).abs() <= ulp).all(), name
        assert (g != c).float().mean().item() < 1e-3, name  # almost every element is bitwise equal


def test_bf16_parameter_on_cuda_is_the_rounded_float64_value():
    w = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    trunc_normal_init_(w, "w", 0, 0.02)
    ref = torch.empty(128, 128, device="cuda", dtype=torch.float64)
    trunc_normal_init_(ref, "w", 0, 0.02)
    assert torch.equal(w, ref.to(torch.bfloat16))
