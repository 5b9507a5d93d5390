"""Vision-language backbones: how visual tokens join the text decoder (one registered class per arch)."""

from kempnerforge.model.vlm.base import ARCHS, VLMBackbone, build_backbone, prefix_sequence, register_arch

__all__ = ["ARCHS", "VLMBackbone", "build_backbone", "prefix_sequence", "register_arch"]
