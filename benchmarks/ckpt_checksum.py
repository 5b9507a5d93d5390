"""What checkpoint checksums cost: save and load time of one process's checkpoint with and without them.

The same state (``--mib`` MiB of fp32 tensors in ``--tensors`` pieces, about what one rank of a sharded run holds)
is saved and loaded by the same code, alternating the two variants ``--repeats`` times:

- ``plain``: DCP's ``FileSystemWriter``, and :class:`~kempnerforge.checkpoint.verify.NamingFileSystemReader` with
  ``verify=False`` (what kempnerforge did before checksums);
- ``checksums``: :class:`~kempnerforge.checkpoint.checksum.ChecksumFileSystemWriter` (every byte hashed on its way
  to the file) plus the record, and :class:`~kempnerforge.checkpoint.verify.NamingFileSystemReader` (every file of
  the read plan checked before it is read).

Reported: the best wall seconds of each, the ratio, and the hash rate of ``xxh3_64`` alone on this machine. The page
cache makes the second read of a file cheaper than a cold one from a parallel filesystem; both variants see the
same cache, and the check reads each file once more, so the load ratio is the cost on warm files.

    python benchmarks/ckpt_checksum.py                       # 512 MiB, 3 repeats
    python benchmarks/ckpt_checksum.py --mib 8 --repeats 1 --json /tmp/ck.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from kempnerforge.checkpoint.checksum import ALGORITHM, ChecksumFileSystemWriter, Record, new_hasher, write_manifest
from kempnerforge.checkpoint.verify import NamingFileSystemReader


def _state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    numel = (mib << 20) // 4 // tensors
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(tensors)}


def _save(state: dict[str, torch.Tensor], path: Path, checksums: bool) -> float:
    start = time.perf_counter()
    if checksums:
        record = Record()
        dcp.save(state, storage_writer=ChecksumFileSystemWriter(path, record), no_dist=True)
        write_manifest(path, 0, record)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return time.perf_counter() - start


def _load(state: dict[str, torch.Tensor], path: Path, checksums: bool) -> float:
    target = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    reader = NamingFileSystemReader(path, verify=checksums)  # the same reader, with and without the checks
    dcp.load(target, storage_reader=reader, no_dist=True)
    seconds = time.perf_counter() - start
    assert all(torch.equal(target[k], state[k]) for k in state), "loaded tensors differ from the saved ones"
    return seconds


def _hash_rate(mib: int) -> float:
    """GB/s of the checksum algorithm alone over ``mib`` MiB in memory."""
    data = memoryview(bytearray(mib << 20))
    hasher = new_hasher()
    start = time.perf_counter()
    hasher.update(data)
    return (mib << 20) / (time.perf_counter() - start) / 1e9


def run(mib: int, tensors: int, repeats: int, workdir: Path) -> dict:
    """Best-of-``repeats`` save / load seconds of both variants; the ratios checksums / plain."""
    state = _state(mib, tensors)
    best = {f"{op}_{kind}": float("inf") for op in ("save", "load") for kind in ("plain", "checksums")}
    for i in range(repeats):
        for kind in ("plain", "checksums"):
            path = workdir / f"{kind}-{i}"
            best[f"save_{kind}"] = min(best[f"save_{kind}"], _save(state, path, kind == "checksums"))
            best[f"load_{kind}"] = min(best[f"load_{kind}"], _load(state, path, kind == "checksums"))
            shutil.rmtree(path)
    return {
        "mib": mib,
        "tensors": tensors,
        "repeats": repeats,
        "algorithm": ALGORITHM,
        "hash_gb_per_s": round(_hash_rate(min(mib, 256)), 2),
        **{k: round(v, 4) for k, v in best.items()},
        "save_ratio": round(best["save_checksums"] / best["save_plain"], 3),
        "load_ratio": round(best["load_checksums"] / best["load_plain"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    """Command line: print the figures (and write them to ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="MiB of fp32 state saved (default 512)")
    p.add_argument("--tensors", type=int, default=64, help="how many tensors hold it (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="alternating save/load rounds, best kept (default 3)")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run(args.mib, args.tensors, args.repeats, Path(tmp))
    print(
        f"{result['mib']} MiB in {result['tensors']} tensors, best of {result['repeats']}, {result['algorithm']} "
        f"at {result['hash_gb_per_s']} GB/s:\n"
        f"  save: plain {result['save_plain']:.3f} s, with checksums {result['save_checksums']:.3f} s "
        f"({result['save_ratio']:.3f}x)\n"
        f"  load: plain {result['load_plain']:.3f} s, with checksums {result['load_checksums']:.3f} s "
        f"({result['load_ratio']:.3f}x)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
