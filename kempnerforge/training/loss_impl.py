"""Which implementation computes the output head + cross-entropy (``model.loss_impl``), and the Liger kernel.

- ``torch``: the head module returns full ``(batch, seq, vocab)`` logits, then
  :func:`kempnerforge.training.loss.cross_entropy_sum` (the in-place-backward cross-entropy of
  :mod:`kempnerforge.training.cross_entropy`; vocab-parallel under tensor parallelism with loss parallel).
- ``chunked``: the head fused with the loss over token chunks
  (:func:`kempnerforge.training.chunked_ce.chunked_linear_cross_entropy_sum`): no logits-sized tensor at all.
- ``liger``: Liger-Kernel's Triton fused linear cross-entropy (Hsu et al., arXiv:2410.10989), CUDA only,
  ``pip install liger-kernel`` (the ``gpu`` extra). Liger reads the target count on the host in its forward and
  compares the upstream gradient with 1 in its backward: 2 host synchronizations per micro-batch that the
  other implementations do not make.
- ``auto`` (default): ``chunked`` where the model computes its own loss from its hidden states (a text
  decoder with ``tp == 1`` and ``pp == 1``), else ``torch``. Measured on CPU at vocab 50,304
  (benchmarks/loss_path.py): the chunked path is the fastest train step and holds no logits.

The fused paths read the head's weight (``output.weight``) instead of calling the head module, so they need a
plain (not vocab-sharded) weight: with ``tp > 1`` the logits path with ``loss_parallel`` is used (it never
gathers the logits either), and a pipeline's last stage computes the loss from logits
(:mod:`kempnerforge.parallel.pipeline_runner`).
"""

from __future__ import annotations

import torch

from kempnerforge.parallel.mesh import MeshConfigError

#: The values ``model.loss_impl`` accepts.
LOSS_IMPLS: tuple[str, ...] = ("auto", "torch", "chunked", "liger")
#: Implementations that fuse the head with the loss (the model computes the loss in its forward).
FUSED_IMPLS: tuple[str, ...] = ("chunked", "liger")


def validate_loss_impl(loss_impl: str, loss_chunk_size: int) -> None:
    """The module's own check of ``model.loss_impl`` and ``model.loss_chunk_size`` (no mesh needed).

    Raises:
        ValueError: ``loss_impl`` not in :data:`LOSS_IMPLS`; ``loss_chunk_size`` < 0, or > 0 with an
            implementation that has no chunks of its own size (``torch``, ``liger``).
    """
    if loss_impl not in LOSS_IMPLS:
        raise ValueError(f"model.loss_impl={loss_impl!r} is not allowed; choose one of {list(LOSS_IMPLS)}.")
    if loss_chunk_size < 0:
        raise ValueError(f"loss_chunk_size={loss_chunk_size} must be >= 0 (0: full logits, N: chunks of N tokens).")
    if loss_chunk_size and loss_impl in ("torch", "liger"):
        raise ValueError(
            f"model.loss_chunk_size={loss_chunk_size} needs model.loss_impl=chunked or auto (got {loss_impl}); "
            "set model.loss_chunk_size=0."
        )


def resolve_loss_impl(loss_impl: str, loss_chunk_size: int, *, tp: int = 1, pp: int = 1, fused_ok: bool = True) -> str:
    """The implementation a run uses: ``torch``, ``chunked`` or ``liger`` (see the module docstring).

    Args:
        loss_impl, loss_chunk_size: the module's fields (already checked by :func:`validate_loss_impl`).
        tp, pp: tensor- and pipeline-parallel degrees.
        fused_ok: False when the module's model returns logits only (vision-language backbones).

    Raises:
        MeshConfigError: an explicit fused implementation (or ``loss_chunk_size > 0``) with ``tp > 1``,
            ``pp > 1`` or a model without a fused head, naming the field.
    """
    explicit = loss_impl in FUSED_IMPLS or loss_chunk_size > 0
    if not explicit:
        return "chunked" if loss_impl == "auto" and tp == 1 and pp == 1 and fused_ok else "torch"
    impl = "chunked" if loss_impl == "auto" else loss_impl
    field = f"model.loss_chunk_size={loss_chunk_size}" if loss_chunk_size else f"model.loss_impl={impl}"
    if tp > 1:
        raise MeshConfigError(
            f"{field} needs tp=1 (got tp={tp}): with tensor parallelism the head is vocab-sharded and "
            "loss_parallel already avoids full logits; set model.loss_impl=auto and model.loss_chunk_size=0."
        )
    if pp > 1:
        raise MeshConfigError(f"{field} is not supported with pp={pp}; turn it off or use pp=1.")
    if not fused_ok:
        raise MeshConfigError(f"{field} needs a text decoder that computes its own loss; use model.loss_impl=auto.")
    return impl


