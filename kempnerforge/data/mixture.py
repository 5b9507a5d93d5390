"""Mixtures of token sources with weights, a temperature, and annealing phases, exactly resumable.

Every global sample position ``k`` (counted over the whole run and all data-parallel ranks) draws
its source from the mixture in force at its optimizer step ``k // samples_per_step``; rank ``r`` of
``R`` takes the positions with ``k % R == r``. Draws come from a counter-based stream (one seeded
generator per chunk of positions), and the window inside a source is the next one of that source's
per-epoch permutation (without replacement), so the whole sequence is a pure function of
``(seed, sources, phases, k)``: the sampler's state is just ``k``, a resume replays it exactly
(before or after a phase switch), and the same global batch comes out at any data-parallel size.

Weights with temperature ``T`` become probabilities ``p_i = w_i^(1/T) / sum_j w_j^(1/T)`` (T > 1
flattens the mixture towards uniform, as in XLM-R's language sampling, Conneau et al. 2020,
arXiv:1911.02116). An annealing phase (``start_step``, new weights, ``lr_scale``) follows the
"mid-training / annealing on high-quality data" recipes (Llama 3, arXiv:2407.21783 sec. 3.4.3;
OLMo 2, arXiv:2501.00656): from its step on, the mixture changes and the LR schedule is multiplied
by ``lr_scale``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

#: Length the infinite :class:`MixtureSampler` reports (samples per rank): sized loaders keep
#: Lightning from prefetching, which keeps checkpointed data positions exact.
NOMINAL_LENGTH = 2**40

#: Positions drawn per generator seed: one ``np.random.default_rng([seed, chunk])`` per CHUNK samples.
CHUNK = 4096


@dataclass
class MixtureSource:
    """One source of a mixture (``--data.sources``).

    Raises:
        ValueError: on construction, an empty name or a negative weight.
    """

    name: str
    """Name used by annealing phases' ``weights`` and in logs."""
    data_dir: str
    """Folder of memmap token shards (``kforge prepare-data``)."""
    weight: float = 1.0
    """Relative sampling weight before any phase (>= 0; normalized with the temperature)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("MixtureSource.name must be a non-empty string.")
        if self.weight < 0:
            raise ValueError(f"MixtureSource {self.name!r}: weight={self.weight} must be >= 0.")


@dataclass
class AnnealingPhase:
    """From optimizer step ``start_step`` on: new source weights and an LR multiplier (``--data.phases``).

    Raises:
        ValueError: on construction, a negative ``start_step`` or weight, or ``lr_scale`` <= 0.
    """

    start_step: int
    """First optimizer step (0-based) of the phase."""
    weights: dict[str, float] = field(default_factory=dict)
    """Source name -> weight; sources not named get weight 0. Empty keeps the previous weights."""
    lr_scale: float = 1.0
    """Multiplier applied to the LR schedule's value during the phase (> 0)."""

    def __post_init__(self) -> None:
        if self.start_step < 0:
            raise ValueError(f"AnnealingPhase.start_step={self.start_step} must be >= 0.")
        if not self.lr_scale > 0:
            raise ValueError(f"AnnealingPhase.lr_scale={self.lr_scale} must be > 0.")
        bad = {k: v for k, v in self.weights.items() if v < 0}
        if bad:
            raise ValueError(f"AnnealingPhase at step {self.start_step}: negative weights {bad}.")


def mixture_probabilities(weights: list[float], temperature: float) -> np.ndarray:
    """``w_i^(1/T)`` normalized to sum to 1 (float64).

    Raises:
        ValueError: ``temperature`` <= 0 or every weight 0.
    """
    if not temperature > 0:
        raise ValueError(f"mixture temperature={temperature} must be > 0.")
    w = np.asarray(weights, dtype=np.float64)
    p = np.where(w > 0, w, 0.0) ** (1.0 / temperature)
    if p.sum() <= 0:
        raise ValueError(f"mixture weights {list(weights)} are all zero: at least one source needs weight > 0.")
    return p / p.sum()


class MixtureSchedule:
    """Source probabilities and LR scale as a function of the optimizer step.

    Args:
        sources: the mixture's sources (their ``weight`` applies before the first phase).
        phases: annealing phases (any order; sorted by ``start_step``).
        temperature: sampling temperature applied to every phase's weights.

    Raises:
        ValueError: duplicate source names, a phase naming an unknown source, two phases at one
            step, an all-zero phase, or a bad temperature.
    """

    def __init__(self, sources: list[MixtureSource], phases: list[AnnealingPhase], temperature: float = 1.0) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"mixture source names must be unique, got {names}.")
        self.names = names
        phases = sorted(phases, key=lambda p: p.start_step)
        starts = [p.start_step for p in phases]
        if len(set(starts)) != len(starts):
            raise ValueError(f"two annealing phases start at the same step: {starts}.")
        current = [s.weight for s in sources]
        # The sources' own weights form phase 0 unless a phase starts at step 0 and replaces it.
        self.starts, probs, scales = [0], [mixture_probabilities(current, temperature)], [1.0]
        for phase in phases:
            unknown = sorted(set(phase.weights) - set(names))
            if unknown:
                raise ValueError(f"annealing phase at step {phase.start_step} names unknown sources {unknown}; "
                                 f"sources are {names}.")  # fmt: skip
            if phase.weights:
                current = [phase.weights.get(n, 0.0) for n in names]
            if phase.start_step == 0:
                self.starts, probs, scales = [], [], []
            self.starts.append(phase.start_step)
            probs.append(mixture_probabilities(current, temperature))
            scales.append(phase.lr_scale)
        self.probs, self.scales = probs, scales

    def phase(self, step: int) -> int:
        """Index of the phase in force at optimizer ``step``."""
        return bisect.bisect_right(self.starts, step) - 1

    def lr_scale(self, step: int) -> float:
        """LR multiplier at optimizer ``step`` (1 before the first phase)."""
        return self.scales[self.phase(step)]


