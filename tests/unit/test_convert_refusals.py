"""``kforge convert hf-to-dcp`` refuses a folder it cannot import faithfully as one line naming ``--hf_dir``.

``from_pretrained`` alone would give a random tensor for a missing one and drop an unexpected one (a warning in its
load report); the converter refuses both, and a missing / truncated shard or a misshapen tensor, a folder without
``config.json`` or an unsupported architecture, before writing anything.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kempnerforge.tools.convert import convert_main
from tests.hf_folders import save_random

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def test_bad_hf_folders_are_one_line_naming_hf_dir(tmp_path, capsys):
    import transformers as tf

    good = save_random(tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL), tmp_path / "good")
    tensors = load_file(str(good / "model.safetensors"))

    def variant(name, sd=None, cut=0, config=None):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        if sd is not None:
            save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if cut:
            (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-cut])
        if config is not None:
            (folder / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()) | config))
        return folder

    cases = {
        "missing": (variant("missing", sd={k: v for k, v in tensors.items() if "1.mlp.up" not in k}), "missing keys"),
        "extra": (
            variant("extra", sd={**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
            "unexpected keys: ['model.layers.0.self_attn.q_proj.bias']",
        ),  # fmt: skip
        "truncated": (variant("truncated", cut=64), "cannot load its weights: Error while deserializing header"),
        "shape": (variant("shape", config={"intermediate_size": 40}), "a tensor's shape differs"),
        "no_config": (tmp_path / "nope", "is not a directory"),
        "gemma": (variant("gemma", config={"model_type": "gemma"}), "model_type='gemma' is not supported"),
    }
    capsys.readouterr()  # save_pretrained's own progress bars
    for name, (folder, want) in cases.items():
        with pytest.raises(SystemExit) as exit_:
            convert_main(["hf-to-dcp", "--hf_dir", str(folder), "--output_dir", str(tmp_path / "out" / name)])
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert exit_.value.code == 2 and len(lines) == 1, (name, captured.err[-2000:])
        assert lines[0].startswith(f"kforge: error: --hf_dir: {folder}") and want in lines[0], (name, lines[0])
        assert not (tmp_path / "out" / name).exists(), name  # nothing written
    convert_main(["hf-to-dcp", "--hf_dir", str(good), "--output_dir", str(tmp_path / "out" / "good")])
    assert (tmp_path / "out" / "good" / "step=0.ckpt" / "COMPLETE").is_file()


def test_import_refuses_a_checkpoint_folder_and_records_the_tokenizer(tmp_path, capsys, gpt2_tokenizer_dir):
    """An import into a folder that already holds checkpoints would repoint ``latest`` at step 0 (a run resuming from
    that folder would restart from the imported weights): refused, naming --output_dir, with the folder untouched.
    An import from a folder with tokenizer files records it, so the tools find the tokenizer by themselves."""
    import transformers as tf

    from kempnerforge.checkpoint.load import load_checkpoint_model

    good = save_random(tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL | {"vocab_size": 50257}), tmp_path / "good")
    for f in gpt2_tokenizer_dir.iterdir():  # GPT-2's 50257 tokens: a vocabulary that holds them (hf-to-dcp checks)
        shutil.copy(f, good / f.name)
    out = tmp_path / "imported"
    convert_main(["hf-to-dcp", "--hf_dir", str(good), "--output_dir", str(out)])
    assert load_checkpoint_model(out).tokenizer == str(good.resolve())
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        convert_main(["hf-to-dcp", "--hf_dir", str(good), "--output_dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kforge: error: --output_dir: {out} already holds checkpoints (latest"), lines[0]
    assert sorted(p.name for p in out.iterdir()) == before
