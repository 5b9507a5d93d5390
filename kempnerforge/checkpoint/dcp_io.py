"""Checkpoint layout on disk: DCP shards, Lightning metadata, per-rank state, and a ``latest`` pointer.

One checkpoint is a directory written by every rank (PyTorch Distributed Checkpoint,
``torch.distributed.checkpoint``; resharding on load is DCP's)::

    <dirpath>/
      step=00000100.ckpt/          a complete checkpoint
        .metadata, __*_*.distcp    DCP: model and optimizer shards (every rank)
        meta.pt                    Lightning state: loops, callbacks, LR schedulers, hparams (rank 0)
        rank_00000.pt ...          per-rank state: RNG, dataloader position (every rank)
        checksums_00000.json ...   each rank's files with their sizes and checksums, hashed while written
                                   (every rank; kempnerforge.checkpoint.checksum)
        COMPLETE                   completion marker, written after every rank finished (rank 0)
      step=00000200.ckpt.partial/  a save in progress (renamed when every rank has finished)
      latest                       text: the name of the newest complete checkpoint

Small items every rank holds (the flattened optimizer's ``param_groups`` and ``step`` per parameter) are written
by rank 0 (:mod:`~kempnerforge.checkpoint.save_planner`), so a restore opens its own shard file and rank 0's.

A save goes to ``<name>.partial`` and is renamed into place only after all ranks finished writing,
then ``latest`` is replaced atomically, so a crash mid-save never leaves a directory that looks
complete and never moves ``latest``. A directory without ``COMPLETE`` is never chosen for a resume.

With ``async_save=True`` the save is ``torch.distributed.checkpoint.async_save`` with a
:class:`~torch.distributed.checkpoint.staging.DefaultStager` kept for the run: on the training
thread it only copies this rank's shards device-to-host (into pinned host buffers, with non-blocking copies and
one synchronize, on CUDA; a plain host copy on CPU; the buffers allocated once, in the background after the first
optimizer step: :meth:`DCPCheckpointIO.prestage`), then the shards are written by DCP's upload thread. A checkpoint worker thread on every rank
waits for that upload, meets the other ranks in a barrier on a gloo group of its own (never on the
training thread, never on training's group), and on rank 0 writes ``COMPLETE``, renames the
directory, moves ``latest`` and runs the commit hooks (retention). So ``latest`` names the new
checkpoint as soon as every rank's shards are on disk, not at the next save.

Deletions (``ModelCheckpoint(save_top_k=...)``, :meth:`DCPCheckpointIO.remove_checkpoint`) run on
the same worker, after every save already started has completed, and never touch the checkpoint
``latest`` names nor one listed in ``<dirpath>/protected``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from typing_extensions import override

from kempnerforge.checkpoint.checksum import (
    COMPLETE_LINE,
    ChecksumFileSystemWriter,
    Manifests,
    Record,
    save_hashed,
    write_manifest,
)
from kempnerforge.checkpoint.disk import CheckpointSpaceError, format_bytes, space_errno, space_error
from kempnerforge.checkpoint.errors import CheckpointError, CorruptCheckpointError
from kempnerforge.checkpoint.layout import (
    COMPLETE_FILE,
    LATEST_FILE,
    META_FILE,
    PARTIAL_SUFFIX,
    delete_checkpoint,
    kept_reason,
    latest_name,
    partial_path,
    rank_file,
    write_latest,
)
from kempnerforge.checkpoint.save_planner import SmallReplicasOnRankZero
from kempnerforge.checkpoint.verify import NamingFileSystemReader, verify_rank_files

__all__ = [
    "COMPLETE_FILE",
    "LATEST_FILE",
    "META_FILE",
    "PARTIAL_SUFFIX",
    "WEIGHTS_ONLY_KEY",
    "CheckpointError",
    "CheckpointSpaceError",
    "CorruptCheckpointError",
    "DCPCheckpointIO",
    "rank_file",
]

log = logging.getLogger(__name__)

#: ``meta.pt`` key marking a checkpoint that holds model weights only (``kforge convert hf-to-dcp``):
#: resuming from it starts a fresh optimizer, LR schedule, loop and data position.
WEIGHTS_ONLY_KEY = "kempnerforge_weights_only"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def _nbytes(tree: Any) -> int:
    """Bytes of this rank's part of the tensors in ``tree`` (a DTensor counts its local shard)."""
    return sum(getattr(t, "_local_tensor", t).nbytes for t in _tensors(tree))


