"""Issue 21, the loss path: the logits cross-entropy and the chunked linear-CE equal ``F.cross_entropy`` (fp32 to
1e-6, bf16 at its rounding, ignore_index rows and all-ignored batches), and neither writes the logits-sized
blocks of ``log_softmax`` + ``nll_loss`` (its zero-filled gradient): counted op by op with a dispatch mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum, default_chunk_size
from kempnerforge.training.cross_entropy import IGNORE_INDEX, softmax_cross_entropy_sum
from kempnerforge.training.loss import cross_entropy_sum

_VIEWS = {"detach", "t", "view", "_unsafe_view", "reshape", "expand", "transpose", "slice", "as_strided", "alias"}


class _BigOutputs(TorchDispatchMode):
    """Names of the out-of-place, non-view ops whose output has at least ``numel`` elements: the fresh
    logits-sized blocks written (in-place ops such as ``exp_`` reuse a block and are not counted)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _VIEWS or name.endswith("_"):
            return out
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.ops.append(name)
        return out


def _labels(n: int, vocab: int) -> torch.Tensor:
    y = torch.randint(0, vocab, (n,))
    y[:5] = IGNORE_INDEX
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_cross_entropy_equals_f_cross_entropy(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(50, 301) * 3).to(dtype).requires_grad_()
    y = _labels(50, 301)
    ref = F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
    (ref * 0.3).backward()
    g = logits.grad.clone()
    logits.grad = None
    out = softmax_cross_entropy_sum(logits, y)
    (out * 0.3).backward()
    assert out.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the gradient is rounded once, as autograd's is
    torch.testing.assert_close(logits.grad, g, rtol=tol, atol=tol * g.abs().max().item())
    assert (logits.grad[:5] == 0).all()  # ignored rows
    # (batch, seq, vocab) through the library entry point, and a batch with no target at all
    assert cross_entropy_sum(logits.detach()[None], y[None]) == pytest.approx(float(ref.detach()), rel=1e-6)
    none = torch.full((50,), IGNORE_INDEX)
    zero = softmax_cross_entropy_sum(logits, none)
    zero.backward()
    assert float(zero) == 0.0 and not logits.grad.isnan().any()
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out = softmax_cross_entropy_sum(logits, y)
        out.backward(retain_graph=True)
        out.backward()


def test_no_logits_sized_zero_fill_and_fewer_logits_sized_writes():
    """F.cross_entropy writes 3 logits-sized blocks (log-softmax, the zero-filled nll gradient, the log-softmax
    gradient); the in-place CE writes 1 (its exp, which becomes the gradient); the chunked linear-CE none."""
    torch.manual_seed(0)
    n, vocab, dim = 64, 512, 16
    h = torch.randn(n, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    y = _labels(n, vocab)

    def big_ops(loss_fn) -> list[str]:
        logits = h @ w.t()  # the head's own output is not counted
        with _BigOutputs(n * vocab) as mode:
            loss_fn(logits).backward()
        return mode.ops

    native = big_ops(lambda x: F.cross_entropy(x, y, ignore_index=IGNORE_INDEX, reduction="sum"))
    assert native == ["_log_softmax", "nll_loss_backward", "_log_softmax_backward_data"], native  # the oracle
    assert big_ops(lambda x: softmax_cross_entropy_sum(x, y)) == ["sub"]  # exp(logits - max), then in place
    with _BigOutputs(n * vocab) as mode:
        chunked_linear_cross_entropy_sum(h, w, y, 16)[0].backward()
    assert mode.ops == [], mode.ops


def test_default_chunk_size_is_twice_dim_within_the_memory_cap():
    assert default_chunk_size(50304, 2048, 256) == 512  # the CPU benchmark's shape: 98 MiB block
    assert default_chunk_size(128256, 8192, 4096) == 523  # Llama-3 8B: capped at 256 MiB
    assert default_chunk_size(1000, 10, 64) == 10  # never more than the tokens
    assert default_chunk_size(10**9, 10, 64) == 1
