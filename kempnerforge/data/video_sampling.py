"""Frame sampling policies: pure functions ``frame timestamps -> chosen frame indices``, by name.

A policy sees only the clip's presentation timestamps (seconds, increasing; from
:class:`~kempnerforge.data.video_decode.VideoIndex`, no decoding) and a :class:`FrameSampling`, and
returns strictly increasing indices into them. Adding one is a single registration::

    @register_sampling("middle")
    def middle(timestamps, cfg):
        return [len(timestamps) // 2]

Outside this package (e.g. under ``kforge fit``, which imports nothing of yours), name the policy by
its import path instead: ``data.sampling: mypkg.policies.middle`` imports ``mypkg.policies`` and uses
its ``middle`` function (registered under that path), in training and in ``kforge generate --video``.

Every policy keeps at most ``cfg.max_frames`` frames (checked by :func:`sample_frames`), so a
datamodule can bound the visual tokens of a clip without knowing the policy.
"""

from __future__ import annotations

import bisect
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

#: ``(timestamps in seconds, settings) -> strictly increasing frame indices``.
SamplingPolicy = Callable[[Sequence[float], "FrameSampling"], list[int]]

#: Registered policies by name (see :func:`register_sampling`).
SAMPLING_POLICIES: dict[str, SamplingPolicy] = {}


