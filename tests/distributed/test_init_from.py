"""Issue 20, check 3: ``--model.init_from`` on 2 gloo ranks, one launch (``init_from_script.py``).

- A ~350M-parameter fp32 Llama folder (1.3 GiB, 7 safetensors files) loaded under FSDP2 dp_shard=2: each rank's peak
  host memory from ``to_empty`` through the load (RSS high-water mark) is its shard plus under 10% of the model, below
  0.6 x the full model's size (each rank reads only the rows it keeps).
- The first-step ``train/loss`` of ``Trainer.fit`` with ``KempnerStrategy(dp_shard=2)`` and ``CausalLM(init_from=...)``
  equals ``transformers``' loss of ``from_pretrained`` on the same global batch (1e-5).
- tp=2 (Llama), ep=2 (Mixtral, per-expert keys) and FSDP2 (Qwen2-MoE, shared experts as row blocks) loads equal the
  unsharded load bitwise; so do tp=2, ep=2 and FSDP2 loads of a tiny DeepSeek-V3 (interleaved RoPE rows permuted
  per rank, ``kv_lora_rank=4`` so FSDP2 cuts ``wkv_a`` inside its RoPE rows; fused shared expert; correction bias),
  and tp=2 / FSDP2 loads of the Llama folder into fused ``wqkv`` / ``w13`` (issue 21) equal the joined unsharded load.
- Issue 30, check 4: every load opens each safetensors file once per rank (counted), the big folder's 7 and a
  2,001-tensor folder's 15 under FSDP2 (which also equals the unsharded load); the big folder's peak stays below
  0.6 x the model, and is now its shard plus under 5% of the model (one 16 MiB piece of file pages at a time).
- Issue 32, check 2: the big folder as the text model of a MoT VLM (every block tensor read into both modality towers: the
  decoder is 1.8 x the folder) under FSDP2: the load's peak per rank below 0.6 x that decoder's size; each of the
  four VLM archs from the small folder under FSDP2, and joint_decoder / MoT under tp=2, equal the unsharded load.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.deepseek_tiny import save_tiny_deepseek_v3
from tests.distributed.launch import HERE, launch
from tests.hf_folders import save_random, write_random_llama

pytestmark = pytest.mark.distributed

SCRIPT = HERE / "init_from_script.py"


def _folders(tmp_path) -> dict:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    small = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    big = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
    many = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=222,
                       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    return {
        "n_params": write_random_llama(big, tmp_path / "big"),
        "big": tmp_path / "big",
        "small": save_random(LlamaForCausalLM, LlamaConfig(**small, tie_word_embeddings=False), tmp_path / "small"),
        "mixtral": save_random(
            MixtralForCausalLM, MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2), tmp_path / "mixtral"
        ),
        "qwen2_moe": save_random(
            Qwen2MoeForCausalLM,
            Qwen2MoeConfig(
                **small,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                qkv_bias=False,
                mlp_only_layers=[],
            ),  # fmt: skip
            tmp_path / "qwen2_moe",
        ),
        "deepseek_v3": save_tiny_deepseek_v3(tmp_path / "deepseek_v3", kv_lora_rank=4),
        # 222 blocks x 9 tensors + embedding, norm and head: 2,001 tensors in 15 files of 16 blocks.
        "many": write_random_llama(many, tmp_path / "many", layers_per_file=16) and tmp_path / "many",
    }


def _hf_loss(folder, tokens: list) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(tokens)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_init_from_on_two_ranks(tmp_path):
    folders = _folders(tmp_path)
    out = tmp_path / "record.json"
    args = ["--big", folders["big"], "--small", folders["small"], "--mixtral", folders["mixtral"]]
    args += ["--qwen2-moe", folders["qwen2_moe"], "--deepseek-v3", folders["deepseek_v3"], "--out", out]
    args += ["--many", folders["many"]]
    launch(2, SCRIPT, list(map(str, args)), timeout=400)
    record = json.loads(out.read_text())

    mem = record["memory"]
    assert mem["n_params"] == folders["n_params"] and 300e6 < mem["n_params"] < 400e6
    for rank in range(2):
        assert mem["shard_bytes"][rank] == pytest.approx(mem["model_bytes"] / 2, rel=0.01)
        # to_empty only reserves the shard; its pages are first written by the load, so the load's peak holds the
        # shard (1/2 of the model) plus what reading adds (one slice buffer, one tensor's file pages). Reading whole
        # tensors, or keeping every mapped page, would be at least one model's size.
        peak = mem["materialize_bytes"][rank] + mem["load_bytes"][rank]
        assert mem["shard_bytes"][rank] <= peak < 0.6 * mem["model_bytes"], (rank, mem)
        # Issue 30: file pages are unmapped after each 16 MiB piece of a slice, so reading adds one piece, not a
        # tensor's pages (the whole embedding: 10% of this model).
        assert peak - mem["shard_bytes"][rank] < 0.05 * mem["model_bytes"], (rank, mem)
    vlm = record["vlm_memory"]
    decoder_bytes = vlm["model_bytes"]  # the MoT backbone (both towers) and the tiny vision tower
    assert decoder_bytes > 1.7 * mem["model_bytes"], (vlm, mem)  # embedding and head are not per modality
    for rank in range(2):
        peak = vlm["materialize_bytes"][rank] + vlm["load_bytes"][rank]
        assert vlm["shard_bytes"][rank] <= peak < 0.6 * decoder_bytes, (rank, vlm)
    # One open per safetensors file per rank, whatever the number of tensors (not one per key or per slice).
    assert mem["files"] == 7 and mem["opens"] == [7, 7], mem
    assert len(json.loads((folders["many"] / "model.safetensors.index.json").read_text())["weight_map"]) == 2001
    for layout, rec in record["layouts"].items():
        assert rec["opens"] == [rec["files"]] * 2, (layout, rec)
    many = record["layouts"]["many_fsdp2"]
    assert many["files"] == 15 and many["params"] > 1300, many  # fused wqkv / w13: 2,001 tensors, 1,335 params
    archs = ("joint_decoder", "cross_attention", "mot", "moma")
    want_layouts = {"ds_tp2", "ds_ep2", "ds_fsdp2", "fused_tp2", "fused_fsdp2", "many_fsdp2"}
    want_layouts |= {f"vlm_{a}_fsdp2" for a in archs} | {"vlm_joint_decoder_tp2", "vlm_mot_tp2"}
    assert want_layouts <= record["layouts"].keys()
    for layout, rec in record["layouts"].items():
        assert rec["max_abs_diff"] == 0.0 and rec["sharded_params"] > 0, (layout, rec)
    want = _hf_loss(folders["small"], record["loss"]["tokens"])
    assert abs(record["loss"]["kforge"] - want) < 1e-5, (record["loss"]["kforge"], want)
    mib = 2**20
    print(
        f"init_from {mem['n_params'] / 1e6:.0f}M params ({mem['model_bytes'] / mib:.0f} MiB fp32) on 2 ranks: to_empty "
        f"{[round(b / mib) for b in mem['materialize_bytes']]} MiB (lazy), load peak "
        f"{[round(b / mib) for b in mem['load_bytes']]} MiB (shards {[round(b / mib) for b in mem['shard_bytes']]} MiB) in "
        f"{[round(s, 1) for s in mem['load_s']]} s; first-step loss {record['loss']['kforge']:.6f} vs HF {want:.6f}; "
        f"as a MoT VLM ({vlm['model_bytes'] / mib:.0f} MiB): load peak {[round(b / mib) for b in vlm['load_bytes']]} "
        f"MiB (shards {[round(b / mib) for b in vlm['shard_bytes']]} MiB)"
    )
