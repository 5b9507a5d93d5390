"""LightningDataModule over a weighted mixture of memmap token sources with annealing phases."""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from kempnerforge.data.datamodule import TokenDataModule, scans_token_ids
from kempnerforge.data.memmap import MemmapTokenDataset
from kempnerforge.data.mixture import AnnealingPhase, MixtureSampler, MixtureSchedule, MixtureSource
from kempnerforge.data.worker_signals import ignore_stop_signals


class SourceTagged(Dataset):
    """A concatenation of sources whose items also carry ``"source"``: the source number (int64 scalar)."""

    def __init__(self, parts: list[MemmapTokenDataset]) -> None:
        self.concat = ConcatDataset(parts)

    def __len__(self) -> int:
        return len(self.concat)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        src = bisect.bisect_right(self.concat.cumulative_sizes, index)
        return {**self.concat[index], "source": torch.tensor(src)}


class MixtureDataModule(TokenDataModule):
    """Train on a weighted mixture of token sources; validate on each source's held-out windows.

    Each source is a folder of memmap token shards (``kforge prepare-data``); its last
    ``val_fraction`` of windows are held out. Training batches come from a
    :class:`~kempnerforge.data.mixture.MixtureSampler` (weights with ``temperature``, annealing
    ``phases``; exact resume through the ``StatefulDataLoader`` state) and carry ``source``
    (micro_batch_size,) int64 next to ``input_ids`` / ``labels``. The module reads :meth:`lr_scale`
    to apply the phases' LR multipliers. The epoch never ends: train by ``trainer.max_steps``
    and validate with an integer ``val_check_interval`` and ``check_val_every_n_epoch: null``.

    Args:
        sources: the mixture (name, data_dir, weight).
        seq_len, micro_batch_size, val_fraction, num_workers, vocab_size, document_masking: as in
            :class:`~kempnerforge.data.datamodule.TokenDataModule`.
        data_seed: the data seed (draws of the mixture and per-source permutations), separate from the
            model's ``init_seed``.
        temperature: sampling temperature (> 0): probabilities ``w^(1/T)`` normalized.
        phases: annealing phases by optimizer step.

    Raises:
        ValueError: no sources, duplicate names, bad weights / phases / temperature (at construction),
            a source with too few windows (in :meth:`setup`).
    """

    def __init__(
        self,
        sources: list[MixtureSource],
        seq_len: int = 256,
        micro_batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        data_seed: int = 0,
        vocab_size: int | None = None,
        temperature: float = 1.0,
        phases: list[AnnealingPhase] | None = None,
        document_masking: bool = False,
    ) -> None:
        if not sources:
            raise ValueError("data.sources must list at least one MixtureSource (name, data_dir, weight).")
        super().__init__(
            data_dir=sources[0].data_dir,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            val_fraction=val_fraction,
            num_workers=num_workers,
            data_seed=data_seed,
            vocab_size=vocab_size,
            document_masking=document_masking,
        )
        self.sources = list(sources)
        self.schedule = MixtureSchedule(self.sources, list(phases or []), temperature)
        # Plain dicts only, so the checkpoint's metadata loads with torch.load(weights_only=True).
        self.save_hyperparameters(
            {
                "sources": [asdict(s) for s in self.sources],
                "phases": [asdict(p) for p in phases or []],
                "temperature": temperature,
                "seq_len": seq_len,
                "micro_batch_size": micro_batch_size,
                "val_fraction": val_fraction,
                "num_workers": num_workers,
                "data_seed": data_seed,
                "vocab_size": vocab_size,
                "document_masking": document_masking,
            }
        )
        self.train_sizes: list[int] = []

    def lr_scale(self, step: int) -> float:
        """LR multiplier of the annealing phase in force at optimizer ``step``."""
        return self.schedule.lr_scale(step)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Open every source and split its windows into train / val; idempotent.

        Raises:
            ValueError: a source with no training window.
        """
        if self.train_dataset is not None:
            return
        trains, vals = [], []
        for src in self.sources:
            data = MemmapTokenDataset(
                src.data_dir,
                self.seq_len,
                vocab_size=self.vocab_size,
                check_token_ids=scans_token_ids(getattr(self, "trainer", None)),
                document_masking=self.document_masking,
            )
            n = len(data)
            n_val = math.ceil(n * self.val_fraction)
            if n - n_val < 1:
                raise ValueError(f"mixture source {src.name!r} ({src.data_dir}) has {n} windows of seq_len="
                                 f"{self.seq_len}: none left for training after val_fraction={self.val_fraction}")  # fmt: skip
            trains.append(data.windows(0, n - n_val))
            if n_val:
                vals.append(data.windows(n - n_val, n))
        self.train_sizes = [len(t) for t in trains]
        self.train_dataset = SourceTagged(trains)
        self.val_dataset = SourceTagged(vals) if vals else None

    @override
    def train_dataloader(self) -> StatefulDataLoader:
        """Infinite loader of ``{"input_ids", "labels", "source"}`` drawn from the mixture."""
        self.setup("fit")
        rank, dp = self.dp_rank_and_size()
        trainer = self.trainer  # LightningDataModule.trainer: None until a Trainer attaches it
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        sampler = MixtureSampler(
            self.train_sizes, self.schedule, self.micro_batch_size * dp * accumulate, rank, dp, self.data_seed
        )
        return StatefulDataLoader(
            self.train_dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            worker_init_fn=ignore_stop_signals,  # a group signal must not kill the workers first
        )

    def state_summary(self) -> dict[str, Any]:
        """Sources, per-phase probabilities and LR scales (for logs and debugging)."""
        return {
            "sources": [s.name for s in self.sources],
            "phase_starts": list(self.schedule.starts),
            "probabilities": [p.round(4).tolist() for p in self.schedule.probs],
            "lr_scales": list(self.schedule.scales),
        }
