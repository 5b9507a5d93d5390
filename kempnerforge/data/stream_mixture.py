"""A weighted mixture of streamed sources, exactly resumable (``StreamingTokenDataModule(sources=[...])``).

Each reader (data-parallel rank x dataloader worker) keeps one :class:`~kempnerforge.data.hf_dataset.PackedTokenStream`
per source and takes its ``j``-th window from the source drawn for ``j``: a uniform number from a counter-based
stream (``numpy.random.default_rng([seed, reader, j // CHUNK])``) against the cumulative probabilities
``w_i^(1/T) / sum_k w_k^(1/T)`` (:func:`~kempnerforge.data.mixture.mixture_probabilities`, XLM-R's temperature,
arXiv:1911.02116). The draw is a pure function of ``(seed, reader, j)``, so the state is ``j`` plus each source's
stream state, and a resume continues with the windows an uninterrupted run would see.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from kempnerforge.data.hf_dataset import PackedTokenStream
from kempnerforge.data.mixture import CHUNK  # draws per generator seed, as the memmap mixture


@dataclass
class StreamingSource:
    """One streamed source of a mixture (``--data.sources``).

    Raises:
        ValueError: on construction, an empty name or a negative weight.
    """

    name: str
    """Name in logs and the ``source`` number's order."""
    source: str | dict[str, Any]
    """A ``.jsonl``/``.json``/``.parquet``/``.txt`` file, folder or glob, a ``save_to_disk`` folder, or a
    ``datasets.load_dataset`` spec of local files."""
    weight: float = 1.0
    """Relative sampling weight (>= 0; normalized with the temperature)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("StreamingSource.name must be a non-empty string.")
        if not self.weight >= 0:
            raise ValueError(f"StreamingSource {self.name!r}: weight={self.weight} must be >= 0.")


class MixedTokenStream(IterableDataset):
    """Windows from several :class:`PackedTokenStream` s, each window's source drawn by a seeded counter.

    Items are the streams' (``{"input_ids", "labels"}`` of shape (seq_len,), ``doc_ids`` with document masking)
    plus ``"source"``: the source's number (int64 scalar). Streams repeat without end (training).

    Args:
        streams: one stream per source (same ``seq_len``, ``dp_rank``, ``dp_size``).
        probs: the sources' probabilities (sum 1).
        seed: the data seed.

    Raises:
        ValueError: ``streams`` and ``probs`` of different lengths.
    """

    def __init__(self, streams: list[PackedTokenStream], probs: np.ndarray, seed: int) -> None:
        super().__init__()
        if len(streams) != len(probs):
            raise ValueError(f"{len(streams)} streams for {len(probs)} probabilities")
        self.streams, self.cdf, self.seed = streams, np.cumsum(probs), seed
        self.windows, self._resume = 0, None
        self.length: int | None = None

    def __len__(self) -> int:
        """``length`` windows when set (see :meth:`PackedTokenStream.__len__`)."""
        if self.length is None:
            raise TypeError("this stream has no length (set .length to the windows the run will take)")
        return self.length

    def state_dict(self) -> dict[str, Any]:
        """``{"windows": windows taken by this reader, "sources": [each stream's state]}``."""
        return {"windows": self.windows, "sources": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Sets where the next ``iter()`` starts."""
        self._resume = int(state_dict["windows"])
        for stream, state in zip(self.streams, state_dict["sources"], strict=True):
            stream.load_state_dict(state)

    def _draws(self, reader: int, chunk: int) -> np.ndarray:
        u = np.random.default_rng([self.seed, reader, chunk]).random(CHUNK)
        return np.minimum(np.searchsorted(self.cdf, u, side="right"), len(self.cdf) - 1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.windows, self._resume = self._resume or 0, None
        info = get_worker_info()
        reader = self.streams[0].dp_rank * (info.num_workers if info else 1) + (info.id if info else 0)
        iters = [iter(s) for s in self.streams]
        chunk_id, draws = -1, None
        while True:
            c, i = divmod(self.windows, CHUNK)
            if c != chunk_id:
                chunk_id, draws = c, self._draws(reader, c)
            src = int(draws[i])
            sample = next(iters[src])
            self.windows += 1
            yield {**sample, "source": torch.tensor(src)}
