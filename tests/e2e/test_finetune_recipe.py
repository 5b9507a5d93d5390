"""Issue 20, the tiny fine-tuning recipe: ``kforge fit --config configs/finetune_debug.yaml --model.init_from=<folder>``
on a random-weight ``transformers`` Llama folder (GPT-2 tokenizer files inside, nothing downloaded) and the bundled
tiny-shakespeare: the data is tokenized with the folder's tokenizer (``data.tokenizer`` unset), the first logged loss
is ``transformers``' loss of that folder on the run's first batch, and the run saves its checkpoint."""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_folders import save_random
from tests.procs import run_group

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _hf_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2)  # fmt: skip
    # initializer_range 0.2 (not 0.02): the start loss is far from chance (ln 50257 = 10.8), which a random init of
    # ours would give: a run that ignored the folder's weights fails the comparison below.
    return save_random(LlamaForCausalLM, config, folder, tokenizer=REPO / "data" / "tokenizers" / "gpt2")


def _first_batch_loss(folder: Path, tokens: Path) -> float:
    from transformers import AutoModelForCausalLM

    from kempnerforge.data.datamodule import TokenDataModule

    data = TokenDataModule(data_dir=str(tokens), seq_len=128, micro_batch_size=4, val_fraction=0.05, data_seed=0)
    batch = next(iter(data.train_dataloader()))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))


def test_finetune_debug_recipe_starts_from_the_folder(tmp_path):
    folder = _hf_folder(tmp_path / "hf")
    tokens = tmp_path / "tokens"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "kempnerforge.cli", "fit", "--config", "configs/finetune_debug.yaml",
        f"--model.init_from={folder}", f"--data.data_dir={tokens}", "--trainer.max_steps=4",
        "--trainer.val_check_interval=100", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.logger.class_path=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.init_args.every_n_train_steps=4",
    ]  # fmt: skip
    proc = run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((tokens / "metadata.json").read_text())["tokenizer"] == str(folder)
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    losses = [float(r["train/loss"]) for r in csv.DictReader(metrics.open()) if r.get("train/loss")]
    want = _first_batch_loss(folder, tokens)
    assert abs(losses[0] - want) < 1e-4, (losses[0], want)
    assert want > 11.5 and len(losses) == 4 and all(abs(x) < 20 for x in losses), losses
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step=000004.ckpt"
    text = proc.stdout + proc.stderr  # issue 28's feedback lines: the weights loaded, the checkpoint saved
    loaded = re.search(rf"init_from: loaded (\d+) tensors from {re.escape(str(folder))} into (\d+) parameters "
                       r"\(([0-9.]+) MiB on this rank\) in [0-9.]+ s", text)  # fmt: skip
    assert loaded and loaded.group(1) == "20" and float(loaded.group(3)) > 12, text[-3000:]  # tied: 2x9 + embed + norm
    saved = re.search(rf"Checkpoint saved: {re.escape(str(tmp_path / 'ckpt' / 'step=000004.ckpt'))} \(step 4, ", text)
    assert saved and text.count("Checkpoint saved: ") == 1, text[-3000:]
    print(f"finetune_debug: first loss {losses[0]:.5f} (HF {want:.5f}), last {losses[-1]:.3f}")
