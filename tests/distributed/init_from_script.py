"""Rank script of the ``model.init_from`` checks (issue 20, check 3), one launch on 2 gloo ranks.

- ``memory``: a ~300M-parameter Llama folder (fp32) loaded into a dp_shard=2 FSDP2 model. Memory is the kernel's RSS
  high-water mark (``VmHWM``), reset (``/proc/self/clear_refs`` = 5) after the meta build and FSDP2: ``materialize``
  is ``to_empty`` (this rank's parameter shards) and ``load`` the bytes ``init_weights`` adds at its peak while it
  reads the folder (file pages it maps, slice buffers), each against the RSS just before it.
- ``loss``: ``Trainer.fit`` for one step with ``KempnerStrategy(dp_shard=2)`` and ``CausalLM(init_from=small)`` on a
  fixed global batch of 4 sequences; rank 0 records the logged first-step ``train/loss`` and the global batch.
- ``layouts``: the small Llama under tp=2 (GQA, untied), the Mixtral folder under ep=2 and the Qwen2-MoE folder under
  FSDP2 dp_shard=2 (experts ``Shard(0)``), the tiny DeepSeek-V3 under each of the three (MLA heads split, experts
  split, FSDP2 rows cut inside ``wkv_a``'s RoPE rows): every parameter's full tensor and every router correction bias
  against the unsharded load of the same folder.

- ``opens`` (issue 30, check 4): every load above counts the opens of ``.safetensors`` files on each rank
  (``os.open`` and ``safetensors.safe_open``, patched around ``init_weights``), against the folder's file count; the
  layouts include a 2,001-tensor Llama folder in 15 files (``--many``) under FSDP2.

- ``vlm_memory`` / ``vlm_layouts`` (issue 32, check 2): the same big folder loaded as the text model of a MoT VLM
  (every text tensor read into both modality towers) under FSDP2, measured as ``memory``; the small Llama as the text
  model of each VLM arch under FSDP2 and of joint_decoder and MoT under tp=2, every parameter against the unsharded
  load.

Rank 0 writes the records as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from kempnerforge.checkpoint.init_from import model_config_from_folder
from kempnerforge.config.vision import ConnectorConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.model.fused import join_state_dict
from kempnerforge.model.transformer import Transformer
from kempnerforge.model.vlm.model import VisionLanguageModel
from kempnerforge.module import CausalLM
from kempnerforge.parallel.expert_parallel import apply_ep
from kempnerforge.parallel.fsdp import apply_fsdp
from kempnerforge.parallel.tensor_parallel import apply_tp
from kempnerforge.strategies import KempnerStrategy
from kempnerforge.training.optimizers import OptimizerConfig
from tests.vlm_tiny import tiny_encoder


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS") * 1024


@contextlib.contextmanager
def _counting_opens(counts: dict[str, int]):
    """Count the opens of ``.safetensors`` files (by ``os.open`` or ``safetensors.safe_open``) into ``counts``."""
    import safetensors

    real_open, real_safe_open = os.open, safetensors.safe_open

    def counted(path, *args, **kwargs):
        if str(path).endswith(".safetensors"):
            counts[str(path)] = counts.get(str(path), 0) + 1
        return real_open(path, *args, **kwargs)

    def safe_counted(path, *args, **kwargs):
        counts[str(path)] = counts.get(str(path), 0) + 1
        return real_safe_open(path, *args, **kwargs)

    os.open, safetensors.safe_open = counted, safe_counted
    try:
        yield counts
    finally:
        os.open, safetensors.safe_open = real_open, real_safe_open


def _opens_record(counts: dict[str, int], folder: str) -> dict:
    """Opens per rank against the folder's number of safetensors files."""
    return {"opens": _gather(sum(counts.values())), "files": len(list(Path(folder).glob("*.safetensors")))}


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _vlm(folder: str, arch: str) -> VisionLanguageModel:
    """A VLM of ``arch`` whose text model is the folder's (a tiny random SigLIP tower, mlp2 connector)."""
    text = model_config_from_folder(folder)
    vlm = VLMConfig(arch=arch, cross_attn_every=1, moma_experts_per_modality=2)
    return VisionLanguageModel(text, vlm, tiny_encoder(), ConnectorConfig(), init_from=folder)


