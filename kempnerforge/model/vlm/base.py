"""The contract every vision-language architecture implements, and its registry.

A VLM is ``encoder -> connector -> backbone``. The encoder and connector turn pixels into visual
tokens already ``dim`` wide (the text width); the backbone (one class per ``VLMConfig.arch``) owns
the token embedding, its blocks, the final norm and the output head, and decides where the visual
tokens go. The strategy treats a backbone like the dense :class:`~kempnerforge.model.Transformer`:
``layers`` are its blocks (TP plan per block, activation checkpointing, FSDP2 units), and
``init_weights(seed)`` is its only init.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import IMAGE, TEXT, VLM_ARCHS, VLMConfig
from kempnerforge.model.tp_plan import TPPlan

#: arch name -> backbone class; filled by :func:`register_arch`.
ARCHS: dict[str, type[VLMBackbone]] = {}

#: Key fragments of weights a VLM backbone adds to the text model (not in a text checkpoint: they keep their init).
NEW_KEY_PARTS: tuple[str, ...] = (".cross_",)


def is_new_key(fqn: str) -> bool:
    """Whether ``fqn`` names a weight the VLM adds to the text model (:data:`NEW_KEY_PARTS`)."""
    return any(part in fqn for part in NEW_KEY_PARTS)


class VLMBackbone(nn.Module, abc.ABC):
    """Base class of the text backbones that take visual tokens.

    Subclasses set ``layers`` (``nn.ModuleDict`` of blocks, the units of AC / FSDP2 / TP) and
    implement every method below. Built on the meta device like the dense decoder: the constructor
    does not produce meaningful weights, :meth:`init_weights` does.

    Shapes of :meth:`forward`:
        input_ids (batch, text) int64; visual (batch, n_visual, dim) or None (a text-only batch);
        text_mask (batch, text) bool, True at real tokens (right padding), or None (no padding);
        visual_mask (batch, n_visual) bool, True at real visual tokens (padded video frames are
        False), or None. Returns logits (batch, text, vocab_size): ``logits[:, t]`` predicts the
        text token after ``input_ids[:, t]``. Outputs at real text positions never depend on
        padded positions (text or visual).
    """

    layers: nn.ModuleDict
    #: A Hugging Face ``save_pretrained`` folder of the text model (``model.init_from``): :meth:`init_weights` reads
    #: each parameter's shard from it (:meth:`load_init_from_`); None: random init.
    init_from: str | None = None
    #: Tensor-parallel ranks the sequence is split over with sequence parallelism (1: off; joint_decoder only), set
    #: by the module before the transform chain (:meth:`kempnerforge.module.VisionLanguage.configure_model`).
    sequence_parallel_degree: int = 1

    def __init__(self, text: ModelConfig, vlm: VLMConfig) -> None:
        super().__init__()
        self.config = text
        self.vlm_config = vlm

    def text_key(self, fqn: str) -> str | None:
        """The dense :class:`~kempnerforge.model.Transformer` parameter (canonical FQN) that parameter ``fqn`` starts
        from in a warm start, or None to keep its init (the weights the VLM adds: :data:`NEW_KEY_PARTS`)."""
        return None if is_new_key(fqn) else fqn

    def text_copies(self, fqn: str) -> int:
        """How many copies of :meth:`text_key`'s tensor parameter ``fqn`` stacks along a new dim 0 (MoMa's expert
        groups, each expert a copy of the dense FFN); 0: the tensor itself."""
        return 0

    @torch.no_grad()
    def load_init_from_(self) -> set[int]:
        """With :attr:`init_from`, read every parameter that has a :meth:`text_key` from the folder, each rank only
        the elements it stores (:func:`~kempnerforge.checkpoint.hf_load.load_hf_weights_`); the ids filled (empty
        without a folder). The caller initializes the rest.

        Raises:
            KeyError, ValueError: see :func:`~kempnerforge.checkpoint.hf_load.load_hf_weights_`.
        """
        if self.init_from is None:
            return set()
        from kempnerforge.checkpoint.hf_load import load_hf_weights_

        return load_hf_weights_(self, self.init_from, self.config, text_key=self.text_key, copies=self.text_copies)

    @abc.abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        visual: torch.Tensor | None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **loss: Any,
    ) -> Any:
        """Text logits (batch, text, vocab_size) given text ids and visual tokens (shapes above); with ``labels``
        (batch, text) the fused head + loss's ``(loss_sum, z_sum)`` instead (:meth:`head`)."""

    def head(self, h: torch.Tensor, text: slice, labels: torch.Tensor | None = None, **loss: Any) -> Any:
        """The final norm, then the output head on the text positions ``h[:, text]`` of the hidden states ``h``
        (batch, seq, dim): logits (batch, n_text, vocab_size), or with ``labels`` (batch, n_text) the head fused
        with the loss, ``(loss_sum, z_sum)`` (fp32 scalars, nats; ``loss``: ``loss_impl``, ``loss_chunk_size``,
        ``z_loss_weight`` of :func:`~kempnerforge.training.loss_impl.fused_head_loss`), so no logits-sized tensor
        exists. Under sequence parallelism ``h`` is this rank's shard, which the norm's input style gathers, so the
        text positions are taken after the norm; otherwise before it. Under FSDP2 the norm gathers the
        ``[norm, output]`` unit, whose head weight the fused loss then reads."""
        normed = self.norm(h)[:, text] if self.sequence_parallel_degree > 1 else self.norm(h[:, text])
        if labels is None:
            return self.output(normed)
        from kempnerforge.training.loss_impl import fused_head_loss

        return fused_head_loss(normed, self.output.weight, labels, **loss)

    @abc.abstractmethod
    def init_weights(self, seed: int = 0) -> None:
        """Initialize every parameter and buffer in place (sharding-invariant, per-FQN seeds)."""

    @abc.abstractmethod
    def tie_weights(self) -> None:
        """Re-tie the output head to the embedding after ``to_empty`` (no-op when untied)."""

    @abc.abstractmethod
    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The tensor-parallel plan over ``layers`` and the root (see :mod:`kempnerforge.model.tp_plan`)."""

    @abc.abstractmethod
    def load_text_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Warm start: copy a dense :class:`~kempnerforge.model.Transformer` state dict (its FQNs)
        into this backbone (MoT: into every modality's weights). Raises ``KeyError`` naming missing keys."""

    @abc.abstractmethod
    def sequence_length(self, n_visual: int, n_text: int) -> int:
        """Positions the backbone's self-attention sees for one sample (checked against max_seq_len)."""


