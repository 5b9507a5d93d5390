"""The VLM wrapper: ``encoder -> connector -> backbone`` as one module and one state tree.

The strategy's transform chain sees it like the dense decoder: ``layers`` are the backbone's
blocks (TP plan per block, activation checkpointing, FSDP2 units), ``tp_plan`` is the backbone's
with root paths under ``backbone.``, and :meth:`VisionLanguageModel.fsdp_units` declares the other
FSDP2 units (each encoder layer, the rest of the encoder, the connector); the backbone's embedding
and ``[norm, head]`` become units as in the dense decoder (:func:`kempnerforge.parallel.fsdp.apply_fsdp`).
DCP checkpoints hold ``encoder.*``, ``connector.*`` and ``backbone.*`` in one tree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.connectors import Connector
from kempnerforge.model.init import canonical_fqn
from kempnerforge.model.tp_plan import TPPlan
from kempnerforge.model.vision import VisionEncoder
from kempnerforge.model.vlm.base import VLMBackbone, build_backbone
from kempnerforge.parallel.contract import is_moe_layer


class VisionLanguageModel(nn.Module):
    """Images or video clips and text in, text logits out.

    Shapes: forward(input_ids (batch, text) int64, pixel_values (batch, 3, H, W) or (batch, frames,
    3, H, W) or None, text_mask (batch, text) bool or None, visual_mask (batch, n_visual) bool or
    None, frame_mask (batch, frames) bool or None) -> logits (batch, text, vocab_size).

    A clip's frames are encoded and connected one by one, exactly like images, and enter the backbone
    as ``frames x n_visual`` tokens in frame order (``n_visual`` = :attr:`n_visual`, the connector's
    count per image), so no arch has video-specific code. An image is a 1-frame clip. ``frame_mask``
    marks real frames (clips right-padded to the longest in the batch): padded frames are never
    encoded, their tokens are zeros and are masked as keys in every arch, so their pixels cannot
    reach any real token.

    Build on the meta device, shard, ``to_empty``, then :meth:`tie_weights` and :meth:`init_weights`
    (pretrained encoder weights are loaded from disk there, never lost to meta construction). With ``init_from`` (a
    Hugging Face folder of the text model, whose ``config.json`` gave ``text``) the backbone's text weights are read
    from it there too, each rank only its shard (:meth:`~kempnerforge.model.vlm.base.VLMBackbone.load_init_from_`).
    With FP8 training the encoder and connector stay in high precision unless ``float8_vision``.
    """

    def __init__(
        self,
        text: ModelConfig,
        vlm: VLMConfig,
        encoder: VisionEncoderConfig,
        connector: ConnectorConfig,
        init_from: str | None = None,
        float8_vision: bool = False,
    ) -> None:
        super().__init__()
        self.config = text
        self.encoder = VisionEncoder(encoder)
        self.connector = Connector(connector, self.encoder.width, text.dim, self.encoder.grid)
        self._n_visual = self.connector.n_tokens  # kept: a later pipeline stage holds no connector
        self.backbone: VLMBackbone = build_backbone(text, vlm)
        self.backbone.init_from = init_from
        #: Top-level modules FP8 training leaves in high precision (:func:`~kempnerforge.parallel.float8.apply_float8`):
        #: the vision tower and connector, unless ``float8_vision``.
        self.float8_skip_roots: tuple[str, ...] = () if float8_vision else ("encoder", "connector")

    @property
    def n_visual(self) -> int:
        """Visual tokens per image after the connector."""
        return self._n_visual

    @property
    def layers(self) -> nn.ModuleDict:
        """The backbone's blocks: the units of TP, activation checkpointing, compile and FSDP2."""
        return self.backbone.layers

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2 units besides ``layers`` and the root, in forward order: encoder layers, encoder, connector."""
        return [*self.encoder.layers, self.encoder, self.connector]

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The backbone's plan, root entries prefixed with ``backbone.`` (encoder and connector stay replicated); its
        ``moe_block`` plan (expert-TP, :func:`~kempnerforge.model.tp_plan.moe_block_tp_plan`) for the blocks that
        hold an MoE layer."""
        plan = self.backbone.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        root = {f"backbone.{k}": v for k, v in plan.root.items()}
        return TPPlan(root=root, block=plan.block, moe_block=plan.moe_block)

    def moe_layers(self) -> dict[str, nn.Module]:
        """The backbone's token-choice MoE layers by canonical FQN within the backbone (``layers.1.moe``, the names
        the text model and a pipeline stage of ``layers`` give them), through any wrapper; empty without MoE. The
        module adds their auxiliary losses and updates their routers' bias from them
        (:class:`~kempnerforge.training.moe_balance.MoEStepTracker`)."""
        return {canonical_fqn(n): m for n, m in self.backbone.named_modules() if is_moe_layer(m)}

    def tie_weights(self) -> None:
        """Re-tie the backbone's head to its embedding (after ``to_empty``)."""
        self.backbone.tie_weights()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Encoder (pretrained from disk, or HF init from ``seed``), connector and backbone (the text model's folder
        with ``init_from``, per-FQN seeds for the rest); a pipeline rank initializes only the parts it holds."""
        if self.encoder is not None:  # None on a pipeline stage after the first (pruned)
            self.encoder.init_weights(seed, prefix="encoder")
            self.connector.init_weights(seed, prefix="connector")
        self.backbone.init_weights(seed)

    def visual_tokens(
        self, pixel_values: torch.Tensor, frame_mask: torch.Tensor | None = None, real_frames: int | None = None
    ) -> torch.Tensor:
        """Visual tokens in the text width; the frozen encoder runs without autograd.

        Args:
            pixel_values: (batch, 3, H, W) images, or (batch, frames, 3, H, W) clips.
            frame_mask: (batch, frames) bool, True at real frames (clips only; None: all real).
            real_frames: the number of True entries of ``frame_mask`` when the caller knows it on the host
                (the video collator does): the real frames are then gathered with fixed sizes
                (``nonzero_static``) instead of boolean indexing, which reads the mask back from the device
                twice per forward.

        Returns:
            (batch, n_visual, dim) for images; (batch, frames * n_visual, dim) for clips, frame by
            frame, zeros at padded frames (which are not encoded).

        Raises:
            ValueError: ``pixel_values`` neither 4-D nor 5-D, or ``frame_mask`` not (batch, frames) or
                given with 4-D images.
        """
        if pixel_values.dim() == 4:
            if frame_mask is not None:
                raise ValueError("frame_mask is for clips (batch, frames, 3, H, W); images are 4-D.")
            return self._encode(pixel_values)
        if pixel_values.dim() != 5:
            raise ValueError(
                f"pixel_values must be (batch, 3, H, W) or (batch, frames, 3, H, W); got {tuple(pixel_values.shape)}."
            )
        bsz, frames = pixel_values.shape[:2]
        if frame_mask is None:
            return self._encode(pixel_values.flatten(0, 1)).unflatten(0, (bsz, frames)).flatten(1, 2)
        if frame_mask.shape != (bsz, frames):
            raise ValueError(f"frame_mask must be (batch, frames) = {(bsz, frames)}; got {tuple(frame_mask.shape)}.")
        if real_frames is None:  # boolean indexing: two host syncs
            real = self._encode(pixel_values[frame_mask])  # (real frames, n_visual, dim): padding never encoded
            tokens = real.new_zeros(bsz, frames, *real.shape[1:])
            tokens[frame_mask] = real
            return tokens.flatten(1, 2)
        idx = torch.nonzero_static(frame_mask.reshape(-1), size=real_frames).squeeze(1)
        real = self._encode(pixel_values.flatten(0, 1).index_select(0, idx))
        tokens = real.new_zeros(bsz * frames, *real.shape[1:]).index_copy(0, idx, real)
        return tokens.view(bsz, frames * real.shape[1], *real.shape[2:])

    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.encoder.frozen):
            features = self.encoder(pixel_values)
        return self.connector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
        frame_mask: torch.Tensor | None = None,
        real_frames: int | None = None,
        labels: torch.Tensor | None = None,
        **loss: Any,
    ) -> Any:
        """Text logits (batch, text, vocab_size); see the class docstring for shapes. With ``labels`` (batch, text)
        the head fused with the loss instead, ``(loss_sum, z_sum)`` (``loss``: ``loss_impl``, ``loss_chunk_size``,
        ``z_loss_weight``; :meth:`~kempnerforge.model.vlm.base.VLMBackbone.head`).

        ``frame_mask`` (batch, frames) expands to the visual tokens (``n_visual`` per frame) and is
        combined with ``visual_mask`` when both are given. ``real_frames`` (its number of True entries,
        known on the host) avoids reading the mask back (:meth:`visual_tokens`); when it says every
        frame is real the mask is dropped, so attention keeps the is_causal kernel.
        """
        if frame_mask is not None and real_frames is not None and real_frames == frame_mask.numel():
            frame_mask = None  # nothing padded (known on the host)
        visual = None if pixel_values is None else self.visual_tokens(pixel_values, frame_mask, real_frames)
        if frame_mask is not None:
            per_token = frame_mask.repeat_interleave(self.n_visual, dim=1)
            visual_mask = per_token if visual_mask is None else visual_mask & per_token
        return self.backbone(input_ids, visual, text_mask, visual_mask, labels, **loss)
