"""Vision-language backbones: how visual tokens join the text decoder (one registered class per arch).

Importing this package registers the archs built here (``joint_decoder``, ``cross_attention``).
"""

from kempnerforge.model.vlm import cross_attention, joint_decoder  # noqa: F401 - registers the archs
from kempnerforge.model.vlm.base import ARCHS, VLMBackbone, build_backbone, prefix_sequence, register_arch
from kempnerforge.model.vlm.moma import MoMaBackbone  # registers "moma"
from kempnerforge.model.vlm.mot import MoTBackbone  # registers "mot"

__all__ = ["ARCHS", "MoMaBackbone", "MoTBackbone", "VLMBackbone", "build_backbone", "prefix_sequence", "register_arch"]
