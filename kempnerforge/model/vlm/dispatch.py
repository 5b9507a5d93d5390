"""Per-modality dispatch along the sequence: gather each modality's tokens, run its own weights, scatter back.

Modality-aware backbones (MoT, arXiv:2411.04996; MoMa, arXiv:2407.21770) give every modality its own
projections / norms / FFN. Running every modality's weights on all tokens and selecting afterwards
would multiply the compute by the number of modalities; instead :class:`ModalityDispatch` gathers
the tokens of one modality into a dense ``(batch, n_m, ...)`` tensor, the modality's module runs on
those only, and the results are put back in sequence order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kempnerforge.config.vlm import IMAGE, N_MODALITIES, TEXT

_NAMES = {TEXT: "text", IMAGE: "image"}
#: Module name of each modality id (index = id): per-modality weights live under these keys.
MODALITY_NAMES: tuple[str, ...] = tuple(_NAMES[i] for i in range(N_MODALITIES))


class ModalityDispatch:
    """Index maps between sequence order and per-modality order for one batch.

    Every sample must hold the same number of tokens of each modality (true for
    :func:`~kempnerforge.model.vlm.base.prefix_sequence`: ``n_visual`` image then ``n_text`` text
    positions; padding is a mask, not a different count). Inside a modality, tokens keep their
    sequence order.

    Built once per forward and shared by every block (a plain object, not a dataclass: FSDP2 and
    activation checkpointing pass it through untouched).

    Args:
        modality: (batch, seq) int64 modality ids (:data:`~kempnerforge.config.vlm.TEXT` /
            :data:`~kempnerforge.config.vlm.IMAGE`).

    Attributes:
        index: per modality id, (batch, n_m) int64 sequence positions of that modality's tokens.
        lengths: per modality id, n_m (tokens per sample; 0 when the modality is absent).

    Raises:
        ValueError: ``modality`` is not 2-D integer, holds an unknown id, or samples differ in how
            many tokens of a modality they hold.
    """

    def __init__(self, modality: torch.Tensor) -> None:
        if modality.dim() != 2 or modality.dtype.is_floating_point or modality.dtype == torch.bool:
            raise ValueError(
                f"modality must be a (batch, seq) integer tensor, got {modality.dtype} {tuple(modality.shape)}"
            )
        per_sample = torch.stack([(modality == m).sum(1) for m in range(N_MODALITIES)])  # (modalities, batch)
        if int(per_sample.sum(0).min()) != modality.shape[1]:
            raise ValueError(f"modality holds ids outside {list(range(N_MODALITIES))} ({MODALITY_NAMES}).")
        if bool((per_sample != per_sample[:, :1]).any()):
            raise ValueError(
                "every sample must hold the same number of tokens of each modality (pad with masks instead); "
                f"got per-sample counts {per_sample.tolist()} for modalities {list(MODALITY_NAMES)}."
            )
        self.lengths: list[int] = per_sample[:, 0].tolist()
        # Stable sort by modality id: text positions, then image positions, each in sequence order.
        order = torch.argsort(modality, dim=1, stable=True)
        self.index: list[torch.Tensor] = list(order.split(self.lengths, dim=1))
        self._inverse = torch.argsort(order, dim=1)

    def gather(self, x: torch.Tensor, modality: int) -> torch.Tensor:
        """The tokens of ``modality``: x (batch, seq, *rest) -> (batch, n_m, *rest), in sequence order."""
        idx = self.index[modality]
        return torch.gather(x, 1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))

    def scatter(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`gather`: per-modality parts (batch, n_m, *rest), in modality-id order,
        back to (batch, seq, *rest) in sequence order."""
        joined = torch.cat(list(parts), dim=1)
        inv = self._inverse
        return torch.gather(joined, 1, inv.view(*inv.shape, *([1] * (joined.dim() - 2))).expand_as(joined))

    def apply(self, x: torch.Tensor, fns: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """``out[tokens of m] = fns[m](x[tokens of m])`` for every modality m; x (batch, seq, d_in)
        -> (batch, seq, d_out). Each function also runs on an empty (batch, 0, d_in) input when its
        modality is absent, so its parameters still get (zero) gradients on every data-parallel rank."""
        if len(fns) != N_MODALITIES:
            raise ValueError(f"ModalityDispatch.apply needs one function per modality {MODALITY_NAMES}, got {len(fns)}")
        return self.scatter([fn(self.gather(x, m)) for m, fn in enumerate(fns)])
