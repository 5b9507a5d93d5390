"""Issue 27 item 6 on one GPU (skipped without CUDA by tests/conftest.py): the chunked loss's bf16 head gradient through
the mixed-dtype GEMM (``addmm`` with ``out_dtype=float32``, the path CPUs lack), and selective-op AC saving
FlexAttention's output in a compiled block (FlexAttention has no CPU backward in torch 2.13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from kempnerforge.parallel.activation_checkpoint import SAVED_OPS, selective_op_context_fn
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum
from kempnerforge.training.head_grad import has_out_dtype_addmm
from kempnerforge.training.loss import IGNORE_INDEX
from tests.unit.test_activation_checkpoint import recomputed_in_backward

pytestmark = pytest.mark.gpu


def test_bf16_head_gradient_is_summed_in_fp32_by_the_gemm_on_cuda():
    """As tests/unit/test_chunked_ce.py::test_bf16_head_gradient_is_summed_in_fp32_and_rounded_once, through the
    CUDA mixed-dtype GEMM: within one bf16 rounding plus the fp32 sum's error of the fp64 sum (61 one-token chunks)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert has_out_dtype_addmm(device)
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(61, 33, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(257, 33, device=device, generator=gen) * 0.3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 257, (61,), device=device, generator=gen)
    y[:3] = IGNORE_INDEX
    out, _ = chunked_linear_cross_entropy_sum(h, w, y, 1)
    out.backward()
    ok = (y != IGNORE_INDEX).float()[:, None]
    g = (torch.softmax((h @ w.t()).float(), -1) - F.one_hot(y.clamp(min=0), 257)) * ok
    g = g.to(torch.bfloat16).double()
    ref = g.t() @ h.double()
    sum_error = 61 * 2**-24 * (g.abs().t() @ h.double().abs())
    assert w.grad.dtype == torch.bfloat16
    assert ((w.grad.double() - ref).abs() <= 2**-8 * ref.abs() + sum_error).all()


def test_compiled_block_saves_flex_attention_on_cuda(monkeypatch):
    """The CPU check's partition on CUDA (no second flex forward in the backward graph), then the block compiled
    by inductor under selective_op gives the gradients of the plain block (fp32, FlexAttention's Triton kernels)."""
    assert recomputed_in_backward(monkeypatch, SAVED_OPS, "cuda") == [
        "flex_attention_backward",
        *["aten.mm.default"] * 2,
    ]
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 2, 128, 128, device="cuda")
    compiled_flex = torch.compile(flex_attention, dynamic=False)

    def block(x, w):
        q, k, v = (x @ w).view(1, 128, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.silu(compiled_flex(q, k, v, block_mask=mask))

    def checkpointed(x, w):
        return checkpoint(block, x, w, use_reentrant=False, context_fn=selective_op_context_fn)

    x = torch.randn(1, 128, 32, device="cuda", requires_grad=True)
    w = torch.randn(32, 96, device="cuda", requires_grad=True)
    block(x, w).square().sum().backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    torch.compile(checkpointed, fullgraph=True)(x, w).square().sum().backward()
    for got, ref in zip((x.grad, w.grad), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
