"""Check 3 (frame sampling) on the bundled clips against PyAV's own frame timestamps, plus the policy
contract on synthetic timestamps and the argument checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kempnerforge.data.video_sampling import (
    SAMPLING_POLICIES,
    FrameSampling,
    register_sampling,
    sample_frames,
)

av = pytest.importorskip("av")

CLIPS = Path(__file__).resolve().parents[2] / "data" / "videos" / "clips"
NAMES = ["1000001.webm", "1000002.mp4", "1000003.webm"]  # 1 s VP8, 2 s H.264, 30 s VP8


def pyav_timestamps(name: str) -> list[float]:
    """The oracle: presentation times (s) of every video frame, from plain PyAV. The 1-s and 2-s clips
    are decoded in full; the 30-s clip by its packets' pts (decoding 720 frames here would be slow)."""
    with av.open(str(CLIPS / name)) as c:
        stream = c.streams.video[0]
        if name == "1000003.webm":
            pts = sorted(p.pts for p in c.demux(stream) if p.size)
        else:
            pts = [f.pts for f in c.decode(stream)]
        return [float(p * stream.time_base) for p in pts]


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[float]]:
    return {name: pyav_timestamps(name) for name in NAMES}


def _period(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def _common_checks(times: list[float], chosen: list[int], cfg: FrameSampling) -> None:
    assert chosen[0] == 0 and chosen[-1] == len(times) - 1  # both endpoints
    assert all(b > a for a, b in zip(chosen, chosen[1:], strict=False))  # strictly increasing, no duplicate
    assert min(cfg.min_frames, len(times)) <= len(chosen) <= cfg.max_frames


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fps", [1.0, 4.0, 7.5])
def test_uniform_honours_fps_within_one_frame(name, fps, oracle):
    times = oracle[name]
    cfg = FrameSampling("uniform", fps=fps, min_frames=1, max_frames=1000)
    chosen = sample_frames(times, cfg)
    _common_checks(times, chosen, cfg)
    t0, t1, period = times[0], times[-1], _period(times)
    n_targets = math.floor((t1 - t0) * fps + 1e-9) + 1
    # One frame per target time t0 + k / fps, each within one frame; then the last frame if not already there.
    for k, i in enumerate(chosen[:n_targets]):
        assert abs(times[i] - (t0 + k / fps)) <= period, (k, times[i])
    assert len(chosen) in (n_targets, n_targets + 1)
    print(f"{name} fps={fps}: {len(chosen)} frames, native period {period * 1000:.1f} ms")


@pytest.mark.parametrize("name", NAMES)
def test_uniform_clamped_spreads_evenly_with_endpoints(name, oracle):
    times = oracle[name]
    t0, t1, period = times[0], times[-1], _period(times)
    for cfg, n in (
        (FrameSampling("uniform", fps=24.0, min_frames=1, max_frames=5), 5),  # too many at 24 fps: capped
        (FrameSampling("uniform", fps=0.1, min_frames=6, max_frames=8), 6),  # too few at 0.1 fps: raised
    ):
        chosen = sample_frames(times, cfg)
        _common_checks(times, chosen, cfg)
        assert len(chosen) == n
        for k, i in enumerate(chosen):
            assert abs(times[i] - (t0 + (t1 - t0) * k / (n - 1))) <= period


@pytest.mark.parametrize("name", NAMES)
def test_fixed_count_and_rates_above_native(name, oracle):
    times = oracle[name]
    cfg = FrameSampling("fixed_count", num_frames=7, max_frames=7)
    chosen = sample_frames(times, cfg)
    _common_checks(times, chosen, cfg)
    assert len(chosen) == 7
    t0, t1 = times[0], times[-1]
    assert all(abs(times[i] - (t0 + (t1 - t0) * k / 6)) <= _period(times) for k, i in enumerate(chosen))
    # Above the clip's own rate every frame is taken once (never repeated).
    every = sample_frames(times, FrameSampling("uniform", fps=100.0, max_frames=1000))
    assert every == list(range(len(times)))


def test_policies_on_short_and_irregular_clips():
    assert sample_frames([5.0], FrameSampling("uniform", min_frames=4)) == [0]  # fewer frames than min: all
    assert sample_frames([0.0, 0.1, 0.2], FrameSampling("fixed_count", num_frames=8)) == [0, 1, 2]
    irregular = [0.0, 0.01, 0.02, 0.03, 1.0, 1.01, 2.0]  # a burst, a gap: still distinct frames, endpoints kept
    chosen = sample_frames(irregular, FrameSampling("fixed_count", num_frames=5, max_frames=5))
    assert len(set(chosen)) == 5 and chosen[0] == 0 and chosen[-1] == 6 and chosen == sorted(chosen)


def test_a_new_policy_is_one_registration():
    @register_sampling("test_middle")
    def middle(timestamps, cfg):
        return [len(timestamps) // 2]

    try:
        assert sample_frames([0.0, 1.0, 2.0], FrameSampling("test_middle")) == [1]

        @register_sampling("test_broken")
        def broken(timestamps, cfg):
            return [1, 1]

        with pytest.raises(ValueError, match="returned \\[1, 1\\]"):
            sample_frames([0.0, 1.0, 2.0], FrameSampling("test_broken"))
        with pytest.raises(ValueError, match="already registered"):
            register_sampling("uniform")(middle)
    finally:
        SAMPLING_POLICIES.pop("test_middle", None)
        SAMPLING_POLICIES.pop("test_broken", None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "keyframes_only"}, "data.sampling='keyframes_only' is not registered; choose one of"),
        ({"fps": 0.0}, "data.fps=0.0 must be a finite number > 0"),
        ({"fps": -2.0}, "data.fps=-2.0 must be a finite number > 0"),
        ({"fps": float("inf")}, "data.fps=inf must be a finite number > 0"),
        ({"num_frames": 4}, "data.num_frames=4 applies to sampling='fixed_count'; 'uniform' takes its count"),
        ({"policy": "os.path.no_such_fn"}, "data.sampling='os.path.no_such_fn' is not registered"),
        ({"min_frames": 9, "max_frames": 8}, "data.min_frames=9 must be <= data.max_frames=8"),
        ({"max_frames": 0}, "data.max_frames=0 must be an integer >= 1"),
        (
            {"policy": "fixed_count", "num_frames": 12, "max_frames": 8},
            "data.num_frames=12 must be <= data.max_frames=8",
        ),
    ],
)
def test_bad_sampling_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("[", "\\[").replace("(", "\\(")):
        FrameSampling(**kwargs)


def test_a_policy_by_import_path_and_a_huge_fps_stay_bounded():
    """``data.sampling`` may name a function by import path (what ``kforge fit`` can reach without user imports); an
    fps far above the clip's rate gives every frame once without building duration * fps targets."""
    path = f"{__name__}.middle_frame"
    try:
        cfg = FrameSampling(path, max_frames=4)
        assert sample_frames([0.0, 0.5, 1.0, 1.5], cfg) == [2]
        ts = [k / 24 for k in range(720)]  # 30 s at 24 fps; 1e12 fps used to mean 3e13 targets (hours, GBs)
        assert sample_frames(ts, FrameSampling(fps=1e12, max_frames=720)) == list(range(720))
    finally:
        SAMPLING_POLICIES.pop(path, None)


def middle_frame(timestamps, cfg):
    """A user policy, reached by its import path."""
    return [len(timestamps) // 2]
