"""PyAV decoding: the packet index equals PyAV's decoded frame timestamps, the seek path gives exactly
the frames of a full sequential decode, only part of a long clip is decoded, bad files are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kempnerforge.data.video_decode import VideoDecodeError, VideoReader, read_frames, require_av
from kempnerforge.data.video_sampling import FrameSampling, sample_frames

av = pytest.importorskip("av")

CLIPS = Path(__file__).resolve().parents[2] / "data" / "videos" / "clips"


def sequential_frames(path: Path, wanted_pts: set[int], stop_pts: int) -> dict[int, np.ndarray]:
    """The oracle: plain PyAV decoding from the start, every frame in order, up to ``stop_pts``."""
    out = {}
    with av.open(str(path)) as c:
        for frame in c.decode(video=0):
            if frame.pts in wanted_pts:
                out[frame.pts] = frame.to_ndarray(format="rgb24")
            if frame.pts >= stop_pts:
                break
    return out


@pytest.mark.parametrize(
    "name, positions",
    [
        ("1000001.webm", [0, 5, 6, 17, 23]),  # VP8, one keyframe: forward decoding only
        ("1000002.mp4", [0, 1, 20, 33, 47]),  # H.264 with B-frames (presentation != decode order)
        ("1000003.webm", [2, 10, 139, 140, 268]),  # VP8, keyframes at 0.4, 0.5, 5.8, 11.1 s: seeks back and forth
    ],
)
def test_seek_path_equals_sequential_decode(name, positions):
    with VideoReader(CLIPS / name) as clip:
        pts = clip.index.pts
        frames = clip.frames(positions)
        decoded = clip.frames_decoded
    oracle = sequential_frames(CLIPS / name, {pts[i] for i in positions}, pts[positions[-1]])
    assert len(oracle) == len(positions)
    for i, frame in zip(positions, frames, strict=True):
        assert frame.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(frame), oracle[pts[i]])
    if name == "1000003.webm":  # frames 139-268 sit after the 5.8-s and 11.1-s keyframes: decoding skips ahead
        assert decoded < positions[-1], decoded


def test_index_equals_decoded_timestamps_and_bytes_equal_files():
    for name in ("1000001.webm", "1000002.mp4"):
        with av.open(str(CLIPS / name)) as c:
            stream = c.streams.video[0]
            oracle = [float(f.pts * stream.time_base) for f in c.decode(stream)]
        with VideoReader(CLIPS / name) as clip:
            assert clip.index.timestamps == oracle
        frames, times = read_frames((CLIPS / name).read_bytes(), lambda ts: [0, len(ts) - 1])
        from_file, _ = read_frames(CLIPS / name, lambda ts: [0, len(ts) - 1])
        assert times == [oracle[0], oracle[-1]]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(frames, from_file, strict=True))


def test_a_long_clip_decodes_only_what_is_sampled():
    """8 frames over the 30-s clip decode well under its 720 frames (seek to the keyframe before each)."""
    with VideoReader(CLIPS / "1000003.webm") as clip:
        assert len(clip.index.pts) == 720 and len(clip.index.keyframe_pts) > 5
        chosen = sample_frames(clip.index.timestamps, FrameSampling("fixed_count", max_frames=8))
        frames = clip.frames(chosen)
        print(f"30-s clip: {clip.frames_decoded} of 720 frames decoded for 8")
        assert len(frames) == 8 and clip.frames_decoded < 0.6 * 720


def test_bad_files_raise_video_decode_error(tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    cut_mp4 = tmp_path / "cut.mp4"
    cut_mp4.write_bytes((CLIPS / "1000002.mp4").read_bytes()[:100_000])
    cut_webm = tmp_path / "cut.webm"  # WebM keeps its header and plays a shorter clip: caught by the duration
    cut_webm.write_bytes((CLIPS / "1000001.webm").read_bytes()[:50_000])
    for path, match in ((text, "cannot open"), (cut_mp4, "cannot open"), (cut_webm, "is truncated")):
        with pytest.raises(VideoDecodeError, match=match) as err:
            VideoReader(path)
        assert str(path) in str(err.value)
    with VideoReader(CLIPS / "1000001.webm") as clip, pytest.raises(ValueError, match="strictly increasing"):
        clip.frames([3, 3])


def test_missing_pyav_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'kempnerforge\[video\]'"):
        require_av()
    with pytest.raises(ImportError, match=r"kempnerforge\[video\]"):
        VideoReader(CLIPS / "1000001.webm")
