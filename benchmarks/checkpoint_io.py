"""How fast a checkpoint is saved and restored next to what the disk itself can do, and how long an async save
stalls the training step.

For each process count of ``--nproc`` (gloo ranks on this host), a decoder of about ``--params`` parameters is
sharded with FSDP2 (fp32, as the strategy holds it), trained two AdamW steps (a forward and backward of one
``--seq``-token sequence per rank: the step time), and then, every rank at once:

- ``disk``: the disk's own sequential bandwidth on a plain file of this rank's checkpoint size, in 16 MiB
  requests: written and ``fsync``-ed (write GB/s; measured before and after the saves, the mean kept: a
  virtual disk's write speed drifts), its pages dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``
  after the fsync, so the read comes from the disk), read back (read GB/s).
- ``save``: a synchronous save of the model and optimizer shards through
  :class:`~kempnerforge.checkpoint.dcp_io.DCPCheckpointIO` as the strategy calls it (DCP shards, hashed while
  written, fsync-ed; ``meta.pt``, the rank file, the checksum record, ``COMPLETE`` and ``latest``): GB/s per rank
  = this rank's shard bytes / wall seconds, and the same save without checksums (DCP's plain
  ``FileSystemWriter``): the checksums' cost.
- ``restore``: the checkpoint's pages dropped from the page cache, then what a resume does on every rank
  (:meth:`DCPCheckpointIO.load_checkpoint`, then :func:`~kempnerforge.checkpoint.sharded_state.
  load_model_and_optimizers`, verifying what it reads): GB/s per rank, and the values restored equal the saved.
- ``async``: the staging buffers allocated in the background as the strategy does after the first optimizer
  step (:meth:`DCPCheckpointIO.prestage`, timed), then three async saves (``DCPCheckpointIO(async_save=True)``):
  the seconds ``save_checkpoint`` keeps the training thread (the stall), as a fraction of the step, next to a
  plain copy of the same shards into preallocated host buffers (the device-to-host copy on CPU: the floor).

Figures are per rank (every rank does the same at once, sharing the disk): per figure the best of ``--rounds``
rounds of the slowest rank, every round's raw seconds in the JSON with the machine, the date and the folder.

    python benchmarks/checkpoint_io.py --params 500e6 --nproc 1 2 --json benchmarks/results/checkpoint_io_2core.json
    python benchmarks/checkpoint_io.py --params 2e6 --nproc 1 2 --seq 16     # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_CHUNK = 16 << 20  # bytes per request of the disk's own measurement


def model_config(params: float):
    """A Llama-shaped decoder with at least ``params`` parameters: width from the size, then as many blocks as it
    takes (vocab 32000 untied, SwiGLU, 128-wide heads; under 20M parameters a narrow one, vocab 256)."""
    from kempnerforge.config.model import ModelConfig
    from kempnerforge.model.transformer import Transformer

    if params < 20e6:
        base = dict(dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    else:
        dim = 1024 if params < 300e6 else 1536 if params < 2e9 else 2048
        base = dict(dim=dim, n_heads=dim // 128, n_kv_heads=dim // 256, vocab_size=32000, multiple_of=256)
    cfg = ModelConfig(n_layers=1, max_seq_len=512, **base)
    with torch.device("meta"):
        one = sum(p.numel() for p in Transformer(cfg).parameters())
        two = sum(p.numel() for p in Transformer(ModelConfig(n_layers=2, max_seq_len=512, **base)).parameters())
    per_block, rest = two - one, 2 * one - two
    return ModelConfig(n_layers=max(1, math.ceil((params - rest) / per_block)), max_seq_len=512, **base)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield getattr(tree, "_local_tensor", tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


def _fingerprint(model, optimizer) -> list[float]:
    """Per parameter: the sum of its local shard and of its AdamW moments (float64): equal before and after a
    restore that brought back the saved values."""
    out = []
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p).detach()
        out.append(float(local.double().sum()))
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state[p][key]
            out.append(float(getattr(state, "_local_tensor", state).double().sum()))
    return out


def _drop_cache(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (they are clean: written and fsync-ed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(path: Path, nbytes: int, read: bool = True) -> dict:
    """Write ``nbytes`` to ``path`` in 16 MiB requests with one fsync, drop its pages, read it back (GB/s each;
    ``read=False``: the write only)."""
    block = torch.randint(0, 256, (_CHUNK,), dtype=torch.uint8).numpy().tobytes()  # not compressible
    nbytes = max(_CHUNK, nbytes - nbytes % _CHUNK)
    dist.barrier()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // _CHUNK):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - start
    if not read:
        path.unlink()
        return {"bytes": nbytes, "write_gb_s": nbytes / write_s / 1e9}
    _drop_cache([path])
    dist.barrier()
    buf = bytearray(_CHUNK)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    read_s = time.perf_counter() - start
    path.unlink()
    return {"bytes": nbytes, "write_gb_s": nbytes / write_s / 1e9, "read_gb_s": nbytes / read_s / 1e9}


def _checkpoint(model, optimizer, step: int) -> dict:
    """What the strategy hands the checkpoint IO (sharded state, no copy; small per-rank state)."""
    from kempnerforge.checkpoint.sharded_state import model_state, optimizer_state

    return {
        "state_dict": model_state(model),
        "optimizer_states": [optimizer_state(model, optimizer)],
        "rank_state": {"rng": torch.get_rng_state()},
        "global_step": step,
        "lr_schedulers": [],
    }


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _plain_save(state: dict, path: Path) -> None:
    """The same shards through DCP's own ``FileSystemWriter`` (no checksum; as many writer threads and the same
    planner), fsync-ed: the checksums' baseline."""
    import torch.distributed.checkpoint as dcp

    from kempnerforge.checkpoint.checksum import WRITER_THREADS
    from kempnerforge.checkpoint.save_planner import SmallReplicasOnRankZero

    sharded = {"state_dict": state["state_dict"], "optimizer_0": state["optimizer_states"][0]}
    writer = dcp.FileSystemWriter(path, thread_count=WRITER_THREADS)
    dcp.save(sharded, checkpoint_id=path, storage_writer=writer, planner=SmallReplicasOnRankZero())


