"""One MoE layer with experts split over 2 gloo ranks vs the same layer on one process (run by
test_expert_parallel_parity.py under torchrun). Writes ``{"ok": true, ...}`` from rank 0 to ``--out``.

``--skew`` routes every token of every rank to rank 0's experts, so rank 1's experts get no tokens:
both all-to-alls must still complete (no deadlock) and rank 1's expert gradients must be zero. The
forward and backward of the EP layer make exactly one host synchronization (the split sizes).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kempnerforge.config import ModelConfig
from kempnerforge.model.moe import MoE
from kempnerforge.parallel.expert_parallel import apply_ep
from tests.host_syncs import HostSyncCounter


def _capacity_errors(ref, ep_moe, xs, rank: int, world: int, e_local: int) -> dict[str, float]:
    """capacity_factor=1: each rank drops its own overflow (capacity counts its own tokens), so the
    oracle is the single-process layer run on each rank's tokens, gradients summed over ranks. Dropped
    rows stay on their rank (only the kept ones are sent); with --skew half the assignments drop. Gradient
    errors are relative to the largest entry (the oracle sums the ranks' backward passes in another order)."""
    for m in (ref, ep_moe):
        m.config = dataclasses.replace(m.config, capacity_factor=1.0)
        m.zero_grad()
    out = ep_moe(xs[rank])
    out.square().sum().backward()
    for r in range(world):
        expected = ref(xs[r])
        expected.square().sum().backward()
        if r == rank:
            errors = {"cap_out": (out - expected).abs().max().item(), "cap_dropped": float(ref.stats.dropped)}
    for name in ("w1", "w2", "w3"):
        got = getattr(ep_moe.experts, name).grad.to_local() * world
        want = getattr(ref.experts, name).grad[rank * e_local : (rank + 1) * e_local]
        errors[f"cap_{name}"] = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()  # relative
    router_grad = ep_moe.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    want = ref.router.gate.weight.grad
    errors["cap_router"] = ((router_grad - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
    return errors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skew", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=16, ffn_hidden_dim=8,
                      num_experts=4, top_k=2, n_shared_experts=1, router="sigmoid")  # fmt: skip
    torch.manual_seed(0)
    ref = MoE(cfg)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.normal_(0, 0.3)
        if args.skew:  # experts 2, 3 (rank 1's) never chosen
            ref.router.expert_bias.copy_(torch.tensor([0.0, 0.0, -10.0, -10.0]))
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ep_moe = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_ep(ep_moe, mesh)
    assert ep_moe.experts.w1.to_local().shape[0] == cfg.num_experts // world
    counter = HostSyncCounter()
    counter.active = True
    with counter:  # forward and backward of one EP layer: the split sizes, read once (README "Performance")
        out = ep_moe(xs[rank])
        out.square().sum().backward()
    syncs = [(e.op, e.where.split(":")[0]) for e in counter.events]
    expected = ref(torch.cat(xs))
    expected.square().sum().backward()
    errors = {"out": (out - expected[2 * rank : 2 * rank + 2]).abs().max().item()}
    e_local = cfg.num_experts // world
    for name in ("w1", "w2", "w3"):
        # ScaleGrad divides expert grads by ep (FSDP2 then averages over dp_shard / ep replicas).
        got = getattr(ep_moe.experts, name).grad.to_local() * world
        want = getattr(ref.experts, name).grad[rank * e_local : (rank + 1) * e_local]
        errors[name] = (got - want).abs().max().item()
        if args.skew and rank == 1:
            errors[f"{name}_idle"] = got.abs().max().item()
    router_grad = ep_moe.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    errors["router"] = (router_grad - ref.router.gate.weight.grad).abs().max().item()
    errors.update(_capacity_errors(ref, ep_moe, xs, rank, world, e_local))
    gathered = [None] * world
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"errors": gathered, "skew": args.skew, "syncs": syncs}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
