"""Read only the frames a clip needs with PyAV: index timestamps by demuxing, then seek and decode.

The cost model: demuxing a container reads packet headers (timestamps, keyframe flags) without
decoding a pixel, so the index of a 30-s clip costs a few milliseconds. Decoding then starts at the
keyframe at or before each wanted frame (``container.seek``, FFmpeg's ``avformat_seek_file``) and
runs forward only to that frame; when the next wanted frame has no keyframe in between, decoding
simply continues. Frames that are decoded only as references are never converted to RGB.

PyAV is an optional dependency (``pip install 'kempnerforge[video]'``); it is imported when a
clip is opened, so the rest of the package imports without it.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

from PIL import Image

#: What a clip can be read from: a file path or the encoded container bytes.
VideoSource = str | Path | bytes


class VideoDecodeError(ValueError):
    """A clip that cannot be used: unopenable, truncated, without a video stream, or undecodable."""


def require_av() -> Any:
    """Import and return the ``av`` module.

    Raises:
        ImportError: PyAV is not installed; the message names the extra that installs it.
    """
    try:
        import av
    except ImportError as err:
        raise ImportError(
            "video data needs PyAV (the `av` package), which is not installed: pip install 'kempnerforge[video]'"
        ) from err
    return av


@dataclass(frozen=True)
class VideoIndex:
    """Presentation timestamps of a clip's video frames, from its packets (no decoding).

    Attributes:
        pts: every frame's presentation timestamp in ``time_base`` units, strictly increasing
            (presentation order, also for codecs with B-frames).
        keyframe_pts: the subset of ``pts`` that are keyframes (where decoding may start).
        time_base: seconds per ``pts`` unit.
    """

    pts: tuple[int, ...]
    keyframe_pts: tuple[int, ...]
    time_base: Fraction

    @property
    def timestamps(self) -> list[float]:
        """Frame presentation times in seconds (container time: the first need not be 0)."""
        return [float(p * self.time_base) for p in self.pts]


class VideoReader:
    """One clip, opened once: :attr:`index` from demuxing, :meth:`frames` decodes chosen frames.

    Use as a context manager (``with VideoReader(path) as clip: clip.frames([0, 5])``). The first
    video stream is read; audio and other streams are ignored (but their packets take part in the
    truncation check).

    Args:
        source: a file path (.mp4, .webm, .mkv, ... any container FFmpeg opens) or its bytes.
        where: how error messages name the clip (default: the path, or ``"<bytes>"``).

    Attributes:
        index: the :class:`VideoIndex` (read at construction).
        frames_decoded: frames the decoder produced so far, reference frames included (the cost of
            :meth:`frames`; a full decode of the clip would be ``len(index.pts)``).

    Raises:
        ImportError: PyAV missing (see :func:`require_av`).
        VideoDecodeError: the container cannot be opened, has no video stream or no video frame,
            has packets flagged corrupt, or ends well before the duration its header states (a
            truncated file, e.g. an interrupted download; more than 2 frame periods and 0.1 s short).
    """

    def __init__(self, source: VideoSource, where: str | None = None) -> None:
        av = require_av()
        self.where = where or (str(source) if not isinstance(source, bytes) else "<bytes>")
        self.frames_decoded = 0  # frames out of the decoder so far (references included): the cost of frames()
        self._errors = (av.error.FFmpegError, OSError, EOFError)
        try:
            self.container = av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source))
        except self._errors as err:
            raise VideoDecodeError(f"cannot open the clip {self.where}: {err}") from err
        try:
            if not self.container.streams.video:
                raise VideoDecodeError(f"the clip {self.where} has no video stream.")
            self.stream = self.container.streams.video[0]
            self.index = self._read_index()
        except BaseException:
            self.container.close()
            raise

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the container (idempotent)."""
        self.container.close()

    def _read_index(self) -> VideoIndex:
        """Demux every packet once: video pts and keyframes; the latest end time of any stream."""
        video, keys, end_s = [], [], 0.0
        try:
            for packet in self.container.demux():
                if packet.size == 0 or packet.is_discard:  # the flush packet; frames an edit list drops
                    continue
                if packet.is_corrupt:
                    raise VideoDecodeError(f"the clip {self.where} has a corrupt packet at pts {packet.pts}.")
                pts = packet.pts if packet.pts is not None else packet.dts
                if pts is None or packet.time_base is None:
                    continue
                end_s = max(end_s, float((pts + (packet.duration or 0)) * packet.time_base))
                if packet.stream.index == self.stream.index:
                    video.append(pts)
                    if packet.is_keyframe:
                        keys.append(pts)
        except self._errors as err:
            raise VideoDecodeError(f"cannot demux the clip {self.where}: {err}") from err
        if not video:
            raise VideoDecodeError(f"the clip {self.where} holds no video frame.")
        video = sorted(set(video))  # presentation order (B-frames demux out of it); a repeated pts is one frame
        keys = sorted(set(keys)) or video[:1]
        self._check_not_truncated(video, end_s)
        return VideoIndex(tuple(video), tuple(keys), Fraction(self.stream.time_base))

    def _check_not_truncated(self, video_pts: list[int], end_s: float) -> None:
        # A cut file keeps its header (with the full duration) and loses its tail, in every stream
        # at once; comparing against the latest end of *any* stream tolerates audio that outlasts video.
        stated = self.container.duration  # microseconds (AV_TIME_BASE), None when the header lacks it
        if stated is None:
            return
        start = (self.container.start_time or 0) / 1e6
        if len(video_pts) > 1:
            period = float((video_pts[-1] - video_pts[0]) * self.stream.time_base) / (len(video_pts) - 1)
        else:  # one frame left: the stream's nominal rate, if it states one
            rate = self.stream.average_rate or self.stream.guessed_rate
            period = float(1 / rate) if rate else 0.0
        missing = start + stated / 1e6 - end_s
        if missing > max(2 * period, 0.1):
            raise VideoDecodeError(
                f"the clip {self.where} is truncated: its streams end at {end_s:.3f} s but its header states "
                f"{stated / 1e6:.3f} s."
            )

    def frames(self, indices: list[int]) -> list[Image.Image]:
        """Decode the frames at ``indices`` (positions in :attr:`index`), as RGB PIL images.

        Args:
            indices: strictly increasing positions in ``index.pts``.

        Returns:
            One RGB image per index, at the clip's resolution (the encoder's processor resizes).

        Raises:
            ValueError: indices out of range or not strictly increasing.
            VideoDecodeError: the decoder fails, or a frame listed in the index never comes out.
        """
        pts = self.index.pts
        if any(not 0 <= i < len(pts) for i in indices) or any(b <= a for a, b in pairwise(indices)):
            raise ValueError(f"frame indices must be strictly increasing in [0, {len(pts)}), got {indices}.")
        try:
            return self._decode([pts[i] for i in indices])
        except self._errors as err:
            raise VideoDecodeError(f"cannot decode the clip {self.where}: {err}") from err

    def _decode(self, targets: list[int]) -> list[Image.Image]:
        keys, out = self.index.keyframe_pts, []
        decoded, position = None, None  # the frame iterator and the pts it last produced
        for target in targets:
            key = keys[max(bisect.bisect_right(keys, target) - 1, 0)]
            if decoded is None or position is None or key > position:
                # Seeking beats decoding forward only past a keyframe: decoding must restart there anyway.
                self.container.seek(key, stream=self.stream, backward=True, any_frame=False)
                decoded = self.container.decode(self.stream)
            frame = None
            for frame in decoded:
                self.frames_decoded += 1
                if frame.pts is None:
                    continue
                position = frame.pts
                if frame.pts >= target:
                    break
            if frame is None or frame.pts != target:
                got = None if frame is None else frame.pts
                raise VideoDecodeError(f"the clip {self.where} did not decode the frame at pts {target} (got {got}).")
            out.append(frame.to_image())
        return out


def read_frames(
    source: VideoSource, choose: Callable[[list[float]], list[int]], where: str | None = None
) -> tuple[list[Image.Image], list[float]]:
    """Open a clip, pick frames from its timestamps, decode only those.

    Args:
        source: path or bytes (see :class:`VideoReader`).
        choose: ``timestamps (seconds) -> strictly increasing frame indices`` (a sampling policy).
        where: name of the clip in error messages.

    Returns:
        ``(frames, timestamps)``: RGB PIL images and their presentation times in seconds.

    Raises:
        VideoDecodeError: see :class:`VideoReader`; ImportError without PyAV.
    """
    with VideoReader(source, where) as clip:
        times = clip.index.timestamps
        indices = list(choose(times))
        return clip.frames(indices), [times[i] for i in indices]
