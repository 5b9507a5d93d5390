"""Typed configuration dataclasses (validated in ``__post_init__``)."""

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.rope import RopeScaling

__all__ = ["ModelConfig", "RopeScaling"]
