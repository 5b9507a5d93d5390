"""The output head's weight gradient summed over token chunks in fp32, handed back in the weight's dtype in place.

The chunked loss (:mod:`kempnerforge.training.chunked_ce`) adds one ``g.T @ h`` per chunk into the ``(vocab, dim)``
gradient. Summing bf16 partials would round the running sum once per chunk, so the sum is fp32 (as Liger-Kernel's
``accum_dtype=torch.float32``). A separate fp32 buffer, a fresh bf16 partial per chunk and a final bf16 cast would
hold 4 + 2 + 2 bytes per weight element at once; here the partials go straight into the fp32 sum (the GEMM
accumulates into it) and, for a 2-byte weight dtype, the fp32 sum lives in two halves whose first one shares its
memory with the final gradient: at most 4 bytes per element, 2 once the gradient is handed back.

Layout for a bf16 / fp16 weight of ``(vocab, dim)``: ``home`` is the final gradient's memory (``vocab * dim``
2-byte elements); its bytes hold the fp32 rows ``[0, vocab // 2)``; the fp32 rows ``[vocab // 2, vocab)`` are a
second buffer of the same size. :meth:`HeadGradAccumulator.finish` casts the first half in row blocks, front to
back, into the front of ``home`` (block ``[i, j)`` lands on the bytes of fp32 rows ``[i / 2, j / 2)``, already
read), then the second half into the back of ``home``, and frees the second buffer.
"""

from __future__ import annotations

import torch

#: Rows of the fp32 sum cast per block in :meth:`HeadGradAccumulator.finish` are capped at this many bytes.
FINISH_BLOCK_BYTES = 64 * 2**20

_OUT_DTYPE_MM: dict[torch.device, bool] = {}


def has_out_dtype_addmm(device: torch.device) -> bool:
    """Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=torch.float32, out=fp32)`` runs on ``device`` (CUDA in torch
    2.13; the CPU build has no such kernel) and sums right. Probed once per device with 2 x 2 matrices (one host
    read of the result, once per process), then cached."""
    if device.type != "cuda":
        return False
    if device not in _OUT_DTYPE_MM:
        acc, a = torch.zeros(2, 2, device=device), torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)  # in place: 2 + 2 everywhere
            _OUT_DTYPE_MM[device] = bool((acc == 4).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[device] = False
    return _OUT_DTYPE_MM[device]


class HeadGradAccumulator:
    """Sum of ``g_k.T @ h_k`` over chunks ``k`` for a ``(vocab, dim)`` weight, in fp32, returned in the weight's dtype.

    Memory: 4 bytes per weight element while summing (one fp32 buffer for a 4-byte weight dtype, or the two halves
    of the module docstring for a 2-byte one); after :meth:`finish` the gradient alone (its dtype's size). Plus,
    where the device has no mixed-dtype GEMM (CPU), a ``(chunk, dim)`` fp32 copy of each chunk's ``h``.

    Args:
        weight: the ``(vocab, dim)`` head weight (its shape, dtype and device; its values are not read).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, dim = weight.shape
        self.dtype, self.shape, self._first = weight.dtype, (vocab, dim), True
        kw = {"device": weight.device}
        if weight.element_size() >= 4:  # fp32 / fp64: the sum is the gradient itself
            self._home = torch.empty(vocab, dim, dtype=weight.dtype, **kw)
            self._parts = [(0, vocab, self._home)]
            return
        n = vocab * dim
        self._home = torch.empty(n + n % 2, dtype=weight.dtype, **kw)  # even: its bytes view as fp32
        split = vocab // 2
        low = self._home.view(torch.float32)[: split * dim].view(split, dim)
        self._parts = [(0, split, low), (split, vocab, torch.empty(vocab - split, dim, dtype=torch.float32, **kw))]
        self._mixed_gemm = has_out_dtype_addmm(weight.device)

    def add(self, grad_logits: torch.Tensor, hidden: torch.Tensor, grad_logits_fp32: torch.Tensor | None) -> None:
        """Add ``grad_logits.T @ hidden`` (products summed in fp32, no ``(vocab, dim)`` temporary).

        Args:
            grad_logits: ``(chunk, vocab)`` in the weight's dtype (the logits' gradient as the head sees it).
            hidden: ``(chunk, dim)`` in the weight's dtype.
            grad_logits_fp32: for a 2-byte weight dtype on a device without a mixed-dtype GEMM, a ``(chunk, vocab)``
                fp32 buffer this may overwrite with ``grad_logits``' values (the chunk's fp32 logits block, no
                longer needed); else unused (None allowed).
        """
        beta = 0.0 if self._first else 1.0  # beta 0: the buffer's initial contents are never read
        self._first = False
        if len(self._parts) == 1:
            self._home.addmm_(grad_logits.t(), hidden, beta=beta)
            return
        if self._mixed_gemm:  # bf16 x bf16 products summed into fp32 by the GEMM itself
            for start, stop, acc in self._parts:
                torch.addmm(acc, grad_logits[:, start:stop].t(), hidden, beta=beta, out_dtype=torch.float32, out=acc)
            return
        # The same products in an fp32 GEMM: 2-byte values are exact in fp32 (and in TF32).
        g32 = grad_logits_fp32.copy_(grad_logits)
        h32 = hidden.float()
        for start, stop, acc in self._parts:
            acc.addmm_(g32[:, start:stop].t(), h32, beta=beta)

    def finish(self) -> torch.Tensor:
        """The ``(vocab, dim)`` gradient in the weight's dtype (zeros if nothing was added); the accumulator is spent."""
        vocab, dim = self.shape
        if self._first:
            return torch.zeros(vocab, dim, dtype=self.dtype, device=self._home.device)
        if len(self._parts) == 1:
            return self._home
        (_, split, low), (_, _, high) = self._parts
        self._parts = []
        out = self._home[: vocab * dim].view(vocab, dim)
        # Blocks of at most 1/8 of the half (and FINISH_BLOCK_BYTES): the cast's temporary stays small next to the sum.
        rows = max(1, min(FINISH_BLOCK_BYTES // (4 * dim), -(-split // 8)))
        for i in range(0, split, rows):
            j = min(i + rows, split)
            out[i:j].copy_(low[i:j].to(self.dtype))  # read whole before the write lands on fp32 rows < j
        out[split:].copy_(high)
        return out