def _copy_floor(state: dict) -> float:
    """Seconds to copy this rank's shards into preallocated host buffers (what staging must at least do)."""
    tensors = list(_tensors({"s": state["state_dict"], "o": state["optimizer_states"]}))
    buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.fill_(0)  # touched: the copy below measures copying, not page faults
    start = time.perf_counter()
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)
    return time.perf_counter() - start


def _zero_(model, optimizer) -> None:
    """Parameters and AdamW moments zeroed: what a restore brings back must come from the files."""
    with torch.no_grad():
        for p in model.parameters():
            getattr(p, "_local_tensor", p).zero_()
            for key in ("exp_avg", "exp_avg_sq"):
                getattr(optimizer.state[p][key], "_local_tensor", optimizer.state[p][key]).zero_()


def _round(model, optimizer, io, root: Path, shard_bytes: int, before: list[float]) -> dict:
    """One round of every measurement on this rank (all ranks at once): the disk, the sync save with and without
    checksums, the restore of each (page cache dropped first, the state zeroed: each restore must bring back
    ``before``). Seconds, the disk's GB/s, and whether each restore gave the saved values."""
    from kempnerforge.checkpoint.sharded_state import load_model_and_optimizers

    rank = dist.get_rank()
    rec = {"disk": disk_bandwidth(root.parent / f"disk_{rank}.bin", shard_bytes)}
    path, plain = root / "ckpt" / "step=2.ckpt", root / "plain" / "step=2.ckpt"
    rec["save_s"] = _timed(lambda: io.save_checkpoint(_checkpoint(model, optimizer, 2), path))
    rec["save_plain_s"] = _timed(lambda: _plain_save(_checkpoint(model, optimizer, 2), plain))
    # The disk's write speed drifts (a virtual disk, other jobs): measured again after the saves, and the mean kept.
    rec["disk_after"] = disk_bandwidth(root.parent / f"disk_{rank}.bin", shard_bytes, read=False)
    for name, folder in (("restore_s", path), ("restore_plain_s", plain)):
        _zero_(model, optimizer)
        if rank == 0:
            _drop_cache([f for f in folder.iterdir() if f.is_file()])
        if folder is path:
            rec[name] = _timed(
                lambda: (io.load_checkpoint(path), load_model_and_optimizers(model, [optimizer], path, io))
            )
        else:  # no kempnerforge files, no checksum records: the same DCP read, unverified
            rec[name] = _timed(lambda: load_model_and_optimizers(model, [optimizer], plain, io))
        rec[name.replace("_s", "_equal")] = _fingerprint(model, optimizer) == before
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    return rec


