"""Random-weight Hugging Face ``save_pretrained`` folders for the fine-tuning tests (nothing is downloaded).

:func:`save_random` saves a real ``transformers`` model (small); :func:`write_random_llama` writes a large Llama
folder tensor group by tensor group, from the meta model's shapes, so the writer never holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_random(
    model_cls, config, folder: Path, seed: int = 0, tokenizer: Path | None = None, dtype: torch.dtype | None = None
) -> Path:
    """``model_cls(config)`` with transformers' own random init (``seed``), saved to ``folder`` (+ tokenizer files),
    in ``dtype`` (None: fp32)."""
    torch.manual_seed(seed)
    model = model_cls(config)
    model.to(dtype or torch.float32).save_pretrained(folder)
    if tokenizer is not None:
        from kempnerforge.checkpoint.convert import copy_tokenizer_files

        copy_tokenizer_files(tokenizer, folder)
    return folder


def write_random_llama(config, folder: Path, layers_per_file: int = 4, seed: int = 0) -> int:
    """A ``LlamaForCausalLM`` folder for ``config`` with N(0, 0.02) weights (norms 1) in fp32, one safetensors file
    per ``layers_per_file`` blocks plus ``model.safetensors.index.json``; the writer holds one file's tensors at a
    time. Returns the parameter count."""
    from transformers import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    groups: dict[int, list[str]] = {}
    for key in shapes:
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
        groups.setdefault(layer // layers_per_file if layer >= 0 else -1, []).append(key)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, (_, keys) in enumerate(sorted(groups.items())):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            k: torch.ones(shapes[k]) if k.endswith("norm.weight") else torch.randn(shapes[k], generator=gen) * 0.02
            for k in keys
        }
        total += sum(t.numel() for t in tensors.values())
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    index = {"metadata": {"total_size": total * 4}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def tiny_llama_folder(folder: Path) -> Path:
    """A random 2-layer, dim-64 ``LlamaForCausalLM`` folder with the GPT-2 vocabulary and tokenizer files (tied
    embeddings), the size ``configs/finetune_debug.yaml`` is tested at."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    return save_random(
        LlamaForCausalLM, config, folder, tokenizer=Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"
    )


def llama31_8b_config(folder: Path) -> Path:
    """A config.json-only HF folder as Llama-3.1-8B's (the estimate needs no weights), ``llama3`` RoPE scaling
    included (it changes RoPE's frequencies, not any shape)."""
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def siglip_so400m(folder: Path) -> Path:
    """A config.json of SigLIP so400m's vision tower shape (384 px, patch 14, 27 layers, width 1152); no weights."""
    from transformers import SiglipVisionConfig

    SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
        patch_size=14,
    ).save_pretrained(folder)  # fmt: skip
    return folder
