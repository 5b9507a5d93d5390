"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p (nucleus) sampling.

A batch of prompts is left-padded so every row writes the cache at the same index; each row's RoPE
positions count only its real tokens (``cumsum(mask) - 1``, as HF ``generate`` derives
``position_ids`` from the attention mask), so a padded row decodes exactly as it would alone.
Rows stop independently at EOS. A vision-language model can pass ``prefix_embeds``: visual tokens,
already ``dim`` wide, placed before the text (the joint-sequence layout of
:func:`kempnerforge.model.vlm.base.prefix_sequence`).

Sampling follows HF's logits processors in order: temperature, then top-k (Fan et al., 2018), then
top-p (Holtzman et al., arXiv:1904.09751), keeping at least one token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kempnerforge.errors import UserError
from kempnerforge.model.kv_cache import KVCache


@dataclass
class SamplingConfig:
    """How to pick tokens.

    Raises:
        ValueError: naming the field: ``max_new_tokens`` < 1, ``temperature`` < 0, ``top_k`` < 0,
            ``top_p`` outside (0, 1].
    """

    max_new_tokens: int = 64
    """Tokens to generate per row at most."""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = no limit."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches top_p; 1 = no limit."""
    seed: int = 0
    """Seed of the sampling generator (unused when greedy)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p!r} must be in (0, 1] (1 = off)")


@dataclass
class GenerationOutput:
    """What :func:`generate` produced.

    Attributes:
        tokens: (batch, steps) int64 new tokens; after a row's EOS (included) it holds ``pad_token_id``.
        lengths: (batch,) int64 new tokens of each row, its EOS included.
        seconds: wall time of prefill and decoding, s.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (all rows, up to each EOS) per second of wall time, tokens/s."""
        return float(self.lengths.sum()) / max(self.seconds, 1e-9)

    def row(self, i: int) -> list[int]:
        """Row ``i``'s new tokens up to and including its EOS."""
        return self.tokens[i, : int(self.lengths[i])].tolist()


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists, left-padded to the longest.

    Returns:
        ``(input_ids, attention_mask)``: (batch, longest) int64 and bool (True at real tokens).

    Raises:
        ValueError: no prompts, or an empty prompt (a row needs at least one token to condition on).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad: every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, longest - len(p) :] = True
    return ids, mask


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from ``logits`` (batch, vocab); returns (batch,) int64.

    Greedy when ``cfg.temperature == 0`` (ties: the lowest id, as ``argmax``), else temperature ->
    top-k -> top-p filtering and a multinomial draw from ``generator``.
    """
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= cfg.top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def decoder_step(
    model: nn.Module, h: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Run new positions through a decoder with a KV cache; returns the logits of the last one.

    Args:
        model: a decoder exposing ``layers`` (blocks with ``forward_cached``), ``norm``, ``output``
            and ``rope_cos`` / ``rope_sin`` (:class:`~kempnerforge.model.Transformer`).
        h: (batch, new, dim) input embeddings of the new positions.
        positions: (batch, new) int64 RoPE positions of each row.
        valid: (batch, new) bool, False at padding.
        cache: the layers' :class:`KVCache`.

    Returns:
        (batch, vocab_size) fp32 logits at the last new position.
    """
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    mask = cache.begin(valid)
    for i, layer in enumerate(model.layers.values()):
        h = layer.forward_cached(h, cos, sin, cache, i, mask)
    cache.end()
    return model.output(model.norm(h[:, -1:])).float()[:, 0]


