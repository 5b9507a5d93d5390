"""Exact data resume through Trainer checkpoints (issue 8 check 6): the token batches after each resume equal
the uninterrupted run's, with two resumes inside one epoch, a resume leg that crosses the epoch boundary, and
dataloader workers. The streaming counterpart is in test_hf_streaming.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.data.prepare import prepare_data

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("resume") / "shakespeare.txt"
    src.write_text(SHAKESPEARE.read_text()[:20_000])  # 6048 GPT-2 tokens: 84 train windows of 64, 21 steps/epoch
    prepare_data(str(src), str(TOKENIZER), str(src.parent / "tokens"), progress=False)
    return src.parent / "tokens"


class Recorder(L.LightningModule):
    """Records every training batch's token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50304, 2)
        self.seen: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].tolist())
        return self.emb(batch["input_ids"]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("workers", [0, 2])
def test_double_resume_in_epoch_and_across_epochs_is_exact(prepared, tmp_path, workers):
    """Steps 0..8 | resume 8..15 | resume 15..30 (epoch 0 ends at step 21) equal one 30-step run."""

    def fit(model, steps, ckpt_path=None, every=None):
        dm = TokenDataModule(
            str(prepared), seq_len=64, micro_batch_size=4, val_fraction=0.1, num_workers=workers, data_seed=3
        )
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=bool(every),
            limit_val_batches=0,
            default_root_dir=tmp_path,
            callbacks=[ckpt] if every else [],
        )
        trainer.fit(model, dm, ckpt_path=ckpt_path)
        return trainer

    ref = Recorder()
    assert len(fit(ref, 30).train_dataloader) == 21  # so step 21 starts epoch 1
    legs = [Recorder() for _ in range(3)]
    fit(legs[0], 8, every=8)
    fit(legs[1], 15, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=8.ckpt"), every=15)
    fit(legs[2], 30, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=15.ckpt"))
    assert [len(leg.seen) for leg in legs] == [8, 7, 15]
    assert sum((leg.seen for leg in legs), []) == ref.seen
    # The two epochs differ (data_seed + epoch reshuffles) and the epoch-1 batches are really crossed into.
    assert sorted(map(str, ref.seen[:9])) != sorted(map(str, ref.seen[21:30]))


def test_data_seed_changes_the_order_only(prepared):
    """data_seed picks the shuffle; the same seed gives the same order, another seed another order."""

    def first_epoch(seed):
        dm = TokenDataModule(str(prepared), seq_len=64, micro_batch_size=4, val_fraction=0.1, data_seed=seed)
        return [b["input_ids"].tolist() for b in dm.train_dataloader()]

    a, b, c = first_epoch(1), first_epoch(1), first_epoch(2)
    assert a == b and a != c
    assert sorted(map(str, sum(a, []))) == sorted(map(str, sum(c, [])))  # same windows, other order
