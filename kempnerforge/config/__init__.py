"""Typed configuration dataclasses (validated in ``__post_init__``)."""

from kempnerforge.config.model import ModelConfig

__all__ = ["ModelConfig"]
