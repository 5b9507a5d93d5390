"""The grouped GEMM as a custom op, so ``torch.compile`` can trace it for dtypes other than bf16.

torch 2.13's fake (meta) kernel of ``aten._grouped_mm`` copies the CUDA kernel's old checks and accepts bf16
inputs only, although the eager kernels (CPU, and CUDA's fallback) run fp32 too: tracing an fp32 MoE block
fails in fake-tensor propagation. torchtitan avoids it by casting the experts' inputs to bf16; that would
change fp32 numerics, so here the fp32 (and fp16) grouped GEMM is wrapped in :func:`torch.library.custom_op`
with its own shape rule and a backward written with the same op. The graph calls the eager kernel as an
opaque node (no graph break); bf16 keeps the native op, whose meta kernel works and which inductor lowers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NATIVE = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("kempnerforge::grouped_mm", mutates_args=())
def grouped_mm_op(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[g] = x[g] @ w_t[e]`` for the row groups ``g`` ending at ``offs``.

    Shapes: x (rows, in), w_t (experts, in, out), offs (experts,) int32 cumulative row ends -> (rows, out);
    rows after ``offs[-1]`` belong to no expert (their output rows are unspecified, as the native op's).
    """
    return _NATIVE(x, w_t, offs=offs)


@grouped_mm_op.register_fake
def _(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_t.shape[-1])


@torch.library.custom_op("kempnerforge::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad_op(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Weight gradient of :func:`grouped_mm_op`: ``dw_t[e] = x[g_e].T @ grad[g_e]`` (rows after ``offs[-1]``
    ignored). Shapes: x (rows, in), grad (rows, out), offs (experts,) -> (experts, in, out)."""
    # Computed as (experts, out, in), the parameter's layout, so the gradient reaching it is contiguous.
    return _NATIVE(grad.t(), x, offs=offs).transpose(-2, -1)


@grouped_mm_wgrad_op.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.shape[0], grad.shape[1], x.shape[1]).transpose(-2, -1)  # the real op's strides


def _setup_context(ctx, inputs, output) -> None:
    x, w_t, offs = inputs
    ctx.save_for_backward(x, w_t, offs)


def _backward(ctx, grad: torch.Tensor):
    x, w_t, offs = ctx.saved_tensors
    grad = grad.contiguous()  # the CPU kernel rejects expanded (stride-0) gradients
    dx = grouped_mm_op(grad, w_t.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_wgrad_op(x, grad, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
