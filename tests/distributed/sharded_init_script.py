"""Rank script of the sharded-init check (issue 16 check 3): init a decoder under FSDP2 on this world, measure the
peak host memory of materialize + init, and hash every parameter's full tensor.

Memory: the kernel's RSS high-water mark (``VmHWM``), reset to the current RSS (``/proc/self/clear_refs`` = 5) after
imports and the meta-device build, minus that baseline RSS: the bytes the rank's ``to_empty`` + ``init_weights`` add
at their peak (its parameter storage plus init's working memory). Hashes (BLAKE2b of each ``full_tensor()``, one
parameter at a time, after the measurement) are written by rank 0 with the figures as JSON to ``--out``.

On 2 ranks the script also checks FSDP2 layouts directly: ``Shard(1)`` (``shard_placement_fn``, as for expert
weights when dp_shard x ep > num_experts) and uneven ``Shard(0)``, against the unsharded init.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from kempnerforge.config import ModelConfig
from kempnerforge.model.init import trunc_normal_init_
from kempnerforge.model.transformer import Transformer
from kempnerforge.parallel.fsdp import apply_fsdp


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _fsdp_layouts(mesh) -> None:
    """FSDP2 Shard(1) and uneven Shard(0) parameters equal the unsharded init (full_tensor)."""
    shapes = {"experts_w1": ((3, 8, 6), Shard(1)), "uneven": ((5, 4), Shard(0)), "wide": ((2, 10), Shard(1))}
    module = nn.Module()
    for name, (shape, _) in shapes.items():
        module.register_parameter(name, nn.Parameter(torch.empty(shape, device="meta")))
    fully_shard(
        module,
        mesh=mesh,
        shard_placement_fn=lambda p: next(s for n, (_, s) in shapes.items() if p is getattr(module, n)),
    )
    module.to_empty(device="cpu")
    for name, param in module.named_parameters():
        trunc_normal_init_(param, name, 5, 0.02)
        want = torch.empty(param.shape)
        trunc_normal_init_(want, name, 5, 0.02)
        assert tuple(param.placements) == (shapes[name][1],), (name, param.placements)
        assert torch.equal(param.full_tensor(), want), name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--n_layers", type=int, default=36)
    parser.add_argument("--vocab_size", type=int, default=32000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=16, n_kv_heads=8, vocab_size=args.vocab_size,
                      max_seq_len=256, multiple_of=256)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_fsdp(model, mesh)  # world 1: plain parameters (FSDP2 skipped), the unsharded oracle
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base_kb = _status_kb("VmRSS")
    start = time.perf_counter()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    init_s = time.perf_counter() - start
    peak_bytes = (_status_kb("VmHWM") - base_kb) * 1024
    local_bytes = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    figures = torch.tensor([peak_bytes, init_s * 1e6, local_bytes], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    hashes = {}
    for name, param in model.named_parameters():
        full = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()
        if rank == 0:
            hashes[name] = hashlib.blake2b(full.numpy().data, digest_size=16).hexdigest()
        del full
    if world > 1:
        _fsdp_layouts(mesh)
    if rank == 0:
        record = {
            "world": world,
            "n_params": sum(p.numel() for p in model.parameters()),
            "peak_bytes": [int(g[0]) for g in gathered],
            "init_s": [float(g[1]) / 1e6 for g in gathered],
            "local_param_bytes": [int(g[2]) for g in gathered],
            "hashes": hashes,
        }
        with open(args.out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
