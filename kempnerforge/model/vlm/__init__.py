"""Vision-language backbones: how visual tokens join the text decoder (one registered class per arch).

Importing this package registers the archs built here (``joint_decoder``, ``cross_attention``).
"""

from kempnerforge.model.vlm import cross_attention, joint_decoder  # noqa: F401 - registers the archs
from kempnerforge.model.vlm.base import ARCHS, VLMBackbone, build_backbone, prefix_sequence, register_arch

__all__ = ["ARCHS", "VLMBackbone", "build_backbone", "prefix_sequence", "register_arch"]
