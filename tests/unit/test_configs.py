"""Every recipe in configs/ parses and instantiates (model, data, trainer, strategy) without running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kempnerforge.callbacks import MemoryMonitor, MFUMonitor, ModelSummary, ProgressBar
from kempnerforge.cli import KForgeCLI, cli_classes
from kempnerforge.module import CausalLM
from kempnerforge.strategies import KempnerStrategy

#: A small Llama ``config.json`` for the fine-tuning recipes (their ``model.init_from`` names the user's folder).
HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50257,
            "max_position_embeddings": 131072}  # fmt: skip
CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_recipe_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # loggers and checkpoint dirs land here, not in the repo
    args = ["--config", str(path)]
    if (
        path.stem.startswith("finetune") or "init_from: /path/to" in path.read_text()
    ):  # the user's Hugging Face folder: a config.json is all instantiation reads
        folder = tmp_path / "hf"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(HF_LLAMA))
        args.append(f"--model.init_from={folder}")
    cli = KForgeCLI(**cli_classes(args), args=args, run=False, auto_configure_optimizers=False)
    assert isinstance(cli.model, CausalLM)  # VisionLanguage subclasses it
    assert isinstance(cli.trainer.strategy, KempnerStrategy)
    # Every recipe shows tokens/s, MFU and memory, through kforge's progress bar and summary.
    kinds = {type(cb) for cb in cli.trainer.callbacks}
    assert {MFUMonitor, MemoryMonitor, ProgressBar, ModelSummary} <= kinds, kinds
    assert cli.datamodule.vocab_size == cli.model.config.vocab_size
    seq_len = getattr(cli.datamodule, "seq_len", None)
    if seq_len is not None:
        assert seq_len <= cli.model.config.max_seq_len
    else:  # VLM recipes: visual (x frames for video) + text positions per arch fit max_seq_len
        from kempnerforge.module import check_vlm_lengths

        n_visual = cli.model.n_visual() if cli.model.encoder_config.pretrained_path is None else 0
        frames = getattr(cli.datamodule, "max_frames", 1)
        check_vlm_lengths(cli.model.config, cli.model.vlm_config, n_visual, cli.datamodule.max_text_len, frames)


def test_there_is_at_least_the_debug_recipe():
    assert "debug" in [p.stem for p in CONFIGS]


def test_a_plain_data_block_under_another_data_module_is_refused_naming_both_files(tmp_path):
    """finetune_debug.yaml's TokenDataModule block, then a chat data block: one line naming both (jsonargparse's own
    error was a Union-subtype dump); the other order (a plain override after the class) stays allowed."""
    from kempnerforge.errors import UserError

    chat = tmp_path / "chat.yaml"
    chat.write_text(
        "data:\n  class_path: kempnerforge.data.chat_datamodule.ChatDataModule\n  init_args: {seq_len: 64}\n"
    )
    override = tmp_path / "override.yaml"
    override.write_text("data:\n  seq_len: 32\n")
    with pytest.raises(
        UserError, match="finetune_debug.yaml has a plain data: block .*chat.yaml .*ChatDataModule"
    ) as e:
        cli_classes(["fit", "--config", "configs/finetune_debug.yaml", "--config", str(chat)])
    assert e.value.field == "--config"
    assert cli_classes(["fit", "--config", str(chat), "--config", str(override)])["subclass_mode_data"]