def memory(folder: str, mesh, arch: str | None = None) -> dict:
    """Host memory of loading ``folder`` under FSDP2: into a text model, or with ``arch`` into a VLM's backbone.
    What an earlier call freed is handed back to the kernel first (``malloc_trim``): pages glibc kept resident would
    be reused by ``to_empty`` and hide the load's own pages."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    cfg = model_config_from_folder(folder)
    with torch.device("meta"):
        model = Transformer(cfg, init_from=folder) if arch is None else _vlm(folder, arch)
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    dist.barrier()
    base = _reset_peak()
    model.to_empty(device="cpu")
    model.tie_weights()
    materialize = _status_kb("VmHWM") * 1024 - base
    dist.barrier()
    base = _reset_peak()
    start = time.perf_counter()
    with _counting_opens({}) as counts:
        model.init_weights(seed=0)
    load_s = time.perf_counter() - start
    load = _status_kb("VmHWM") * 1024 - base
    local = sum(p.to_local().numel() for p in model.parameters()) * 4
    return {"n_params": n_params, "model_bytes": n_params * 4, "materialize_bytes": _gather(materialize),
            "load_bytes": _gather(load), "shard_bytes": _gather(local), "load_s": _gather(load_s)} | _opens_record(
        counts, folder)  # fmt: skip


class _FirstLoss(Callback):
    def __init__(self) -> None:
        self.loss: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loss = float(trainer.callback_metrics["train/loss"])


def first_step_loss(folder: str, seq: torch.Tensor) -> float:
    seed_everything(0)
    module = CausalLM(init_from=folder, optimizer=OptimizerConfig(lr=1e-3), grad_clip=1.0)
    samples = [{"input_ids": s[:-1], "labels": s[1:]} for s in seq]
    recorder = _FirstLoss()
    trainer = Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=KempnerStrategy(dp_shard=2),
                      max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(samples, batch_size=2, shuffle=False))
    return recorder.loss


def _tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and router correction biases by canonical name (wrappers stripped)."""
    named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))]
    clean = {"_fsdp_wrapped_module.": "", "_checkpoint_wrapped_module.": ""}
    out = {}
    for name, t in named:
        for a, b in clean.items():
            name = name.replace(a, b)
        out[name] = t
    return out


def _plain(folder: str, arch: str | None = None) -> dict[str, torch.Tensor]:
    model = Transformer(model_config_from_folder(folder), init_from=folder) if arch is None else _vlm(folder, arch)
    model.init_weights(seed=0)
    return {n: p.detach() for n, p in _tensors(model).items()}


def _max_diff(model, want: dict[str, torch.Tensor], layout: str) -> dict:
    """Max |full tensor - ``want``| over the sharded ``model``'s parameters (0.0: bitwise equal)."""
    diff, sharded = 0.0, 0
    got = _tensors(model)
    assert got.keys() == want.keys(), (layout, sorted(got.keys() ^ want.keys()))
    for key, param in got.items():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        sharded += int(hasattr(param, "full_tensor"))
        diff = max(diff, (full.detach() - want[key]).abs().max().item())
    return {"max_abs_diff": diff, "params": len(want), "sharded_params": sharded}


def vlm_layouts(folder: str, mesh) -> dict:
    """Each VLM arch from the text folder under FSDP2, joint_decoder and MoT under tp=2, against the unsharded load."""
    out = {}
    for arch, how in [(a, "fsdp2") for a in ("joint_decoder", "cross_attention", "mot", "moma")] + [
        ("joint_decoder", "tp2"),
        ("mot", "tp2"),
    ]:
        with torch.device("meta"):
            model = _vlm(folder, arch)
        if how == "tp2":
            apply_tp(model, mesh, sequence_parallel=False, loss_parallel=True)
        else:
            apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.to_empty(device="cpu")
        model.tie_weights()
        with _counting_opens({}) as counts:
            model.init_weights(seed=0)
        out[f"vlm_{arch}_{how}"] = _max_diff(model, _plain(folder, arch), arch) | _opens_record(counts, folder)
    return out


def layouts(folders: dict[str, str], mesh) -> dict:
    """Max |sharded full tensor - unsharded load| per layout (0.0 when bitwise equal), and the params compared."""
    out = {}
    for layout, folder in folders.items():
        cfg = model_config_from_folder(folder)
        if layout.startswith("fused"):  # wqkv / w13 rows read from HF's separate q/k/v, gate/up tensors per rank
            cfg = dataclasses.replace(cfg, fuse_qkv=True, fuse_w13=True)
        with torch.device("meta"):
            model = Transformer(cfg, init_from=folder)
        if layout.endswith("tp2"):
            apply_tp(model, mesh, sequence_parallel=False, loss_parallel=True)
        elif layout.endswith("ep2"):
            apply_ep(model, mesh)
        else:
            apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        model.to_empty(device="cpu")
        model.tie_weights()
        with _counting_opens({}) as counts:
            model.init_weights(seed=0)
        want = _plain(folder)
        want = join_state_dict(want, cfg) if layout.startswith("fused") else want
        out[layout] = _max_diff(model, want, layout) | _opens_record(counts, folder)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--big", required=True)
    p.add_argument("--small", required=True)
    p.add_argument("--mixtral", required=True)
    p.add_argument("--qwen2-moe", required=True)
    p.add_argument("--deepseek-v3", required=True)
    p.add_argument("--many", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    record = {"memory": memory(args.big, mesh), "vlm_memory": memory(args.big, mesh, arch="mot")}
    ds = args.deepseek_v3
    record["layouts"] = layouts(
        {"tp2": args.small, "ep2": args.mixtral, "fsdp2": args.qwen2_moe, "ds_tp2": ds, "ds_ep2": ds, "ds_fsdp2": ds}
        | {"fused_tp2": args.small, "fused_fsdp2": args.small, "many_fsdp2": args.many},
        mesh,
    ) | vlm_layouts(args.small, mesh)
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, model_config_from_folder(args.small).vocab_size, (4, 17), generator=gen)
    record["loss"] = {"kforge": first_step_loss(args.small, seq), "tokens": seq.tolist()}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
