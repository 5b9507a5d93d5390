"""MoT and MoMa backbones on 2 gloo ranks vs one process (run by test_vlm_backbones.py under torchrun).

For each arch:

- FSDP2 (dp_shard=2, every block checkpointed, built on meta, materialized and initialized per FQN as
  the strategy does): a few AdamW steps on one random padded batch, each rank holding half of it; the
  global losses, every step's gradients and the final parameters are compared with the same model
  trained on the whole batch in this process (built eagerly, no AC, no FSDP). A DCP checkpoint of the
  sharded model and optimizer after step 2, loaded into a fresh sharded model, gives steps 3-4 again.
- TP=2 (the arch's ``tp_plan``): logits and gradients of one forward/backward on the whole batch vs
  the unsharded model; also MoMa with multi-head latent attention (``moma_mla``).

Rank 0 writes ``{arch: {"fsdp_losses": [...], "single_losses": [...], "fsdp_grad_errs": [...], "fsdp_param_err": ...,
"resumed_losses": [...],
"tp_logits_err": ..., "tp_grad_err": ...}}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.init import canonical_fqn
from kempnerforge.model.vlm import build_backbone
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.parallel.fsdp import apply_fsdp
from kempnerforge.parallel.tensor_parallel import apply_tp

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32, ffn_hidden_dim=48,
                  qk_norm=True, rope_theta=10000.0)  # fmt: skip
#: MoMa's shared attention as multi-head latent attention (DeepSeek-V3's, with a query latent; issue 32 item 2).
MLA_CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, ffn_hidden_dim=48,
                      rope_theta=10000.0, attention="mla", kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip
BATCH, N_VIS, N_TEXT, STEPS, RESUME_AFTER = 4, 6, 10, 4, 2


def global_batch():
    """The same global batch on every rank and step (the loss must fall): ids, visual, text_mask,
    visual_mask (sample i > 0 padded)."""
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, N_TEXT), generator=gen)
    visual = torch.randn(BATCH, N_VIS, CFG.dim, generator=gen)
    text_mask = torch.ones(BATCH, N_TEXT, dtype=torch.bool)
    visual_mask = torch.ones(BATCH, N_VIS, dtype=torch.bool)
    for i in range(1, BATCH):
        text_mask[i, N_TEXT - i :] = False
        visual_mask[i, N_VIS - 2 * (i % 2) :] = False
    return ids, visual, text_mask, visual_mask


def loss_sum(model, ids, visual, text_mask, visual_mask) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over real text targets (nats) and their count."""
    logits = model(ids, visual, text_mask, visual_mask)[:, :-1]
    target_ok = text_mask[:, 1:] & text_mask[:, :-1]
    labels = ids[:, 1:].masked_fill(~target_ok, -100)
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), labels.reshape(-1), reduction="sum"), int(
        target_ok.sum()
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_sharded(vlm: VLMConfig, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """As the strategy does: meta build, AC, FSDP2 per block, materialize, per-FQN init; plus AdamW."""
    with torch.device("meta"):
        model = build_backbone(CFG, vlm)
    apply_ac(model, "full")
    apply_fsdp(model, mesh)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed=4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def fsdp_step(model, opt, batch, rank: int, world: int) -> float:
    """One optimizer step on this rank's half of ``batch``; returns the global mean loss."""
    per_rank = BATCH // world
    count = int((batch[2][:, 1:] & batch[2][:, :-1]).sum())  # real targets of the global batch
    local, _ = loss_sum(model, *(t[rank * per_rank : (rank + 1) * per_rank] for t in batch))
    # FSDP2 averages gradients over ranks: scale so the average is the global-mean gradient.
    (local * world / count).backward()
    reported = local.detach().clone()
    dist.all_reduce(reported)
    return reported.item() / count


def check_fsdp(vlm: VLMConfig, rank: int, world: int, ckpt_dir: str) -> dict:
    single = build_backbone(CFG, vlm)
    single.init_weights(seed=4)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    sharded, opt = build_sharded(vlm, mesh)
    single_losses, fsdp_losses, grad_errs = [], [], []
    ref = {canonical_fqn(n): p for n, p in single.named_parameters()}
    batch = global_batch()
    for step in range(1, STEPS + 1):
        total, count = loss_sum(single, *batch)
        (total / count).backward()
        single_losses.append(total.item() / count)
        fsdp_losses.append(fsdp_step(sharded, opt, batch, rank, world))
        grad_errs.append(max_err(sharded, ref, grad=True))
        for o in (single_opt, opt):
            o.step()
            o.zero_grad()
        if step == RESUME_AFTER:  # DCP checkpoint of the sharded model and optimizer
            dcp.save(dict(zip(("model", "optim"), get_state_dict(sharded, opt), strict=True)), checkpoint_id=ckpt_dir)
    # Resume: a fresh sharded model and optimizer load the checkpoint and run the remaining steps.
    resumed, resumed_opt = build_sharded(vlm, mesh)
    state = dict(zip(("model", "optim"), get_state_dict(resumed, resumed_opt), strict=True))
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = []
    for _ in range(RESUME_AFTER, STEPS):
        resumed_losses.append(fsdp_step(resumed, resumed_opt, batch, rank, world))
        resumed_opt.step()
        resumed_opt.zero_grad()
    return {"single_losses": single_losses, "fsdp_losses": fsdp_losses, "fsdp_grad_errs": grad_errs,
            "fsdp_param_err": max_err(sharded, ref, grad=False), "resumed_losses": resumed_losses}  # fmt: skip


def max_err(sharded, ref: dict, grad: bool) -> float:
    """Largest |sharded - reference| over every parameter (or its gradient), sharded ones gathered."""
    errs = []
    for n, p in sharded.named_parameters():
        a, b = (p.grad, ref[canonical_fqn(n)].grad) if grad else (p.detach(), ref[canonical_fqn(n)].detach())
        errs.append((full(a) - b).abs().max().item())
    return max(errs)


def check_tp(vlm: VLMConfig, world: int, cfg: ModelConfig = CFG) -> dict:
    ref = build_backbone(cfg, vlm)
    ref.init_weights(seed=9)
    tp = copy.deepcopy(ref)
    apply_tp(
        tp, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), sequence_parallel=False, loss_parallel=False
    )
    batch = global_batch()
    out = {}
    logits = []
    for model in (ref, tp):
        total, count = loss_sum(model, *batch)
        (total / count).backward()
        with torch.no_grad():
            logits.append(model(*batch))
    out["tp_logits_err"] = (logits[1] - logits[0])[batch[2]].abs().max().item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out["tp_grad_err"] = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in tp.named_parameters())
    out["tp_sharded"] = sum(isinstance(p, DTensor) for p in tp.parameters())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-dir", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {}
    for vlm in (VLMConfig(arch="mot"), VLMConfig(arch="moma", moma_experts_per_modality=2)):
        record[vlm.arch] = {**check_fsdp(vlm, rank, world, f"{args.ckpt_dir}/{vlm.arch}"), **check_tp(vlm, world)}
    record["moma_mla"] = check_tp(VLMConfig(arch="moma", moma_experts_per_modality=2), world, MLA_CFG)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
