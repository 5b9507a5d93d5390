"""A synthetic micro-batch shaped as the recipe's DataModule would deliver it, so no data has to exist.

Every sequence is full length (the worst case a padded batch reaches): ``(micro_batch_size, seq_len)``
tokens for text; ``max_text_len`` text positions, full-resolution images (the encoder's ``image_size``) and,
for video, ``max_frames`` frames per clip for vision-language data. Values are random (fake) token ids.
"""

from __future__ import annotations

from typing import Any

import torch


def synthetic_batch(module: Any, datamodule: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The training micro-batch of one data-parallel rank.

    Returns:
        Text (``TokenDataModule``-like, has ``seq_len``): ``input_ids``, ``labels`` (batch, seq) int64, and
        ``doc_ids`` (batch, seq) int64 with ``document_masking``. Vision-language (has ``max_text_len``): also
        ``text_mask`` (batch, text) bool and ``pixel_values`` (batch, 3, H, W) fp32, or (batch, frames, 3, H, W)
        when the DataModule has ``max_frames`` (every frame real, so no ``frame_mask``).

    Raises:
        ValueError: a DataModule with neither ``seq_len`` nor ``max_text_len`` (its batch shape is unknown).
    """
    mb = datamodule.micro_batch_size
    vocab = module.config.vocab_size

    def tokens(length: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, vocab, (mb, length), device=device),
            "labels": torch.randint(0, vocab, (mb, length), device=device),
        }

    if getattr(datamodule, "max_text_len", None) is not None:
        from kempnerforge.model.vision import hf_vision_config

        text = datamodule.max_text_len
        hf = hf_vision_config(module.encoder_config)
        image = (getattr(hf, "num_channels", 3), hf.image_size, hf.image_size)
        batch = {**tokens(text), "text_mask": torch.ones(mb, text, dtype=torch.bool, device=device)}
        frames = getattr(datamodule, "max_frames", None)
        if frames:  # every clip has max_frames real frames: no frame_mask (the all-true mask's indexing is a no-op)
            batch["pixel_values"] = torch.zeros(mb, frames, *image, device=device)
        else:
            batch["pixel_values"] = torch.zeros(mb, *image, device=device)
        return batch
    if getattr(datamodule, "seq_len", None) is not None:
        batch = tokens(datamodule.seq_len)
        if getattr(datamodule, "document_masking", False):
            batch["doc_ids"] = torch.zeros(mb, datamodule.seq_len, dtype=torch.long, device=device)
        return batch
    raise ValueError(
        f"kforge estimate cannot shape a batch for {type(datamodule).__name__}: it needs a DataModule with "
        "seq_len (text) or max_text_len (vision-language)."
    )
