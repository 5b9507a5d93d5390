"""Issue 8 check 4: packed documents never attend across boundaries, boundary labels are ignored, and
without packing the model takes the plain causal path."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer

from kempnerforge.config import ModelConfig
from kempnerforge.data.datamodule import TokenDataModule
from kempnerforge.data.memmap import MemmapTokenDataset, TokenDataError
from kempnerforge.data.packing import document_ids
from kempnerforge.data.prepare import prepare_data
from kempnerforge.model import Transformer
from kempnerforge.module import CausalLM
from kempnerforge.training.loss import IGNORE_INDEX
from tests.conftest import GPT2_TOKENIZER, SHAKESPEARE

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50257, max_seq_len=64, multiple_of=16)
EOS = 50256


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    """Real text cut into 60 short documents (5 lines each), tokenized with GPT-2: EOS after each."""
    root = tmp_path_factory.mktemp("docs")
    lines = SHAKESPEARE.read_text().splitlines()[:300]
    with (root / "docs.jsonl").open("w") as f:
        for i in range(0, 300, 5):
            f.write(json.dumps({"text": "\n".join(lines[i : i + 5])}) + "\n")
    prepare_data(str(root / "docs.jsonl"), str(GPT2_TOKENIZER), str(root / "tok"), progress=False)
    return root / "tok"


def test_dataset_marks_documents_and_ignores_exactly_the_boundary_labels(docs_dir):
    plain = MemmapTokenDataset(docs_dir, 48)
    packed = MemmapTokenDataset(docs_dir, 48, document_masking=True)
    n_boundaries = 0
    for i in range(len(plain)):
        a, b = plain[i], packed[i]
        assert torch.equal(a["input_ids"], b["input_ids"])
        eos = a["input_ids"] == EOS
        n_boundaries += int(eos.sum())
        assert torch.equal(b["labels"][eos], torch.full((int(eos.sum()),), IGNORE_INDEX))
        assert torch.equal(b["labels"][~eos], a["labels"][~eos])
        assert torch.equal(b["doc_ids"], torch.cumsum(eos.long(), 0) - eos.long())
    assert n_boundaries >= 50  # most of the 60 documents end inside some window


def test_token_output_ignores_other_documents_and_unpacked_equals_plain_causal():
    model = Transformer(CFG)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50000, (2, 40), generator=gen)
    tokens[:, 11] = EOS  # doc 0 = positions 0..11, doc 1 = 12..27, doc 2 = 28..39
    tokens[:, 27] = EOS
    doc = document_ids(tokens, EOS)
    assert doc[0].tolist() == [0] * 12 + [1] * 16 + [2] * 12
    changed = tokens.clone()
    changed[:, :11] = torch.randint(0, 50000, (2, 11), generator=gen)  # rewrite document 0 (not its EOS)
    with torch.no_grad():
        a, b = model(tokens, doc_ids=doc), model(changed, doc_ids=doc)
        torch.testing.assert_close(a[:, 12:], b[:, 12:], rtol=0, atol=1e-6)  # docs 1, 2 unaffected
        assert not torch.allclose(a[:, :11], b[:, :11])
        plain_a, plain_b = model(tokens), model(changed)
        assert not torch.allclose(plain_a[:, 12:], plain_b[:, 12:], atol=1e-4)  # control: causal path leaks
        one_doc = model(tokens, doc_ids=torch.zeros_like(tokens))
        torch.testing.assert_close(one_doc, plain_a, rtol=1e-5, atol=1e-5)  # no boundary = plain causal
        # doc 1 alone, from position 12, equals doc 1 inside the packed window up to RoPE's relative
        # positions: attention scores depend on offsets only, so the outputs match.
        alone = model(tokens[:, 12:28])
        torch.testing.assert_close(a[:, 12:28], alone, rtol=1e-4, atol=1e-4)


def test_document_masking_trains_through_the_module(docs_dir):
    module = CausalLM(CFG, init_seed=0)
    data = TokenDataModule(str(docs_dir), seq_len=48, micro_batch_size=4, val_fraction=0.1, document_masking=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)  # fmt: skip
    trainer.fit(module, datamodule=data)
    batch = next(iter(data.train_dataloader()))
    assert batch["doc_ids"].shape == batch["input_ids"].shape
    assert float(trainer.callback_metrics["train/loss"]) < 10.9
    (val,) = trainer.validate(module, datamodule=data, verbose=False)
    assert 0 < val["val/loss"] < 10.9


def test_document_masking_needs_eos_id_in_metadata(tmp_path, docs_dir):
    import shutil

    copy = tmp_path / "noeos"
    shutil.copytree(docs_dir, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    del meta["eos_id"]
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(TokenDataError, match="document_masking needs the EOS id .* has no integer 'eos_id'"):
        MemmapTokenDataset(copy, 48, document_masking=True)
