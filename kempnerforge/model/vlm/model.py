"""The VLM wrapper: ``encoder -> connector -> backbone`` as one module and one state tree.

The strategy's transform chain sees it like the dense decoder: ``layers`` are the backbone's
blocks (TP plan per block, activation checkpointing, FSDP2 units), ``tp_plan`` is the backbone's
with root paths under ``backbone.``, and :meth:`VisionLanguageModel.fsdp_units` declares the other
FSDP2 units (each encoder layer, the rest of the encoder, the connector); the root unit holds the
backbone's embedding, final norm and head. DCP checkpoints hold ``encoder.*``, ``connector.*`` and
``backbone.*`` in one tree.
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vision import ConnectorConfig, VisionEncoderConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.connectors import Connector
from kempnerforge.model.tp_plan import TPPlan
from kempnerforge.model.vision import VisionEncoder
from kempnerforge.model.vlm.base import VLMBackbone, build_backbone


class VisionLanguageModel(nn.Module):
    """Images and text in, text logits out.

    Shapes: forward(input_ids (batch, text) int64, pixel_values (batch, 3, H, W) or None, text_mask
    (batch, text) bool or None, visual_mask (batch, n_visual) bool or None) -> logits (batch, text,
    vocab_size). ``n_visual`` is :attr:`n_visual` tokens per image (the connector's count).

    Build on the meta device, shard, ``to_empty``, then :meth:`tie_weights` and :meth:`init_weights`
    (pretrained encoder weights are loaded from disk there, never lost to meta construction).
    """

    def __init__(
        self, text: ModelConfig, vlm: VLMConfig, encoder: VisionEncoderConfig, connector: ConnectorConfig
    ) -> None:
        super().__init__()
        self.config = text
        self.encoder = VisionEncoder(encoder)
        self.connector = Connector(connector, self.encoder.width, text.dim, self.encoder.grid)
        self.backbone: VLMBackbone = build_backbone(text, vlm)

    @property
    def n_visual(self) -> int:
        """Visual tokens per image after the connector."""
        return self.connector.n_tokens

    @property
    def layers(self) -> nn.ModuleDict:
        """The backbone's blocks: the units of TP, activation checkpointing, compile and FSDP2."""
        return self.backbone.layers

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2 units besides ``layers`` and the root, in forward order: encoder layers, encoder, connector."""
        return [*self.encoder.layers, self.encoder, self.connector]

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
        """The backbone's plan, root entries prefixed with ``backbone.`` (encoder and connector stay replicated)."""
        plan = self.backbone.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        return TPPlan(root={f"backbone.{k}": v for k, v in plan.root.items()}, block=plan.block)

    def tie_weights(self) -> None:
        """Re-tie the backbone's head to its embedding (after ``to_empty``)."""
        self.backbone.tie_weights()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Encoder (pretrained from disk, or HF init from ``seed``), connector and backbone (per-FQN seeds)."""
        self.encoder.init_weights(seed)
        self.connector.init_weights(seed, prefix="connector")
        self.backbone.init_weights(seed)

    def visual_tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(batch, n_visual, dim) from (batch, 3, H, W); the frozen encoder runs without autograd."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.encoder.frozen):
            features = self.encoder(pixel_values)
        return self.connector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        text_mask: torch.Tensor | None = None,
        visual_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text logits (batch, text, vocab_size); see the class docstring for shapes."""
        visual = None if pixel_values is None else self.visual_tokens(pixel_values)
        return self.backbone(input_ids, visual, text_mask, visual_mask)