def rank_main(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    """One rank's measurements; rank 0 writes ``{figure: [per rank]}`` to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from kempnerforge.checkpoint.dcp_io import DCPCheckpointIO
    from kempnerforge.model.rope import model_rope_tables
    from kempnerforge.model.transformer import Transformer
    from kempnerforge.parallel.fsdp import apply_fsdp

    cfg = model_config(args.params)
    with torch.device("meta"):
        model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    apply_fsdp(model, init_device_mesh("cpu", (world,)), param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    model.tie_weights()
    torch.manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            getattr(p, "_local_tensor", p).normal_(0, 0.02)
        cos, sin = model_rope_tables(cfg, "cpu")
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False, foreach=False)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1))
    step_s = []
    for _ in range(2):  # the first step allocates AdamW's moments; the second is the step time
        start = time.perf_counter()
        loss, _ = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    del loss
    root = Path(args.dir)
    io = DCPCheckpointIO()
    state = _checkpoint(model, optimizer, 2)
    shard_bytes = sum(t.nbytes for t in _tensors({"s": state["state_dict"], "o": state["optimizer_states"]}))
    rec: dict = {"params": n_params, "shard_bytes": shard_bytes, "step_s": step_s[-1]}
    before = _fingerprint(model, optimizer)
    rounds = []
    for r in range(args.rounds):
        rounds.append(_round(model, optimizer, io, root / f"round{r}", shard_bytes, before))
    rec["rounds"] = rounds
    rec["restored_equal"] = all(x["restore_equal"] and x["restore_plain_equal"] for x in rounds)
    async_io = DCPCheckpointIO(async_save=True)
    # What the strategy does after the first optimizer step: the staging buffers are allocated in the background
    # (timed here, waited for), so the saves below stall for the copy alone.
    state = _checkpoint(model, optimizer, 3)
    start = time.perf_counter()
    async_io.prestage({"state_dict": state["state_dict"], "optimizer_0": state["optimizer_states"][0]})
    async_io.wait()
    rec["prestage_s"] = time.perf_counter() - start
    stalls, totals = [], []
    for i in (3, 4, 5):
        state = _checkpoint(model, optimizer, i)
        dist.barrier()
        start = time.perf_counter()
        async_io.save_checkpoint(state, root / "async" / f"step={i}.ckpt")
        stalls.append(time.perf_counter() - start)
        async_io.wait()
        totals.append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / "async" / f"step={i}.ckpt")
    async_io.teardown()
    rec["async_stall_s"], rec["async_total_s"] = stalls, totals
    rec["copy_floor_s"] = _copy_floor(_checkpoint(model, optimizer, 5))
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def _summary(world: int, ranks: list[dict]) -> dict:
    """Per figure, the best round of the slowest rank (the disk: the best round of the slowest rank too), GB/s
    from this rank's shard bytes and seconds."""
    r0 = ranks[0]
    gb = r0["shard_bytes"] / 1e9

    def seconds(key: str) -> float:  # best round, slowest rank
        return min(max(r["rounds"][i][key] for r in ranks) for i in range(len(r0["rounds"])))

    def disk(key: str) -> float:  # best round, slowest rank; writes: the mean of before and after the saves
        def one(x: dict) -> float:
            return (x["disk"][key] + x["disk_after"][key]) / 2 if key == "write_gb_s" else x["disk"][key]

        return max(min(one(r["rounds"][i]) for r in ranks) for i in range(len(r0["rounds"])))

    def worst(key: str, index: int) -> float:
        return max(r[key][index] for r in ranks)

    step = max(r["step_s"] for r in ranks)
    stalls = [round(worst("async_stall_s", i), 4) for i in range(len(r0["async_stall_s"]))]  # slowest rank's
    return {
        "nproc": world,
        "params": r0["params"],
        "shard_gb_per_rank": round(gb, 3),
        "rounds": len(r0["rounds"]),
        "step_s": round(step, 3),
        "disk_write_gb_s": round(disk("write_gb_s"), 3),
        "disk_read_gb_s": round(disk("read_gb_s"), 3),
        "save_gb_s": round(gb / seconds("save_s"), 3),
        "save_plain_gb_s": round(gb / seconds("save_plain_s"), 3),
        "restore_gb_s": round(gb / seconds("restore_s"), 3),
        "restore_plain_gb_s": round(gb / seconds("restore_plain_s"), 3),
        "save_of_disk": round(gb / seconds("save_s") / disk("write_gb_s"), 3),
        "restore_of_disk": round(gb / seconds("restore_s") / disk("read_gb_s"), 3),
        "restored_equal": all(r["restored_equal"] for r in ranks),
        "async_stall_s": stalls,
        "async_stall_median_s": round(statistics.median(stalls), 4),
        "async_total_s": [round(worst("async_total_s", i), 3) for i in range(len(stalls))],
        "async_stall_of_step": round(statistics.median(stalls) / step, 4),
        "copy_floor_s": round(max(r["copy_floor_s"] for r in ranks), 4),
        "prestage_s": round(max(r["prestage_s"] for r in ranks), 3),
        "ranks": ranks,
    }


def _machine() -> str:
    """CPU model, cores and memory of this host (Linux ``/proc``; the architecture elsewhere)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    mem = Path("/proc/meminfo").read_text().split()[1] if Path("/proc/meminfo").is_file() else "0"
    return f"{cpu or platform.machine()}, {os.cpu_count()} cores, {int(mem) / 2**20:.0f} GiB"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(params: float, nprocs: list[int], seq: int, workdir: Path, rounds: int = 2) -> dict:
    """Every process count in turn (a fresh folder each); the summaries and the machine."""
    import torch.multiprocessing as mp

    results = []
    for world in nprocs:
        folder = Path(tempfile.mkdtemp(prefix=f"ckpt_io_{world}_", dir=workdir))
        out = folder / "ranks.json"
        args = argparse.Namespace(params=params, seq=seq, dir=str(folder), rounds=rounds)
        mp.spawn(rank_main, args=(world, args, _free_port(), str(out)), nprocs=world, join=True)
        results.append(_summary(world, json.loads(out.read_text())))
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "machine": _machine(),
        "date": datetime.date.today().isoformat(),
        "folder": str(workdir),
        "torch": torch.__version__,
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict:
    """Command line: print the figures (and write them to ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=500e6, help="model parameters (default 500e6)")
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="process counts (default 1 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per rank in the timed step (default 128)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of disk / save / restore, best kept (default 2)")
    p.add_argument("--dir", type=Path, default=None, help="where files go (default: the system's temp folder)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    workdir = Path(args.dir or tempfile.gettempdir())
    result = run(args.params, args.nproc, args.seq, workdir, args.rounds)
    for r in result["results"]:
        print(
            f"{r['nproc']} proc, {r['params'] / 1e6:.0f}M params, {r['shard_gb_per_rank']:.2f} GB per rank: "
            f"disk write {r['disk_write_gb_s']:.2f} / read {r['disk_read_gb_s']:.2f} GB/s; "
            f"save {r['save_gb_s']:.2f} GB/s ({r['save_of_disk']:.0%} of the disk; without checksums "
            f"{r['save_plain_gb_s']:.2f}), restore {r['restore_gb_s']:.2f} GB/s ({r['restore_of_disk']:.0%}; unverified "
            f"{r['restore_plain_gb_s']:.2f}); async stall {r['async_stall_median_s'] * 1e3:.0f} ms "
            f"(median of {len(r['async_stall_s'])}, the first {r['async_stall_s'][0] * 1e3:.0f} ms) = "
            f"{r['async_stall_of_step']:.1%} of a "
            f"{r['step_s']:.2f} s step, host copy {r['copy_floor_s'] * 1e3:.0f} ms (buffers allocated in the background "
            f"in {r['prestage_s']:.2f} s)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
