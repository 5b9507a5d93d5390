"""Image- or clip-conditioned generation for vision-language models (``kforge generate --image / --video``).

The image (or each frame of a clip) becomes visual tokens (encoder -> connector), then:

- ``joint_decoder``: its backbone is the dense decoder with the visual tokens as a prefix, so the
  KV-cache decoder of :mod:`kempnerforge.model.generate` runs it as is (``prefix_embeds``).
- ``cross_attention`` and ``mot``: every step re-runs the backbone's full forward on the text so far
  (no KV cache for their blocks yet: O(n^2) in the generated length, fine for short answers). Rows
  are kept right-padded, as in training, and each row's next token comes from its last real position.
- ``moma`` is refused: expert-choice routing is not causal (a token's experts depend on later
  tokens), so it is training-only (Lin et al. 2024, arXiv:2407.21770 sec. 2.3 use auxiliary routers
  for inference, not implemented).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kempnerforge.model.generate import GenerationOutput, SamplingConfig, generate, left_pad, sample_next
from kempnerforge.model.vlm.base import VLMBackbone
from kempnerforge.model.vlm.joint_decoder import JointDecoder


def check_generatable(backbone: VLMBackbone) -> None:
    """Raise ``ValueError`` for archs that cannot decode causally (MoMa's expert-choice routing)."""
    if getattr(backbone, "training_only", False):
        raise ValueError(
            f"vlm.arch={backbone.vlm_config.arch!r} is training-only: its expert-choice routing looks at later "
            "tokens, so it cannot generate one token at a time. Generate with joint_decoder, cross_attention or mot."
        )


@torch.no_grad()
def generate_with_image(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    pixel_values: torch.Tensor,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    use_cache: bool = True,
) -> GenerationOutput:
    """Continue each prompt given its image.

    Args:
        model: a :class:`~kempnerforge.model.vlm.model.VisionLanguageModel` in eval mode.
        prompts: token ids per row (no padding).
        pixel_values: (batch, 3, H, W) fp32 from the encoder's image processor (one image per row), or
            (batch, frames, 3, H, W) for one clip per row (``frames x n_visual`` visual tokens).
        sampling: greedy / temperature / top-k / top-p and ``max_new_tokens``.
        eos_token_id: ends a row (included in its output); None never stops early.
        pad_token_id: fills rows after their EOS.
        use_cache: joint_decoder only: False decodes without the KV cache (a reference).

    Returns:
        :class:`~kempnerforge.model.generate.GenerationOutput`.

    Raises:
        ValueError: a training-only arch (moma), a batch size mismatch, or more positions than
            ``max_seq_len``.
    """
    sampling = sampling or SamplingConfig()
    backbone: VLMBackbone = model.backbone
    check_generatable(backbone)
    if pixel_values.shape[0] != len(prompts):
        raise ValueError(f"{pixel_values.shape[0]} images for {len(prompts)} prompts: give one image per prompt.")
    device = pixel_values.device
    visual = model.visual_tokens(pixel_values)
    if isinstance(backbone, JointDecoder):
        ids, mask = left_pad(prompts, pad_token_id)
        return generate(backbone, ids.to(device), mask.to(device), sampling, eos_token_id, pad_token_id,
                        prefix_embeds=visual, use_cache=use_cache)  # fmt: skip
    return _generate_full_forward(backbone, visual, prompts, sampling, eos_token_id, pad_token_id)


def _generate_full_forward(
    backbone: VLMBackbone,
    visual: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    eos_token_id: int | None,
    pad_token_id: int,
) -> GenerationOutput:
    """Decode by re-running ``backbone`` on the right-padded text so far at every step."""
    batch, device = len(prompts), visual.device
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    total = int(lens.max()) + sampling.max_new_tokens
    needed = backbone.sequence_length(visual.shape[1], total)
    if needed > backbone.config.max_seq_len:
        raise ValueError(
            f"{needed} positions (image + prompt + max_new_tokens) exceed ModelConfig.max_seq_len="
            f"{backbone.config.max_seq_len}; lower max_new_tokens or shorten the prompt"
        )
    ids = torch.full((batch, total), pad_token_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
    out = torch.full((batch, sampling.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    n_new = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)
    start = time.perf_counter()
    for step in range(sampling.max_new_tokens):
        cur = int(lens.max())
        text_mask = torch.arange(cur, device=device)[None] < lens[:, None]
        logits = backbone(ids[:, :cur], visual, text_mask)[rows, lens - 1].float()
        token = sample_next(logits, sampling, generator)
        out[:, step] = torch.where(done, torch.full_like(token, pad_token_id), token)
        n_new += (~done).long()
        ids[rows[~done], lens[~done]] = token[~done]
        lens = lens + (~done).long()
        if eos_token_id is not None:
            done |= token == eos_token_id
        if bool(done.all()):
            break
    return GenerationOutput(out[:, : int(n_new.max())], n_new, time.perf_counter() - start)
