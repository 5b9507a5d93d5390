"""``kforge`` with chat data (issue 20): a recipe naming ``ChatDataModule`` by ``class_path`` beside a plain
``model:`` block trains (the module renders the jsonl once, on rank 0), and bad chat input is one
``kforge: error: data.<field>: ...`` line before ``Trainer.fit`` starts anything."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

from tests.e2e.inprocess import kforge_in_process
from tests.unit.test_chat_data import OTHERS, THREE_TURNS, make_tokenizer, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def recipe(tmp: Path, **data) -> Path:
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "default_root_dir": str(tmp),
                    "strategy": {"class_path": "kempnerforge.strategies.KempnerStrategy"}},
        "model": {"config": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 50304,
                             "max_seq_len": 128, "multiple_of": 16}},
        "data": {"class_path": "kempnerforge.data.chat_datamodule.ChatDataModule",
                 "init_args": {"data_dir": str(tmp / "tokens"), "seq_len": 128, "micro_batch_size": 2, **data}},
    }  # fmt: skip
    path = tmp / "chat.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chatcli")
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"messages": OTHERS[0]}) + "\n" + json.dumps({"messages": [{"role": "bot"}]}) + "\n")
    return {
        "tokenizer": make_tokenizer(root, "chatml"),
        "source": write_jsonl(root / "chat.jsonl", [THREE_TURNS, *OTHERS] * 2),
        "bad": bad,
    }


def test_chat_recipe_trains_from_jsonl(inputs, tmp_path):
    config = recipe(tmp_path, source=str(inputs["source"]), tokenizer=str(inputs["tokenizer"]))
    proc = kforge_in_process("fit", "--config", str(config), "--ckpt_path", "null")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chat data: 12 training conversations" in proc.stderr
    meta = json.loads((tmp_path / "tokens" / "metadata.json").read_text())
    assert meta["format"] == "chat" and meta["num_conversations"] == 12


@pytest.mark.parametrize(
    "case,expect",
    [
        ("bad_line", "kforge: error: data.source: {bad} line 2: messages[0].role='bot' is not one of"),
        ("no_template", "kforge: error: data.tokenizer: data.tokenizer={gpt2} has no chat template"),
        ("missing", "kforge: error: data.source: {tmp}/none.jsonl does not exist"),
    ],
)
def test_bad_chat_input_is_one_line_before_anything_starts(inputs, tmp_path, monkeypatch, case, expect):
    calls = []

    @functools.wraps(Trainer.fit)  # LightningCLI reads its signature
    def record(*args, **kwargs):
        calls.append("fit")

    monkeypatch.setattr(Trainer, "fit", record)
    gpt2 = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "gpt2"
    data = {
        "bad_line": {"source": str(inputs["bad"]), "tokenizer": str(inputs["tokenizer"])},
        "no_template": {"source": str(inputs["source"]), "tokenizer": str(gpt2)},
        "missing": {"source": str(tmp_path / "none.jsonl"), "tokenizer": str(inputs["tokenizer"])},
    }[case]
    proc = kforge_in_process("fit", "--config", str(recipe(tmp_path, **data)), "--ckpt_path", "null")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kforge: error:")]
    assert proc.returncode == 2 and calls == [] and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(expect.format(bad=inputs["bad"], gpt2=gpt2, tmp=tmp_path))
    assert not (tmp_path / "tokens").exists()