def check_liger_device(device: torch.device | str) -> None:
    """``loss_impl=liger`` needs a CUDA device and liger-kernel installed.

    Raises:
        ValueError: ``device`` is not CUDA, or ``liger_kernel`` does not import.
    """
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"model.loss_impl=liger runs Liger-Kernel's Triton kernels on CUDA only (device {device}); "
            "use model.loss_impl=auto (the chunked fused loss) here."
        )
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except ImportError as err:
        raise ValueError(f"model.loss_impl=liger needs liger-kernel (pip install 'kempnerforge[gpu]'): {err}") from err


def liger_linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~kempnerforge.training.chunked_ce.chunked_linear_cross_entropy_sum` computed by Liger-Kernel's
    ``LigerFusedLinearCrossEntropyFunction`` (Triton, CUDA): same arguments (its own chunk size) and returns.

    The head weight's gradient accumulates in fp32 (``accum_dtype=torch.float32``) and is returned in the
    weight's dtype. Liger makes 2 host synchronizations per call (see the module docstring).

    Raises:
        ValueError: not on CUDA or liger-kernel missing (:func:`check_liger_device`).
    """
    check_liger_device(hidden.device)
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    loss, z_loss, _, _ = LigerFusedLinearCrossEntropyFunction.apply(
        hidden2d,
        weight,
        labels1d,
        None,  # bias
        None,  # ce_weight
        -100,  # ignore_index (kempnerforge.training.loss.IGNORE_INDEX)
        float(z_loss_weight),  # lse_square_scale: the z-loss, inside the returned loss
        0.0,  # label_smoothing
        "sum",
        None,  # softcap
        True,  # return_z_loss
        torch.float32,  # accum_dtype
    )
    z_sum = (z_loss.detach().float() / z_loss_weight) if z_loss_weight else torch.zeros((), device=hidden.device)
    return loss.float(), z_sum


def fused_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_impl: str = "chunked",
    loss_chunk_size: int = 0,
    z_loss_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output head fused with the loss: ``(loss_sum, z_sum)`` of ``hidden @ weight.T`` against ``labels``
    by the ``chunked`` (``loss_chunk_size`` tokens per chunk, 0: the default) or ``liger`` implementation.

    Args:
        hidden: ``(batch, seq, dim)`` final normed hidden states; weight: ``(vocab, dim)`` plain head weight;
        labels: ``(batch, seq)`` int64 (-100 ignored); z_loss_weight: PaLM's z-loss weight (0: off).

    Raises:
        ValueError: ``loss_impl`` not ``chunked`` / ``liger``; ``loss_chunk_size`` < 0; a vocab-sharded
            (DTensor) weight; ``liger`` off CUDA.
    """
    from torch.distributed.tensor import DTensor

    from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum

    if isinstance(weight, DTensor):
        raise ValueError(
            "the fused head + loss needs a plain head weight, got a DTensor (tensor parallel): use the logits "
            "path (model.loss_impl=auto resolves to it with tp > 1)."
        )
    if loss_chunk_size < 0:
        raise ValueError(f"loss_chunk_size={loss_chunk_size} must be >= 0 (0: the default chunk size).")
    if loss_impl == "liger" and torch.is_grad_enabled():
        return liger_linear_cross_entropy_sum(hidden, weight, labels, z_loss_weight)
    if loss_impl not in FUSED_IMPLS:
        raise ValueError(f"loss_impl={loss_impl!r} does not fuse the head with the loss; use chunked or liger.")
    # Validation under no_grad runs the chunked path for liger too: exact fp32 math, no gradient buffers.
    return chunked_linear_cross_entropy_sum(hidden, weight, labels, loss_chunk_size or None, z_loss_weight)