def _save_file(obj: Any, file: Path, record: Record) -> None:
    # A Python file object, not a path: PyTorch's own file writer reports a full disk as "unexpected pos",
    # losing the errno that _failed_save looks for. Hashed on the way (kempnerforge.checkpoint.checksum).
    save_hashed(obj, file, record)


def _where_to_look(path: Path) -> str:
    """The hint after "not a complete checkpoint": a Hugging Face folder is imported first; otherwise the ``latest``
    pointer beside it, when there is one."""
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return f"It is a Hugging Face folder: import it with `kforge convert hf-to-dcp --hf_dir {path} --output_dir <folder>`."
    if (path.parent / LATEST_FILE).is_file():
        return f"The newest complete checkpoint is named in {path.parent / LATEST_FILE}."
    return "Give a checkpoint folder (step=N.ckpt) or the folder holding its `latest` file."


def _saved_line(path: Path, step: int | None, nbytes: int, seconds: float, stall: float | None = None) -> None:
    """Rank 0's one line per completed save: where, which step, how big, how long (async: and how long training
    waited for the device-to-host copy)."""
    at = f"step {step}, " if step is not None else ""
    how = f"{seconds:.1f} s" if stall is None else f"{seconds:.1f} s in the background, the step waited {stall:.2f} s"
    rank_zero_info(f"Checkpoint saved: {path} ({at}{format_bytes(nbytes)}, {how})")


def _failed_save(err: BaseException, tmp: Path, path: Path, needed: int) -> None:
    """After a save failed on this rank: remove its ``.partial`` (never resumed from; every failing rank tries,
    so it goes even when rank 0 is fine) and, when the disk or quota was full, raise that with the numbers.

    Raises:
        CheckpointSpaceError: ``err`` is ENOSPC / EDQUOT (chained to ``err``).
    """
    shutil.rmtree(tmp, ignore_errors=True)
    code = space_errno(err)
    if code is not None:
        raise space_error(code, path, needed) from err


def staging_options(state: dict[str, Any]) -> StagingOptions:
    """DCP staging for ``state``: pinned host buffers and non-blocking device-to-host copies when its tensors
    are on CUDA, a plain host copy otherwise (no shared memory: DCP's upload is a thread, not a process)."""
    cuda = any(t.device.type == "cuda" for t in _tensors(state))
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
    )


class DCPCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` for sharded DCP checkpoints; every rank calls :meth:`save_checkpoint`.

    The strategy splits Lightning's checkpoint dict: tensors that are sharded (``state_dict``,
    ``optimizer_states``) go through DCP (:meth:`load_sharded` on the way back), and the rest goes
    to ``meta.pt`` (rank 0) and ``rank_*.pt`` (each rank) through :meth:`save_checkpoint`.

    Args:
        async_save: stage and return; the shards are written and the save completed in the background
            (see the module docstring). At most one save is in flight: the next :meth:`save_checkpoint`
            first waits for the previous one. Enabled through ``KempnerStrategy(async_checkpoint=True)``.
        timeout: collective timeout of the background save's gloo group (None: torch's default, 30 min).

    Raises:
        ValueError: ``async_save`` is not a bool.
    """

    def __init__(self, async_save: bool = False, timeout: timedelta | None = None) -> None:
        super().__init__()
        if not isinstance(async_save, bool):
            raise ValueError(f"DCPCheckpointIO async_save={async_save!r} is not allowed; use True or False.")
        self.async_save = async_save
        self.timeout = timeout
        self._worker: ThreadPoolExecutor | None = None
        self._tasks: list[Future] = []
        self._stager: DefaultStager | None = None
        self._async_group: Any = None
        self._commit_hooks: list[Callable[[Path], None]] = []
        self._manifests: tuple[Path, Manifests] | None = None  # the checkpoint being restored and its records

    # -- saving ----------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        """Write one checkpoint directory atomically and move ``latest`` to it (with ``async_save``: stage this
        rank's shards to host memory and return; the rest happens on the checkpoint worker).

        Args:
            checkpoint: Lightning's dict with ``state_dict`` and ``optimizer_states`` holding sharded
                (DTensor) state, and ``rank_state`` holding this rank's private state.
            path: final checkpoint directory (same on every rank).
            storage_options: unsupported; must be None.

        Raises:
            TypeError: ``storage_options`` is given.
            CheckpointSpaceError: the disk or the quota is full (names the checkpoint, needed and free bytes); the
                ``.partial`` directory is removed first (by every rank that failed), as after any failed save.
            CheckpointException: from DCP, when writing the previous async save or this one failed on any rank.
        """
        if storage_options is not None:
            raise TypeError("DCPCheckpointIO.save_checkpoint does not take storage_options.")
        self.wait()  # one save in flight at most: the previous one has completed (or raised) first
        start = time.perf_counter()
        step = checkpoint.get("global_step")
        path = Path(path)
        tmp = partial_path(path)
        if _rank() == 0 and tmp.exists():
            shutil.rmtree(tmp)  # leftovers of a crashed save of the same step
        _barrier()
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for i, opt_state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{i}"] = opt_state
        needed = _nbytes(sharded) * _world()  # shards are about even across ranks
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            record = Record()  # this rank's files, hashed while written; its checksums_<rank>.json at the end
            _save_file(checkpoint.pop("rank_state", {}), rank_file(tmp, _rank()), record)
            if _rank() == 0:
                _save_file({**checkpoint, "world_size": _world()}, tmp / META_FILE, record)
            writer = ChecksumFileSystemWriter(tmp, record)
            if self.async_save:
                group = self._group()
                if self._stager is None:
                    self._stager = DefaultStager(staging_options(sharded))
                # The stager's device-to-host copy is the only part on this thread; DCP's upload thread writes.
                upload = dcp.async_save(
                    sharded,
                    checkpoint_id=tmp,
                    storage_writer=writer,
                    planner=SmallReplicasOnRankZero(),
                    process_group=group,
                    async_stager=self._stager,
                )
                stall = time.perf_counter() - start
                self._submit(self._finish_async, upload, tmp, path, group, needed, record, (start, stall, step))
                return
            dcp.save(sharded, checkpoint_id=tmp, storage_writer=writer, planner=SmallReplicasOnRankZero())
            write_manifest(tmp, _rank(), record)
        except BaseException as err:
            _failed_save(err, tmp, path, needed)
            raise
        _barrier()  # every rank has written its shards and rank file
        if _rank() == 0:
            self._mark_complete(tmp, path)
            _saved_line(path, step, needed, time.perf_counter() - start)
            if self._commit_hooks:
                self._submit(self._run_commit_hooks, path)
        _barrier()

    def prestage(self, sharded: dict[str, Any]) -> None:
        """Async saves: allocate (and fault in) the host staging buffers for ``sharded`` now, on the checkpoint
        worker, by staging it once, so the first save's training-thread stall is the copy alone, as every later
        save's is (a first save otherwise also allocates one host copy of the rank's shards: on CPU 1.2 s of page
        faults for 3.7 GB, on CUDA the pinned allocation). The values staged are discarded; the training thread
        may go on meanwhile (the next save waits for this first). Called once, after the first optimizer step (the
        optimizer's state exists); no-op for synchronous saves or when buffers exist.

        Args:
            sharded: ``{"state_dict": model state, "optimizer_<i>": optimizer state}`` as a save stages it (views
                of the live tensors).
        """
        if not self.async_save or self._stager is not None:
            return
        self._stager = DefaultStager(staging_options(sharded))
        stager = self._stager
        device = next((t.device for t in _tensors(sharded) if t.device.type == "cuda"), None)

        def stage() -> None:
            # On this rank's GPU: a new thread's current device is cuda:0, where the stager's synchronize would
            # otherwise open a context of its own (every rank's, with all GPUs visible).
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                stager.stage(sharded)

        self._submit(stage)

    def _group(self) -> Any:
        # The background save's collectives run on a group of their own, apart from training's.
        if self._async_group is None and dist.is_available() and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._async_group

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kforge-checkpoint")
        self._tasks.append(self._worker.submit(fn, *args))

    def _finish_async(
        self,
        upload: Future,
        tmp: Path,
        path: Path,
        group: Any,
        needed: int,
        record: Record,
        timing: tuple[float, float, int | None],
    ) -> None:
        """Checkpoint worker, every rank: this rank's upload and checksum record, then all ranks' (barrier), then
        rank 0 completes it and says so (``timing``: the save's start, the seconds training waited, its step)."""
        try:
            upload.result()  # DCP raises on every rank when any rank's write failed
            write_manifest(tmp, _rank(), record)  # rank 0's holds .metadata: DCP wrote it before the upload ended
        except BaseException as err:
            _failed_save(err, tmp, path, needed)
            raise
        if group is not None:
            dist.barrier(group=group)
        if _rank() == 0:
            self._mark_complete(tmp, path)
            start, stall, step = timing
            _saved_line(path, step, needed, time.perf_counter() - start, stall)
            self._run_commit_hooks(path)

    @staticmethod
    def _mark_complete(tmp: Path, path: Path) -> None:
        """Rank 0: marker, rename, ``latest`` (in this order: a crash in between never moves ``latest``)."""
        (tmp / COMPLETE_FILE).write_text(f"world_size={_world()}\n{COMPLETE_LINE}\n")
        if path.exists():
            delete_checkpoint(path)  # an older save of the same step (a run redoing steps after a resume)
        os.replace(tmp, path)
        write_latest(path)

    def add_commit_hook(self, hook: Callable[[Path], None]) -> None:
        """Call ``hook(checkpoint_path)`` on rank 0, on the checkpoint worker, after each save is complete and
        ``latest`` names it (:class:`~kempnerforge.callbacks.CheckpointRetention` prunes there). A hook that
        raises is logged, never fatal."""
        if hook not in self._commit_hooks:
            self._commit_hooks.append(hook)

    def remove_commit_hook(self, hook: Callable[[Path], None]) -> None:
        """Undo :meth:`add_commit_hook` (no error when ``hook`` is not registered)."""
        if hook in self._commit_hooks:
            self._commit_hooks.remove(hook)

    def _run_commit_hooks(self, path: Path) -> None:
        for hook in list(self._commit_hooks):
            try:
                hook(path)
            except Exception:  # housekeeping after a complete save must not fail the run
                log.exception("Checkpoint commit hook %r failed after %s", hook, path)

    # -- waiting and shutting down ---------------------------------------------------------------

    def wait(self) -> None:
        """Block until this rank's background checkpoint work is done: the save in flight (upload, barrier and,
        on rank 0, completion), queued deletions and commit hooks. No collective on the calling thread.

        Raises:
            CheckpointException / RuntimeError: the background save failed (re-raised here, on every rank).
        """
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.result()

    @override
    def teardown(self) -> None:
        """End of ``fit``: :meth:`wait`, then release the worker, the staging buffers and the gloo group."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._release()

    def abandon(self) -> None:
        """After an exception: return at once, without waiting and without any collective on this thread.
        Work already queued goes on on the worker (joined at interpreter exit): a save being written
        completes and becomes ``latest`` if every rank's upload finishes, else its barrier fails once the
        other ranks are gone and it stays a ``.partial``."""
        self._tasks = []
        if self._worker is not None:
            self._worker.shutdown(wait=False)
        self._release()

    def _release(self) -> None:
        self._worker = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._async_group = None

    # -- loading ---------------------------------------------------------------------------------

    def resolve(self, path: _PATH) -> Path:
        """Turn a user's ``--ckpt_path`` into a complete checkpoint directory.

        Accepts a checkpoint directory, or a folder holding a ``latest`` pointer (the newest complete
        checkpoint in it is taken).

        Raises:
            CheckpointError: the path does not exist, holds a damaged ``latest``, is a save in progress / crashed
                save, or is missing DCP metadata, ``meta.pt`` or the ``COMPLETE`` marker (names what is missing).
        """
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"Checkpoint path {path} does not exist.")
        name = latest_name(path) if path.is_dir() else None  # CheckpointError for a damaged pointer
        if name is not None:
            path = path / name
        if path.name.endswith(PARTIAL_SUFFIX):
            raise CheckpointError(
                f"{path} is a partial checkpoint (a save that did not finish); resume from the directory "
                f"that {path.parent / LATEST_FILE} names instead."
            )
        missing = [n for n in (".metadata", META_FILE, COMPLETE_FILE) if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path} is not a complete kempnerforge checkpoint: missing {', '.join(missing)}. "
                                  + _where_to_look(path))  # fmt: skip
        return path

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Load ``meta.pt`` and this rank's ``rank_state`` (sharded tensors load via :meth:`load_sharded`), after
        checking the files this rank reads and no other (:func:`~kempnerforge.checkpoint.verify.verify_rank_files`:
        ``.metadata``, ``meta.pt``, its state file).

        Always unpickles with ``weights_only=True``: checkpoints never execute arbitrary code.

        Raises:
            CheckpointError: from :meth:`resolve`.
            CorruptCheckpointError: ``.metadata``, ``meta.pt`` or this rank's state file is missing, fails its checksum
                or does not load (names it).

        Returns:
            Lightning's checkpoint dict without model/optimizer tensors, plus ``rank_state`` (this
            rank's entry; rank 0's when the checkpoint was written by fewer ranks) and ``world_size``.
        """
        path = self.resolve(path)
        # This rank checks only the files it reads (their writers' records); the DCP loads that follow share the
        # records, so a file is hashed once per restore.
        self._manifests = (path, Manifests(path))
        return verify_rank_files(path, _rank(), self._manifests[1])

    def load_sharded(self, state: dict[str, Any], path: Path) -> None:
        """DCP-load into the (sharded) state dicts of ``state`` in place, resharding as needed; this rank checks the
        shard files of its read plan first (:class:`~kempnerforge.checkpoint.verify.NamingFileSystemReader`, with
        the records :meth:`load_checkpoint` read for the same checkpoint).

        Raises:
            CheckpointException: DCP's, on every rank when any rank's read failed; a shard that cannot be read
                is named by a :class:`CorruptCheckpointError` inside it (:func:`~kempnerforge.checkpoint.verify.first_failure`).
        """
        known = self._manifests
        manifests = known[1].sibling(context=False) if known is not None and known[0] == Path(path) else None
        dcp.load(state, storage_reader=NamingFileSystemReader(path, manifests=manifests))

    # -- deleting --------------------------------------------------------------------------------

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete one checkpoint (Lightning calls this on rank 0 for ``save_top_k``) on the checkpoint worker:
        after every save already started has completed, and never the one ``latest`` names then nor one in
        ``<dirpath>/protected`` (those are kept, with an info line)."""
        self._submit(self._remove, Path(path))

    @staticmethod
    def _remove(path: Path) -> None:
        reason = kept_reason(path)
        if reason is not None:
            log.info("Checkpoint %s kept although asked to remove it: %s.", path, reason)
            return
        try:
            delete_checkpoint(path)
        except OSError:
            log.exception("Could not delete checkpoint %s", path)