class MixtureSampler(DistributedSampler):
    """Infinite, exactly resumable sampler of indices into the concatenation of the sources' windows.

    A ``DistributedSampler`` subclass only so that Lightning keeps it (it already splits by
    data-parallel rank; Lightning would otherwise try to wrap it). The stream is infinite (train by
    ``max_steps``) but reports a length of :data:`NOMINAL_LENGTH` samples: Lightning prefetches one
    batch from unsized loaders, which would put the data position saved in a checkpoint one batch
    ahead of the last trained batch. It is its own iterator; ``state_dict`` is ``{"k": next global position, "yielded": this rank's
    count}``, so torchdata's ``StatefulDataLoader`` snapshots it per batch (also with workers).

    Args:
        sizes: windows per source (train split), in source order.
        schedule: the :class:`MixtureSchedule`.
        samples_per_step: global samples per optimizer step (micro_batch x dp x accumulation).
        rank, num_replicas: this process's data-parallel index and the dp degree.
        seed: the data seed.

    Raises:
        ValueError: a source with no windows but a positive probability, or bad sizes.
    """

    def __init__(
        self,
        sizes: list[int],
        schedule: MixtureSchedule,
        samples_per_step: int,
        rank: int = 0,
        num_replicas: int = 1,
        seed: int = 0,
    ) -> None:
        if len(sizes) != len(schedule.names):
            raise ValueError(f"{len(sizes)} source sizes for {len(schedule.names)} sources.")
        empty = [n for n, s, *p in zip(schedule.names, sizes, *schedule.probs, strict=True) if s == 0 and max(p) > 0]
        if empty:
            raise ValueError(f"mixture sources {empty} have no training windows but a positive weight.")
        if samples_per_step % num_replicas:
            raise ValueError(f"samples_per_step={samples_per_step} must be a multiple of num_replicas={num_replicas}.")
        self.sizes, self.schedule, self.seed = list(sizes), schedule, seed
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.samples_per_step, self.rank, self.num_replicas = samples_per_step, rank, num_replicas
        self._seek(0)

    # -- the pure sequence ------------------------------------------------------------------

    def _sources(self, chunk: int) -> np.ndarray:
        """Source of every position of ``chunk`` (CHUNK,) int64."""
        u = np.random.default_rng([self.seed, chunk]).random(CHUNK)
        steps = (chunk * CHUNK + np.arange(CHUNK)) // self.samples_per_step
        out = np.empty(CHUNK, dtype=np.int64)
        phases = np.searchsorted(np.asarray(self.schedule.starts), steps, side="right") - 1
        for ph in np.unique(phases):
            sel = phases == ph
            cdf = np.cumsum(self.schedule.probs[ph])
            out[sel] = np.minimum(np.searchsorted(cdf, u[sel], side="right"), len(cdf) - 1)
        return out

    def _window(self, src: int, ordinal: int) -> int:
        """Global index of the ``ordinal``-th window drawn from ``src`` (per-epoch permutation)."""
        n = self.sizes[src]
        epoch, pos = divmod(ordinal, n)
        if self._perm_key[src] != epoch:
            self._perms[src] = np.random.default_rng([self.seed, 1 + src, epoch]).permutation(n)
            self._perm_key[src] = epoch
        return int(self.offsets[src] + self._perms[src][pos])

    def _seek(self, k: int) -> None:
        """Position the stream at global position ``k``: replay the per-source counts of ``[0, k)``."""
        self.k = k
        self._counts = np.zeros(len(self.sizes), dtype=np.int64)
        self._perms: list[np.ndarray | None] = [None] * len(self.sizes)
        self._perm_key: list[int | None] = [None] * len(self.sizes)
        full, rest = divmod(k, CHUNK)
        for c in range(full):
            self._counts += np.bincount(self._sources(c), minlength=len(self.sizes))
        self._chunk_id, self._chunk = full, self._sources(full)
        self._counts += np.bincount(self._chunk[:rest], minlength=len(self.sizes))

    def _next_global(self) -> tuple[int, int]:
        """(position, dataset index) of the next global position, advancing the stream."""
        c, i = divmod(self.k, CHUNK)
        if c != self._chunk_id:
            self._chunk_id, self._chunk = c, self._sources(c)
        src = int(self._chunk[i])
        index = self._window(src, int(self._counts[src]))
        self._counts[src] += 1
        self.k += 1
        return self.k - 1, index

    # -- iterator protocol + state ------------------------------------------------------------

    def __len__(self) -> int:
        return NOMINAL_LENGTH

    def set_epoch(self, epoch: int) -> None:
        """No-op: positions are global over the whole run (Lightning calls it at epoch starts)."""

    def __iter__(self) -> MixtureSampler:
        return self

    def __next__(self) -> int:
        while True:
            k, index = self._next_global()
            if k % self.num_replicas == self.rank:
                return index

    def source_of(self, index: int) -> int:
        """Source number of dataset ``index``."""
        return int(np.searchsorted(self.offsets, index, side="right") - 1)

    def state_dict(self) -> dict[str, Any]:
        """``{"k": next global position, "yielded": samples this rank took}``."""
        taken = max(0, (self.k - self.rank + self.num_replicas - 1) // self.num_replicas)
        return {"k": int(self.k), "yielded": int(taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved global position (a dp change keeps it: positions are global)."""
        self._seek(int(state["k"]))
