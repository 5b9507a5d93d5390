"""LightningDataModule of video-caption pairs for video-VLM training, with resumable data-parallel sampling."""

from __future__ import annotations

from typing import Any

from kempnerforge.data.video_decode import require_av
from kempnerforge.data.video_sampling import FrameSampling
from kempnerforge.data.video_text import VIDEO_TEXT_FORMATS, VideoTextCollator, VideoTextDataset
from kempnerforge.data.vlm_datamodule import MediaTextDataModule


class VideoTextDataModule(MediaTextDataModule):
    """Train/val loaders of :class:`~kempnerforge.data.video_text.VideoTextDataset` batches.

    The last ``ceil(val_fraction * n)`` clips validate, the rest train (a bad clip falls back to the
    next good one of its own split). Each data-parallel rank takes ``micro_batch_size`` clips per step
    from a :class:`ResumableDistributedSampler` (shuffled, seeded, ``drop_last``), so checkpoints carry
    the position inside an epoch. Frames are decoded in the loader's workers and processed by the
    encoder's image processor (from the LightningModule's ``image_processor()`` in :meth:`setup`).
    Batches are :class:`~kempnerforge.data.video_text.VideoTextCollator`'s: ``pixel_values``
    (batch, F, 3, H, W) with ``F <= max_frames``, ``frame_mask``, text, ``skipped_clips``.

    Args:
        source: the dataset path (see :class:`VideoTextDataset`).
        format: ``csv`` (WebVid), ``jsonl``, ``parquet`` or ``hf`` (a ``save_to_disk`` folder).
        tokenizer: local tokenizer folder (``AutoTokenizer.from_pretrained``; no download); under ``kforge`` its
            default is ``model.init_from``'s folder (the language model's own tokenizer).
        max_text_len: text positions per sample (bos + caption tokens; eos is the last label).
        micro_batch_size: clips per step per data-parallel rank.
        val_fraction: share of clips held out, in [0, 1).
        num_workers: loader processes per rank (each decodes whole clips).
        data_seed: shuffling seed (epoch ``e`` uses ``data_seed + e``), separate from the model's ``init_seed``.
        video_field, text_field: record fields (None: the format's default, see :data:`DEFAULT_FIELDS`).
        vocab_size: the model's vocabulary (linked from ``model.config.vocab_size``); the tokenizer
            must fit in it.
        sampling: frame sampling policy, a registered name (``uniform``, ``fixed_count``; see
            :mod:`~kempnerforge.data.video_sampling`).
        fps: ``uniform``'s frames per second, > 0.
        min_frames, max_frames: frames per clip, 1 <= min_frames <= max_frames; ``max_frames`` bounds
            every policy, so the model's ``max_seq_len`` is checked against ``max_frames * n_visual + max_text_len``.
        num_frames: ``fixed_count``'s frames per clip, <= max_frames (None: max_frames).

    Raises:
        ValueError: a bad argument, naming ``data.<field>`` (at construction); a tokenizer larger than
            ``vocab_size`` or fewer clips than one global batch (in :meth:`setup`).
        ImportError: PyAV is not installed (``pip install 'kempnerforge[video]'``), at construction.
        AllClipsFailedError: every clip file is missing (in :meth:`setup`) or undecodable (when loaded).
    """

    def __init__(
        self,
        source: str,
        tokenizer: str | None = None,
        format: str = "csv",
        max_text_len: int = 64,
        micro_batch_size: int = 4,
        val_fraction: float = 0.0,
        num_workers: int = 0,
        data_seed: int = 0,
        video_field: str | None = None,
        text_field: str | None = None,
        vocab_size: int | None = None,
        sampling: str = "uniform",
        fps: float = 1.0,
        min_frames: int = 1,
        max_frames: int = 8,
        num_frames: int | None = None,
    ) -> None:
        if format not in VIDEO_TEXT_FORMATS:
            raise ValueError(f"data.format={format!r} is not allowed; choose one of {list(VIDEO_TEXT_FORMATS)}.")
        self.frame_sampling = FrameSampling(sampling, fps, min_frames, max_frames, num_frames)
        require_av()
        super().__init__(
            source, tokenizer, format, max_text_len, micro_batch_size, val_fraction, num_workers, data_seed, vocab_size
        )
        self.video_field, self.text_field = video_field, text_field

    @property
    def max_frames(self) -> int:
        """Frames per clip at most (every policy's bound; the model checks ``max_seq_len`` against it)."""
        return self.frame_sampling.max_frames

    def open_dataset(self) -> VideoTextDataset:
        """All clips of ``source`` whose files exist (missing ones are warned about and left out)."""
        return VideoTextDataset(self.source, self.format, self.frame_sampling, self.video_field, self.text_field)

    def split(self, data: VideoTextDataset, start: int, stop: int) -> VideoTextDataset:
        """Clips ``[start, stop)``; fallbacks from a bad clip stay inside the split."""
        return data.subset(start, stop)

    def make_collate(self, tokenizer: Any) -> VideoTextCollator:
        """Text ids + padded ``pixel_values`` (batch, F, 3, H, W) and ``frame_mask`` (batch, F)."""
        return VideoTextCollator(tokenizer, self.processor, self.max_text_len)
