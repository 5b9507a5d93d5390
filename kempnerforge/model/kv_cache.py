"""Key/value cache for incremental decoding (one buffer per layer, rows aligned by left padding).

Every row of the batch writes its keys and values at the same cache index, so a step is one slice
assignment; rows differ only in which cached positions are real (``key_valid``) and in their RoPE
positions (passed separately, per row). Layout follows HF ``StaticCache``: keys and values are
``(batch, n_kv_heads, max_len, head_dim)`` per layer, filled from index 0.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values of every layer, plus which cached positions are real tokens.

    Use: :meth:`begin` a step with the validity of its new positions, let each layer's
    :meth:`~kempnerforge.model.attention.Attention.forward_cached` call :meth:`update`, then
    :meth:`end` the step.

    Args:
        n_layers: number of attention layers.
        batch: rows.
        n_kv_heads: key/value heads per layer.
        max_len: cache capacity, positions (prompt + visual prefix + new tokens).
        head_dim: key channels per head.
        dtype, device: of the buffers (the model's compute dtype and device).
        value_dim: value channels per head; None = ``head_dim``; 0 = no value buffers (multi-head latent
            attention caches one latent per token, :meth:`MultiHeadLatentAttention.cache_dims
            <kempnerforge.model.mla.MultiHeadLatentAttention.cache_dims>`, and reads its values out of it).

    Raises:
        ValueError: a size is not a positive integer (``value_dim``: not an integer >= 0).
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
    ) -> None:
        sizes = {"n_layers": n_layers, "batch": batch, "n_kv_heads": n_kv_heads, "max_len": max_len}
        for name, value in {**sizes, "head_dim": head_dim}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache {name}={value!r} must be a positive integer")
        value_dim = head_dim if value_dim is None else value_dim
        if isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim < 0:
            raise ValueError(f"KVCache value_dim={value_dim!r} must be an integer >= 0 (0 = keys only)")
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        vshape = (*shape[:-1], value_dim)
        self.values = [torch.zeros(vshape, dtype=dtype, device=device) for _ in range(n_layers)] if value_dim else None
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.max_len = max_len
        self.length = 0  # positions filled by completed steps
        self._step = 0  # positions being written by the current step

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Start a step of ``valid.shape[1]`` new positions and return its attention mask.

        Args:
            valid: (batch, new) bool, True at real tokens (False at left padding).

        Returns:
            (batch, 1, new, length + new) bool SDPA mask: new query i sees cached key j when
            j <= length + i and key j is real; every query also sees itself, so a padded query gets a
            finite (unused) output instead of a softmax over nothing.

        Raises:
            ValueError: the step would overflow ``max_len``.
        """
        new = valid.shape[1]
        if self.length + new > self.max_len:
            raise ValueError(f"KVCache overflow: {self.length} + {new} positions > max_len={self.max_len}")
        self._step = new
        end = self.length + new
        self.key_valid[:, self.length : end] = valid
        query_pos = torch.arange(self.length, end, device=valid.device)[:, None]
        key_pos = torch.arange(end, device=valid.device)[None, :]
        mask = (key_pos <= query_pos)[None] & self.key_valid[:, None, :end]
        return (mask | (key_pos == query_pos)[None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Store the step's keys/values of ``layer`` and return all of them so far.

        Args:
            layer: 0-based layer index.
            k: (batch, n_kv_heads, new, head_dim); v: (batch, n_kv_heads, new, value_dim) for the current
                step, or None for a keys-only cache (``value_dim=0``).

        Returns:
            ``(keys, values)``, (batch, n_kv_heads, length + new, head_dim / value_dim) (views of the cache);
            values None for a keys-only cache.
        """
        end = self.length + self._step
        self.keys[layer][:, :, self.length : end] = k
        if self.values is None:
            return self.keys[layer][:, :, :end], None
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def end(self) -> None:
        """Finish the current step: its positions become part of the cached prefix."""
        self.length += self._step
        self._step = 0