def _check_lengths(model: nn.Module, total: int, prompt: int | None = None) -> None:
    """Refuse more positions than the model's RoPE table holds.

    Raises:
        UserError: naming ``--prompt`` when the prompt alone is too long (``prompt`` given), else ``--max_new_tokens``.
    """
    limit = model.rope_cos.shape[0]
    if total > limit:
        if prompt is not None and prompt >= limit:
            raise UserError(
                "--prompt", f"the prompt (and prefix) is {prompt} positions; ModelConfig.max_seq_len={limit} holds "
                f"fewer: shorten it to under {limit} tokens"
            )  # fmt: skip
        room = f" (at most {limit - prompt} after this prompt)" if prompt is not None else ""
        raise UserError(
            "--max_new_tokens",
            f"prompt + prefix + max_new_tokens = {total} positions exceed ModelConfig.max_seq_len={limit}; "
            f"lower --max_new_tokens{room} or shorten the prompt",
        )


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    prefix_embeds: torch.Tensor | None = None,
    prefix_mask: torch.Tensor | None = None,
    use_cache: bool = True,
) -> GenerationOutput:
    """Generate continuations of a left-padded batch of prompts.

    Args:
        model: decoder (see :func:`decoder_step`), in eval mode.
        input_ids: (batch, prompt) int64, left-padded (:func:`left_pad`).
        attention_mask: (batch, prompt) bool/int, 1 at real tokens; None = no padding.
        sampling: :class:`SamplingConfig` (default: greedy, 64 tokens).
        eos_token_id: id(s) that end a row (included in its output); None = never stop early.
        pad_token_id: written after a row's EOS.
        prefix_embeds: (batch, n_prefix, dim) embeddings placed before the prompt (a VLM's visual
            tokens), or None.
        prefix_mask: (batch, n_prefix) bool, False at padded prefix positions; None = all real.
        use_cache: False recomputes every position at every step (a reference for the cache).

    Returns:
        :class:`GenerationOutput`.

    Raises:
        ValueError: shapes disagree.
        UserError: the total length exceeds ``max_seq_len``, or a prompt token id is beyond the vocabulary.
    """
    sampling = sampling or SamplingConfig()
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    n_prefix = 0 if prefix_embeds is None else prefix_embeds.shape[1]
    _check_lengths(model, n_prefix + prompt_len + sampling.max_new_tokens, n_prefix + prompt_len)  # before allocating
    vocab = model.tok_embeddings.weight.shape[0]
    if input_ids.numel() and int(input_ids.max()) >= vocab:  # a tokenizer larger than the model's vocabulary
        raise UserError(
            "--tokenizer",
            f"the prompt has token id {int(input_ids.max())}, but the model's vocab_size is {vocab}: this tokenizer "
            "is not the model's (give the tokenizer it was trained with)",
        )
    dim = model.tok_embeddings.weight.shape[1]
    if prefix_embeds is not None and (prefix_embeds.dim() != 3 or prefix_embeds.shape[::2] != (batch, dim)):
        raise ValueError(
            f"prefix_embeds must be (batch={batch}, n_prefix, dim={dim}), got {tuple(prefix_embeds.shape)}"
        )
    h = model.tok_embeddings(input_ids)
    if prefix_embeds is not None:
        ones = torch.ones(batch, n_prefix, dtype=torch.bool, device=device)
        pmask = ones if prefix_mask is None else prefix_mask.bool()
        h, mask = torch.cat([prefix_embeds.to(h.dtype), h], dim=1), torch.cat([pmask, mask], dim=1)
    eos = torch.tensor(sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())),
                       dtype=torch.long, device=device)  # fmt: skip
    generator = torch.Generator(device=device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    start = time.perf_counter()
    cache = _new_cache(model, batch, h.shape[1] + sampling.max_new_tokens, h.dtype, device)
    logits = decoder_step(model, h, positions, mask, cache)
    next_pos = positions[:, -1] + 1
    out = torch.full((batch, sampling.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    all_h, all_pos, all_mask = h, positions, mask
    for step in range(sampling.max_new_tokens):
        token = sample_next(logits, sampling, generator)
        out[:, step] = torch.where(done, torch.full_like(token, pad_token_id), token)
        lengths += (~done).long()
        done |= torch.isin(token, eos)
        if bool(done.all()) or step == sampling.max_new_tokens - 1:
            break
        new_h, new_pos = model.tok_embeddings(token[:, None]), next_pos[:, None]
        ones = torch.ones(batch, 1, dtype=torch.bool, device=device)
        if use_cache:
            logits = decoder_step(model, new_h, new_pos, ones, cache)
        else:  # reference: a fresh cache over the whole sequence so far
            all_h, all_pos = torch.cat([all_h, new_h], 1), torch.cat([all_pos, new_pos], 1)
            all_mask = torch.cat([all_mask, ones], 1)
            fresh = _new_cache(model, batch, all_h.shape[1], h.dtype, device)
            logits = decoder_step(model, all_h, all_pos, all_mask, fresh)
        next_pos = next_pos + 1
    return GenerationOutput(out[:, : int(lengths.max())], lengths, time.perf_counter() - start)


def _new_cache(model: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    # GQA caches per-KV-head keys and values, MLA its latent (cache_dims of each attention class).
    n_kv, key_dim, value_dim = next(iter(model.layers.values())).attention.cache_dims()
    return KVCache(len(model.layers), batch, n_kv, max_len, key_dim, dtype, device, value_dim=value_dim)
