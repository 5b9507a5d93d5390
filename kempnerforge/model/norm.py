"""RMSNorm (Zhang & Sennrich, arXiv:1910.07467), computed in fp32."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, without bias or mean subtraction.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, computed in fp32 and cast back to the input dtype,
    so bf16 activations keep fp32 accuracy in the reduction. Matches HF ``LlamaRMSNorm`` in fp32
    (HF multiplies the weight after the cast back; we multiply in fp32, which is at least as exact).

    Args:
        dim: size of the normalized (last) dimension, channels.
        eps: added to the mean square before the reciprocal square root.

    Shapes: input (..., dim) -> output (..., dim), same dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the gain to ones (identity scale), in place."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` of shape (..., dim)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
