"""Checkpoint layout on disk: DCP shards, Lightning metadata, per-rank state, and a ``latest`` pointer.

One checkpoint is a directory written by every rank (PyTorch Distributed Checkpoint,
``torch.distributed.checkpoint``; resharding on load is DCP's)::

    <dirpath>/
      step=00000100.ckpt/          a complete checkpoint
        .metadata, __*_*.distcp    DCP: model and optimizer shards (every rank)
        meta.pt                    Lightning state: loops, callbacks, LR schedulers, hparams (rank 0)
        rank_00000.pt ...          per-rank state: RNG, dataloader position (every rank)
        COMPLETE                   completion marker, written after every rank finished (rank 0)
      step=00000200.ckpt.partial/  a save in progress (renamed when every rank has finished)
      latest                       text: the name of the newest complete checkpoint

A save goes to ``<name>.partial`` and is renamed into place only after all ranks finished writing,
then ``latest`` is replaced atomically, so a crash mid-save never leaves a directory that looks
complete and never moves ``latest``. A directory without ``COMPLETE`` is never chosen for a resume.

With ``async_save=True`` the DCP shards are written by ``torch.distributed.checkpoint.async_save``
in a background thread after a synchronous copy of the state (staging) that finishes before
``save_checkpoint`` returns, so the optimizer may change the parameters right away. The marker,
the rename and ``latest`` wait until every rank's upload finished: they happen at the next save or
at :meth:`DCPCheckpointIO.teardown` (end of ``fit``); until then the previous checkpoint stays latest.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO

META_FILE = "meta.pt"
LATEST_FILE = "latest"
PARTIAL_SUFFIX = ".partial"
COMPLETE_FILE = "COMPLETE"
#: ``meta.pt`` key marking a checkpoint that holds model weights only (``kforge convert hf-to-dcp``):
#: resuming from it starts a fresh optimizer, LR schedule, loop and data position.
WEIGHTS_ONLY_KEY = "kempnerforge_weights_only"


class CheckpointError(RuntimeError):
    """A checkpoint path that cannot be loaded: missing, incomplete, or written under another layout."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_file(path: Path, rank: int) -> Path:
    """Path of rank ``rank``'s per-rank state file inside checkpoint ``path``."""
    return path / f"rank_{rank:05d}.pt"


class DCPCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` for sharded DCP checkpoints; every rank calls every method.

    The strategy splits Lightning's checkpoint dict: tensors that are sharded (``state_dict``,
    ``optimizer_states``) go through DCP (:meth:`load_sharded` on the way back), and the rest goes
    to ``meta.pt`` (rank 0) and ``rank_*.pt`` (each rank) through :meth:`save_checkpoint`.

    Args:
        async_save: write the DCP shards in the background (see the module docstring); at most one
            save is in flight, and it is completed (marker, rename, ``latest``) before the next one starts.
            Enabled through ``KempnerStrategy(async_checkpoint=True)``.

    Raises:
        ValueError: ``async_save`` is not a bool.
    """

    def __init__(self, async_save: bool = False) -> None:
        super().__init__()
        if not isinstance(async_save, bool):
            raise ValueError(f"DCPCheckpointIO async_save={async_save!r} is not allowed; use True or False.")
        self.async_save = async_save
        self._pending: tuple[Future, Path, Path] | None = None
        self._async_group: Any = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        """Write one checkpoint directory atomically and move ``latest`` to it (with ``async_save``:
        stage and start the upload; completion happens at the next save or at :meth:`teardown`).

        Args:
            checkpoint: Lightning's dict with ``state_dict`` and ``optimizer_states`` holding sharded
                (DTensor) state, and ``rank_state`` holding this rank's private state.
            path: final checkpoint directory (same on every rank).
            storage_options: unsupported; must be None.

        Raises:
            TypeError: ``storage_options`` is given.
        """
        if storage_options is not None:
            raise TypeError("DCPCheckpointIO.save_checkpoint does not take storage_options.")
        self.finalize_pending()  # one save in flight at most; the previous one completes first
        path = Path(path)
        tmp = path.with_name(path.name + PARTIAL_SUFFIX)
        if _rank() == 0 and tmp.exists():
            shutil.rmtree(tmp)  # leftovers of a crashed save of the same step
        _barrier()
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{i}"] = opt_state
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint.pop("rank_state", {}), rank_file(tmp, _rank()))
        if _rank() == 0:
            torch.save({**checkpoint, "world_size": _world()}, tmp / META_FILE)
        if self.async_save:
            # Staging (a copy of every tensor) completes inside async_save, before it returns.
            self._pending = (dcp.async_save(sharded, checkpoint_id=tmp, process_group=self._group()), tmp, path)
            return
        dcp.save(sharded, checkpoint_id=tmp)
        self._commit(tmp, path)

    def _group(self) -> Any:
        # The background upload runs collectives; a group of its own keeps them apart from training's.
        if self._async_group is None and dist.is_available() and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def finalize_pending(self) -> None:
        """Wait for an async save's upload on this rank, then complete it on all ranks (collective)."""
        if self._pending is not None:
            future, tmp, path = self._pending
            self._pending = None
            future.result()
            self._commit(tmp, path)

    def teardown(self) -> None:
        """Complete a pending async save (Lightning calls this at the end of ``fit``)."""
        self.finalize_pending()

    def _commit(self, tmp: Path, path: Path) -> None:
        _barrier()  # every rank has written its shards and rank file
        if _rank() == 0:
            (tmp / COMPLETE_FILE).write_text(f"world_size={_world()}\n")
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.replace(tmp, path)
            self._write_latest(path)
        _barrier()

    @staticmethod
    def _write_latest(path: Path) -> None:
        pointer = path.parent / LATEST_FILE
        tmp = pointer.with_name(LATEST_FILE + ".tmp")
        tmp.write_text(path.name + "\n")
        os.replace(tmp, pointer)

    def resolve(self, path: _PATH) -> Path:
        """Turn a user's ``--ckpt_path`` into a complete checkpoint directory.

        Accepts a checkpoint directory, or a folder holding a ``latest`` pointer (the newest complete
        checkpoint in it is taken).

        Raises:
            CheckpointError: the path does not exist, is a save in progress / crashed save, or is
                missing DCP metadata, ``meta.pt`` or the ``COMPLETE`` marker (names what is missing).
        """
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"Checkpoint path {path} does not exist.")
        if (path / LATEST_FILE).is_file():
            path = path / (path / LATEST_FILE).read_text().strip()
        if path.name.endswith(PARTIAL_SUFFIX):
            raise CheckpointError(
                f"{path} is a partial checkpoint (a save that did not finish); resume from the directory "
                f"that {path.parent / LATEST_FILE} names instead."
            )
        missing = [n for n in (".metadata", META_FILE, COMPLETE_FILE) if not (path / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{path} is not a complete kempnerforge checkpoint: missing {', '.join(missing)}. "
                f"The newest complete checkpoint is named in {path.parent / LATEST_FILE}."
            )
        return path

    def load_checkpoint(self, path: _PATH, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Load ``meta.pt`` and this rank's ``rank_state`` (sharded tensors load via :meth:`load_sharded`).

        Always unpickles with ``weights_only=True``: checkpoints never execute arbitrary code.

        Returns:
            Lightning's checkpoint dict without model/optimizer tensors, plus ``rank_state`` (this
            rank's entry; rank 0's when the checkpoint was written by fewer ranks; None when there is
            none) and ``world_size``.
        """
        path = self.resolve(path)
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        own = rank_file(path, _rank())
        if not own.is_file():
            # The world grew: every dp rank saved the same dataloader position, so rank 0's serves
            # (merge_rank_state remaps it if the data-parallel degree changed).
            own = rank_file(path, 0)
        meta["rank_state"] = torch.load(own, map_location="cpu", weights_only=True) if own.is_file() else None
        return meta

    @staticmethod
    def load_sharded(state: dict[str, Any], path: Path) -> None:
        """DCP-load into the (sharded) state dicts of ``state`` in place, resharding as needed."""
        dcp.load(state, checkpoint_id=path)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete one checkpoint directory (Lightning calls this on rank 0 for ``save_top_k``)."""
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
