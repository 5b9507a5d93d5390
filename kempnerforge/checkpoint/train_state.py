"""Per-rank training state that Lightning's rank-0 ``meta.pt`` cannot hold: RNG streams and dataloader position.

Lightning writes loop state (which includes each stateful dataloader's position) from rank 0 only,
so every other data-parallel rank would resume from rank 0's position. Here each rank moves its own
dataloader state and RNG state into ``rank_state`` before saving, and puts them back on load.
Stored as plain tensors, ints, lists and strings so ``torch.load(weights_only=True)`` reads them.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch

_LOADER_KEYS = ("loops", "fit_loop", "state_dict", "combined_loader")


class DataParallelMismatchError(RuntimeError):
    """A dataloader position saved under one data-parallel degree, resumed under another."""


def collect_rng_state() -> dict[str, Any]:
    """RNG state of torch (CPU and CUDA), numpy and Python's ``random`` for this process, pickle-free."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": [py_version, list(py_internal), py_gauss],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`collect_rng_state` (CUDA streams only when the device count matches)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("torch.cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))


def _loader_parent(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    node: Any = checkpoint
    for key in _LOADER_KEYS[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def split_rank_state(checkpoint: dict[str, Any], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """Move this rank's dataloader state out of ``checkpoint`` and return it with RNG state.

    Returns:
        ``{"rng", "dataloader", "dp_rank", "dp_size"}`` for ``rank_*.pt``.
    """
    parent = _loader_parent(checkpoint)
    loader = parent.pop(_LOADER_KEYS[-1], None) if parent is not None else None
    return {"rng": collect_rng_state(), "dataloader": loader, "dp_rank": dp_rank, "dp_size": dp_size}


def _sampler_states(node: Any, batches: int | None = None) -> list[tuple[dict[str, Any], int | None]]:
    """Every ``_sampler_iter_state`` of a (possibly nested) StatefulDataLoader state, with its batch count."""
    found: list[tuple[dict[str, Any], int | None]] = []
    if isinstance(node, dict):
        batches = node.get("_num_yielded", batches)
        if isinstance(node.get("_sampler_iter_state"), dict):
            found.append((node["_sampler_iter_state"], batches))
        for key, value in node.items():
            if key != "_sampler_iter_state":
                found += _sampler_states(value, batches)
    elif isinstance(node, list | tuple):
        for value in node:
            found += _sampler_states(value, batches)
    return found


def _counts(iter_state: dict[str, Any]) -> tuple[int, int]:
    """(samples the sampler yielded in its current epoch, samples the loader yielded since its iterator started).

    The sampler's count restarts at each of its epochs; the loader's (samples and ``_num_yielded`` batches) run on
    over the epochs of one iterator. The position is the sampler's; the batch size is the loader's pair.
    """
    sampler = iter_state.get("sampler_state") or {}
    total = int(iter_state.get("samples_yielded", sampler.get("yielded", 0)))
    return int(sampler.get("yielded", total)), total


def remap_loader_state(state: Any, saved_dp: int, dp: int, micro_batch_size: int | None = None) -> Any:
    """Move a train dataloader position saved at data-parallel degree ``saved_dp`` to degree ``dp``, exactly.

    :class:`~kempnerforge.data.datamodule.ResumableDistributedSampler` gives rank ``r`` of ``R`` the
    indices ``perm[r::R]`` of one seeded permutation per epoch (which does not depend on ``R``), so
    after ``k`` batches of ``b`` samples on each of ``saved_dp`` ranks the run has consumed exactly
    ``perm[:k * b * saved_dp]``. At degree ``dp`` the same prefix is ``k * b * saved_dp / dp``
    samples per rank; the next global batch is then the same set of windows, provided the global
    batch ``micro_batch_size * dp`` equals the saved ``b * saved_dp`` (scale ``micro_batch_size``
    by ``saved_dp / dp`` when changing the degree). Batch counts (``k``) are kept.

    Args:
        state: the saved ``combined_loader`` state (a list of StatefulDataLoader state dicts).
        saved_dp: data-parallel degree of the saving run.
        dp: data-parallel degree of this run.
        micro_batch_size: this run's per-rank micro-batch (checked when given).

    Returns:
        A remapped copy of ``state``.

    Raises:
        DataParallelMismatchError: no sampler position found in ``state``, samples consumed not
            divisible by ``dp``, or a global batch that changed.
    """
    state = copy.deepcopy(state)
    found = _sampler_states(state)
    if not found:
        raise DataParallelMismatchError(
            f"Cannot remap the dataloader position from dp={saved_dp} to dp={dp}: the saved loader state has no "
            "sampler position (a StatefulDataLoader over ResumableDistributedSampler is needed). Resume with "
            f"dp_replicate*dp_shard={saved_dp}."
        )
    for iter_state, batches in found:
        sampler = iter_state.get("sampler_state") or {}
        yielded, total = _counts(iter_state)
        for count in {yielded, total}:
            if count * saved_dp % dp:
                raise DataParallelMismatchError(
                    f"Cannot remap the dataloader position from dp={saved_dp} to dp={dp}: the run consumed "
                    f"{count} samples per rank x {saved_dp} ranks = {count * saved_dp} samples, not divisible "
                    f"by dp={dp}. Resume with dp_replicate*dp_shard={saved_dp}, or a dp that divides "
                    f"{count * saved_dp}."
                )
        _check_global_batch(total, batches, saved_dp, dp, micro_batch_size)
        if "sampler_state" in iter_state:
            sampler["yielded"] = yielded * saved_dp // dp
        if "samples_yielded" in iter_state:
            iter_state["samples_yielded"] = total * saved_dp // dp
    return state


def _check_global_batch(
    yielded: int, batches: int | None, saved_dp: int, dp: int, micro_batch_size: int | None
) -> None:
    """Refuse a resume whose global batch (``micro_batch_size * dp``) differs from the one the position was saved with.

    Raises:
        DataParallelMismatchError: naming ``data.micro_batch_size`` and the value that keeps the global batch.
    """
    if micro_batch_size is None or not batches:
        return
    saved_batch = yielded // batches
    global_batch = saved_batch * saved_dp
    if global_batch == micro_batch_size * dp:
        return
    fix = (
        f"Set data.micro_batch_size={global_batch // dp}"
        if global_batch % dp == 0
        else f"No data.micro_batch_size does at dp={dp}; use a dp that divides {global_batch}"
    )
    raise DataParallelMismatchError(
        f"data.micro_batch_size: resuming must keep the global batch the checkpoint was trained with: saved "
        f"micro_batch_size*dp = {saved_batch}*{saved_dp} = {global_batch}, this run has {micro_batch_size}*{dp} = "
        f"{micro_batch_size * dp}. {fix}, or start fresh with --ckpt_path null."
    )


def check_accumulation(saved: int | None, now: int | None) -> None:
    """Refuse a resume under another ``trainer.accumulate_grad_batches`` (another global batch per optimizer step).

    Raises:
        DataParallelMismatchError: naming the field, the saved and the new value (nothing when either is unknown).
    """
    if saved is not None and now is not None and int(saved) != int(now):
        raise DataParallelMismatchError(
            f"trainer.accumulate_grad_batches: the checkpoint was trained with {saved} micro-batches per optimizer "
            f"step, this run has {now}: the global batch would change. Keep {saved}, or start fresh with "
            "--ckpt_path null."
        )


def merge_rank_state(
    checkpoint: dict[str, Any],
    rank_state: dict[str, Any] | None,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int | None = None,
) -> None:
    """Restore RNG and put this rank's dataloader state back where Lightning's fit loop reads it.

    Saved under another data-parallel degree, the position is remapped exactly by
    :func:`remap_loader_state` (the global batch must stay the same: scale ``micro_batch_size``).
    Every dp rank has consumed the same number of samples, so when this rank's own file is
    missing (the world grew) the position of any saved rank serves.

    Args:
        checkpoint: Lightning's checkpoint dict (``meta.pt``), updated in place.
        rank_state: this rank's ``rank_*.pt`` (see :func:`split_rank_state`), or None when missing.
        dp_rank: this rank's data-parallel index.
        dp_size: this run's data-parallel degree.
        micro_batch_size: this run's per-rank micro-batch, checked when the degree changed.

    Raises:
        DataParallelMismatchError: no per-rank state at all, a position that cannot be remapped
            exactly (see :func:`remap_loader_state`), or a changed global batch (``micro_batch_size * dp``, at
            any degree); never a silent restart of the data.
    """
    if rank_state is None:
        raise DataParallelMismatchError(
            f"No per-rank state for this rank (dp_rank={dp_rank}) in the checkpoint: it was written by fewer "
            f"ranks (world_size={checkpoint.get('world_size')}). Resume with the same data-parallel degree, or "
            "load weights only."
        )
    saved = rank_state.get("dp_size")
    loader = rank_state.get("dataloader")
    if loader is not None and saved != dp_size:
        loader = remap_loader_state(loader, int(saved), dp_size, micro_batch_size)
    elif loader is not None:  # the same degree: the position holds as saved, but the global batch must too
        for iter_state, batches in _sampler_states(loader):
            _check_global_batch(_counts(iter_state)[1], batches, dp_size, dp_size, micro_batch_size)
    restore_rng_state(rank_state["rng"])
    parent = _loader_parent(checkpoint)
    if parent is not None and loader is not None:
        parent[_LOADER_KEYS[-1]] = loader
