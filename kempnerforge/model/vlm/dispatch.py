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
    """Maps between sequence order and per-modality order for one batch, from a layout known on the host.

    The layout is a sequence of contiguous segments ``(modality id, length)`` along the sequence, the
    same in every sample (true for :func:`~kempnerforge.model.vlm.base.prefix_sequence`: ``n_visual``
    image then ``n_text`` text positions; padding is a mask, not a different count). Gathering a
    modality is slicing (views, no index tensors) and scattering is one concatenation, so a forward
    never reads anything back from the device. Inside a modality, tokens keep their sequence order.

    Built once per forward and shared by every block (a plain object: FSDP2 and activation
    checkpointing pass it through untouched).

    Args:
        segments: ``(modality, length)`` pairs in sequence order (:data:`~kempnerforge.config.vlm.TEXT` /
            :data:`~kempnerforge.config.vlm.IMAGE`); lengths >= 0.

    Attributes:
        lengths: per modality id, n_m (tokens per sample; 0 when the modality is absent).

    Raises:
        ValueError: an unknown modality id or a negative length.
    """

    def __init__(self, segments: Sequence[tuple[int, int]]) -> None:
        for m, n in segments:
            if m not in _NAMES or n < 0:
                raise ValueError(
                    f"segments must be (modality in {list(range(N_MODALITIES))} {MODALITY_NAMES}, length >= 0) "
                    f"pairs; got {list(segments)}"
                )
        self.segments = [(int(m), int(n)) for m, n in segments if n > 0]
        self.lengths: list[int] = [sum(n for m, n in self.segments if m == mod) for mod in range(N_MODALITIES)]
        self._runs: list[list[tuple[int, int]]] = [[] for _ in range(N_MODALITIES)]
        start = 0
        for m, n in self.segments:
            self._runs[m].append((start, start + n))
            start += n

    @classmethod
    def prefix(cls, n_visual: int, n_text: int) -> ModalityDispatch:
        """The layout of :func:`~kempnerforge.model.vlm.base.prefix_sequence`: ``n_visual`` image positions, then text."""
        return cls([(IMAGE, n_visual), (TEXT, n_text)])

    @classmethod
    def from_modality(cls, modality: torch.Tensor) -> ModalityDispatch:
        """The layout read from a (batch, seq) int64 tensor of modality ids, for callers that do not know it.

        Reads the tensor back on the host (three synchronizations on an accelerator): the training
        path builds its dispatch with :meth:`prefix` instead.

        Raises:
            ValueError: ``modality`` is not 2-D integer, holds an unknown id, or its samples differ.
        """
        if modality.dim() != 2 or modality.dtype.is_floating_point or modality.dtype == torch.bool:
            raise ValueError(
                f"modality must be a (batch, seq) integer tensor, got {modality.dtype} {tuple(modality.shape)}"
            )
        if bool(((modality < 0) | (modality >= N_MODALITIES)).any()):
            raise ValueError(f"modality holds ids outside {list(range(N_MODALITIES))} ({MODALITY_NAMES}).")
        if bool((modality != modality[:1]).any()):
            per_sample = torch.stack([(modality == m).sum(1) for m in range(N_MODALITIES)])
            raise ValueError(
                "every sample must hold the same number of tokens of each modality, in the same places (pad "
                f"with masks instead); got per-sample counts {per_sample.tolist()} for modalities {list(MODALITY_NAMES)}."
            )
        row = modality[0].tolist()
        segments: list[tuple[int, int]] = []
        for m in row:
            if segments and segments[-1][0] == m:
                segments[-1] = (m, segments[-1][1] + 1)
            else:
                segments.append((m, 1))
        return cls(segments)

    def gather(self, x: torch.Tensor, modality: int) -> torch.Tensor:
        """The tokens of ``modality``: x (batch, seq, *rest) -> (batch, n_m, *rest), in sequence order."""
        runs = self._runs[modality]
        if len(runs) == 1:
            return x[:, runs[0][0] : runs[0][1]]
        if not runs:
            return x[:, :0]
        return torch.cat([x[:, a:b] for a, b in runs], dim=1)

    def scatter(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`gather`: per-modality parts (batch, n_m, *rest), in modality-id order,
        back to (batch, seq, *rest) in sequence order."""
        offsets = [0] * N_MODALITIES
        pieces = []
        for m, n in self.segments:
            pieces.append(parts[m][:, offsets[m] : offsets[m] + n])
            offsets[m] += n
        # An absent modality's (batch, 0, ...) part joins the concatenation (no values) so its function's
        # parameters stay in the graph and get zero gradients on every rank.
        pieces += [part for m, part in enumerate(parts) if self.lengths[m] == 0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def apply(self, x: torch.Tensor, fns: Sequence[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
        """``out[tokens of m] = fns[m](x[tokens of m])`` for every modality m; x (batch, seq, d_in)
        -> (batch, seq, d_out). Each function also runs on an empty (batch, 0, d_in) input when its
        modality is absent, so its parameters still get (zero) gradients on every data-parallel rank."""
        if len(fns) != N_MODALITIES:
            raise ValueError(f"ModalityDispatch.apply needs one function per modality {MODALITY_NAMES}, got {len(fns)}")
        return self.scatter([fn(self.gather(x, m)) for m, fn in enumerate(fns)])