def register_sampling(name: str) -> Callable[[SamplingPolicy], SamplingPolicy]:
    """Decorator registering a policy under ``name`` (``data.sampling``).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def add(fn: SamplingPolicy) -> SamplingPolicy:
        if name in SAMPLING_POLICIES:
            raise ValueError(f"sampling policy {name!r} is already registered.")
        SAMPLING_POLICIES[name] = fn
        return fn

    return add


@dataclass(frozen=True)
class FrameSampling:
    """Which frames of a clip to keep.

    Args:
        policy: a name in :data:`SAMPLING_POLICIES` (``uniform``, ``fixed_count``, ...).
        fps: ``uniform``'s target rate in frames per second, > 0.
        min_frames, max_frames: bounds on frames per clip, 1 <= min_frames <= max_frames. A clip
            with fewer frames than ``min_frames`` gives all its frames (frames are never repeated).
        num_frames: ``fixed_count``'s frames per clip, 1 <= num_frames <= max_frames (None: max_frames).

    Raises:
        ValueError: any of the above violated; the message names the ``data.*`` field.
    """

    policy: str = "uniform"
    fps: float = 1.0
    min_frames: int = 1
    max_frames: int = 8
    num_frames: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in SAMPLING_POLICIES and not _import_policy(self.policy):
            raise ValueError(
                f"data.sampling={self.policy!r} is not registered; choose one of {sorted(SAMPLING_POLICIES)} "
                "or give an importable function path (mypkg.module.function)."
            )
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"data.fps={self.fps} must be a finite number > 0 (frames per second).")
        for name in ("min_frames", "max_frames", "num_frames"):
            value = getattr(self, name)
            if name == "num_frames" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r} must be an integer >= 1.")
        if self.min_frames > self.max_frames:
            raise ValueError(f"data.min_frames={self.min_frames} must be <= data.max_frames={self.max_frames}.")
        if self.num_frames is not None and self.num_frames > self.max_frames:
            raise ValueError(f"data.num_frames={self.num_frames} must be <= data.max_frames={self.max_frames}.")
        if self.policy == "uniform" and self.num_frames is not None:
            raise ValueError(
                f"data.num_frames={self.num_frames} applies to sampling='fixed_count'; 'uniform' takes its count "
                "from fps, min_frames and max_frames. Set num_frames to null or sampling to fixed_count."
            )


def _import_policy(path: str) -> bool:
    """Register the function at import path ``path`` (``pkg.module.function``) under that path; False when
    ``path`` names no importable function."""
    module, _, name = path.rpartition(".")
    if not module:
        return False
    try:
        fn = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return False
    if not callable(fn):
        return False
    SAMPLING_POLICIES.setdefault(path, fn)
    return True


def sample_frames(timestamps: Sequence[float], cfg: FrameSampling) -> list[int]:
    """Indices of the frames ``cfg.policy`` keeps from a clip with these frame timestamps.

    Args:
        timestamps: presentation times in seconds, strictly increasing, at least one.

    Returns:
        Strictly increasing indices into ``timestamps``, between 1 and ``cfg.max_frames`` of them.

    Raises:
        ValueError: no timestamps, or a policy broke the contract (a bug in that policy).
    """
    if len(timestamps) == 0:
        raise ValueError("a clip without frames cannot be sampled.")
    chosen = list(SAMPLING_POLICIES[cfg.policy](timestamps, cfg))
    increasing = all(b > a for a, b in pairwise(chosen))
    if (
        not chosen
        or len(chosen) > cfg.max_frames
        or not increasing
        or not 0 <= chosen[0] <= chosen[-1] < len(timestamps)
    ):
        raise ValueError(f"sampling policy {cfg.policy!r} returned {chosen} for {len(timestamps)} frames.")
    return chosen


def nearest_increasing(timestamps: Sequence[float], targets: Sequence[float]) -> list[int]:
    """For each target time, the nearest frame, forced strictly increasing; endpoints kept.

    Target ``k`` of ``n`` may only take frames ``[prev + 1, len - (n - k)]``, so every later target
    still has a frame of its own: the result has ``n`` distinct indices (needs ``n <= len``), its
    first is 0 and its last ``len - 1`` when the targets start and end at the clip's ends.
    """
    n, last = len(targets), len(timestamps) - 1
    out, prev = [], -1
    for k, t in enumerate(targets):
        lo, hi = prev + 1, last - (n - 1 - k)
        i = bisect.bisect_left(timestamps, t, lo, hi + 1)
        candidates = [j for j in (i - 1, i) if lo <= j <= hi]
        i = min(candidates or [min(max(i, lo), hi)], key=lambda j: abs(timestamps[j] - t))
        out.append(i)
        prev = i
    return out


def nearest(timestamps: Sequence[float], t: float) -> int:
    """Index of the frame whose timestamp is nearest to ``t`` (the earlier one on a tie)."""
    i = bisect.bisect_left(timestamps, t)
    return min((j for j in (i - 1, i) if 0 <= j < len(timestamps)), key=lambda j: abs(timestamps[j] - t))


def evenly_spread(timestamps: Sequence[float], count: int) -> list[int]:
    """``min(count, len)`` frames at evenly spaced times from the first to the last frame, endpoints kept."""
    n = min(count, len(timestamps))
    if n == 1:
        return [0]
    t0, t1 = timestamps[0], timestamps[-1]
    return nearest_increasing(timestamps, [t0 + (t1 - t0) * k / (n - 1) for k in range(n)])


@register_sampling("uniform")
def uniform(timestamps: Sequence[float], cfg: FrameSampling) -> list[int]:
    """Frames at ``cfg.fps`` by timestamp: the nearest frame to ``t0 + k / fps`` for each ``k``, plus the last.

    Both endpoints are always kept, so the last gap may be shorter than ``1 / fps``; asking for
    more than the clip's own rate gives each frame at most once. When that count falls outside
    ``[min_frames, max_frames]`` the count is clamped and the frames are evenly spread over the
    clip instead (:func:`evenly_spread`), endpoints kept.
    """
    t0, t1 = timestamps[0], timestamps[-1]
    n_targets = math.floor((t1 - t0) * cfg.fps) + 1
    if n_targets >= len(timestamps):  # at or above the clip's own rate: every frame, once (bounded work)
        chosen = list(range(len(timestamps)))
    else:
        chosen = sorted({nearest(timestamps, t0 + k / cfg.fps) for k in range(n_targets)})
    if chosen[-1] != len(timestamps) - 1:
        chosen.append(len(timestamps) - 1)
    n = len(chosen)
    if n < cfg.min_frames or n > cfg.max_frames:
        return evenly_spread(timestamps, min(max(n, cfg.min_frames), cfg.max_frames))
    return chosen


@register_sampling("fixed_count")
def fixed_count(timestamps: Sequence[float], cfg: FrameSampling) -> list[int]:
    """``cfg.num_frames`` (default ``max_frames``) frames evenly spaced in time, first and last kept (all
    frames if the clip has fewer)."""
    return evenly_spread(timestamps, cfg.num_frames or cfg.max_frames)
