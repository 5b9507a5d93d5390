"""Model-level tensor-parallel check, launched under ``torchrun`` (2 gloo ranks, tp=2).

For each variant (sequence parallel, loss parallel, tied embeddings, QK-norm, GQA, uneven vocab)
one forward + backward of the TP model is compared with the same model unsharded in the same
process: the loss and every parameter's full gradient; then the same for the cross-entropy plus the z-loss
(PaLM's ``logsumexp^2``, vocab-parallel on sharded logits). Writes a JSON report (rank 0) to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.parallel.tensor_parallel import apply_tp
from kempnerforge.training.loss import IGNORE_INDEX, cross_entropy_sum, loss_parallel_context, z_loss_sum


def _compare(ref, tp_model, tokens, labels, loss_fn) -> tuple[float, float, bool]:
    """One forward + backward of ``loss_fn(logits, labels)`` on both models (gradients zeroed first): the relative
    difference of the loss, the largest relative difference of a parameter's full gradient, and whether the TP
    logits were vocab-sharded."""
    for model in (ref, tp_model):
        model.zero_grad(set_to_none=True)
    ref_loss = loss_fn(ref(tokens), labels)
    ref_loss.backward()
    logits = tp_model(tokens)
    sharded = isinstance(logits, DTensor)
    loss = loss_fn(logits, labels)
    with loss_parallel_context(sharded):
        loss.backward()
    ref_params = dict(ref.named_parameters())
    grad_rel = 0.0
    for name, p in tp_model.named_parameters():
        g, rg = to_full(p.grad), ref_params[name].grad
        grad_rel = max(grad_rel, float((g - rg).norm() / rg.norm().clamp(min=1e-12)))
    loss_rel = abs(float(loss.detach()) - float(ref_loss.detach())) / abs(float(ref_loss.detach()))
    return loss_rel, grad_rel, sharded


def run_variant(mesh, *, sp: bool, lp: bool, tie: bool, qk_norm: bool) -> dict:
    """Max relative differences of the loss and of the gradients, TP model vs reference."""
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=101,
        max_seq_len=16,
        multiple_of=16,
        rope_theta=10000.0,
        tie_embeddings=tie,
        qk_norm=qk_norm,
    )
    ref = Transformer(cfg)
    ref.init_weights(seed=3)
    with torch.device("meta"):
        tp_model = Transformer(cfg)
    apply_tp(tp_model, mesh, sequence_parallel=sp, loss_parallel=lp)
    tp_model.to_empty(device="cpu")
    tp_model.tie_weights()
    tp_model.init_weights(seed=3)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 8), generator=gen)
    labels[0, :3] = IGNORE_INDEX

    loss_rel, grad_rel, sharded = _compare(ref, tp_model, tokens, labels, cross_entropy_sum)
    # Weight 1: the z-loss (~log(101)^2 per token) outweighs the cross-entropy in the gradient it adds to it.
    z_rel, z_grad_rel, _ = _compare(
        ref, tp_model, tokens, labels, lambda x, y: cross_entropy_sum(x, y) + z_loss_sum(x, y)
    )
    n_dtensor = sum(isinstance(p, DTensor) for p in tp_model.parameters())
    return {
        "sp": sp,
        "lp": lp,
        "tie": tie,
        "qk_norm": qk_norm,
        "logits_sharded": sharded,
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "z_rel": z_rel,
        "z_grad_rel": z_grad_rel,
        "n_params": len(list(ref.parameters())),
        "n_dtensor_params": n_dtensor,
        "tied_after_tp": tp_model.output.weight is tp_model.tok_embeddings.weight,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    # Every option appears on and off; tied + QK-norm ride along with both sequence-parallel settings.
    variants = [
        (False, True, False, False),
        (True, True, True, True),
        (False, False, True, True),
        (True, False, False, False),
    ]
    results = [run_variant(mesh, sp=sp, lp=lp, tie=tie, qk_norm=qk) for sp, lp, tie, qk in variants]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