def register_arch(name: str) -> Callable[[type[VLMBackbone]], type[VLMBackbone]]:
    """Class decorator: make ``VLMConfig(arch=name)`` build this backbone.

    Raises:
        ValueError: ``name`` is not in :data:`~kempnerforge.config.vlm.VLM_ARCHS` or already registered.
    """

    def wrap(cls: type[VLMBackbone]) -> type[VLMBackbone]:
        if name not in VLM_ARCHS:
            raise ValueError(f"arch {name!r} is not in VLM_ARCHS {list(VLM_ARCHS)}; add it there first.")
        if name in ARCHS and ARCHS[name] is not cls:
            raise ValueError(f"arch {name!r} is already registered by {ARCHS[name].__name__}.")
        ARCHS[name] = cls
        return cls

    return wrap


def build_backbone(text: ModelConfig, vlm: VLMConfig) -> VLMBackbone:
    """The registered backbone for ``vlm.arch`` (construct under ``torch.device('meta')`` to defer allocation).

    Raises:
        ValueError: no class registered for ``vlm.arch``.
    """
    if vlm.arch not in ARCHS:
        raise ValueError(f"vlm.arch={vlm.arch!r} has no registered backbone; registered: {sorted(ARCHS)}.")
    return ARCHS[vlm.arch](text, vlm)


def prefix_sequence(
    visual: torch.Tensor | None,
    text: torch.Tensor,
    visual_mask: torch.Tensor | None = None,
    text_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Join visual tokens before the text, as joint-sequence archs (joint decoder, MoT, MoMa) see them.

    Args:
        visual: (batch, n_visual, dim) or None.
        text: (batch, n_text, dim) text embeddings.
        visual_mask: (batch, n_visual) bool or None (all real).
        text_mask: (batch, n_text) bool or None (all real).

    Returns:
        ``(h, key_mask, modality)``: h (batch, n_visual + n_text, dim); key_mask (batch, n_visual +
        n_text) bool, or None when nothing is padded (plain causal attention); modality (batch,
        n_visual + n_text) int64 with :data:`~kempnerforge.config.vlm.IMAGE` then
        :data:`~kempnerforge.config.vlm.TEXT`.
    """
    bsz, n_text = text.shape[:2]
    n_vis = 0 if visual is None else visual.shape[1]
    h = text if visual is None else torch.cat([visual.to(text.dtype), text], dim=1)
    modality = torch.full((bsz, n_vis + n_text), TEXT, dtype=torch.long, device=text.device)
    modality[:, :n_vis] = IMAGE
    if visual_mask is None and text_mask is None:
        return h, None, modality
    ones = torch.ones(bsz, n_vis + n_text, dtype=torch.bool, device=text.device)
    key_mask = ones
    if visual_mask is not None and n_vis:
        key_mask[:, :n_vis] = visual_mask
    if text_mask is not None:
        key_mask[:, n_vis:] = text_mask
    return h, key_mask, modality
