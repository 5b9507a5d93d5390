"""Packed chat rows on CUDA, where the document mask is a FlexAttention block mask: each conversation's logits in
a packed row equal its logits alone (the CPU test checks the dense-mask path, tests/unit/test_chat_data.py), and
the assistant-token loss of the packed batch equals the per-conversation hand computation. fp32, 1 GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config import ModelConfig
from kempnerforge.data.chat_dataset import ChatDataset
from kempnerforge.data.chat_prepare import prepare_chat_data
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.loss import IGNORE_INDEX
from tests.unit.test_chat_data import OTHERS, THREE_TURNS, make_tokenizer, write_jsonl

pytestmark = pytest.mark.gpu


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("no_tf32")
def test_packed_chat_rows_equal_conversations_alone_under_flex_attention(tmp_path):
    tok = make_tokenizer(tmp_path, "chatml")
    src = write_jsonl(tmp_path / "c.jsonl", [THREE_TURNS, *OTHERS] * 3)
    prepare_chat_data(str(src), str(tok), str(tmp_path / "out"), progress=False)
    data = ChatDataset(tmp_path / "out", seq_len=256, packing=True)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50304, max_seq_len=256, init_std=0.2)
    model = Transformer(cfg).cuda()
    model.init_weights(seed=0)
    rows = [data[i] for i in range(len(data))]
    batch = {k: torch.stack([r[k] for r in rows]).cuda() for k in rows[0]}
    with torch.no_grad():
        packed = model(batch["input_ids"], doc_ids=batch["doc_ids"]).float()
        total, count = torch.zeros((), device="cuda", dtype=torch.float64), 0
        for r, row in enumerate(rows):
            for d in row["doc_ids"].unique().tolist():
                pos = (batch["doc_ids"][r] == d).nonzero().flatten()
                labels = batch["labels"][r, pos]
                if labels.eq(IGNORE_INDEX).all():  # the padding tail
                    continue
                alone = model(batch["input_ids"][r, pos][None])[0].float()
                torch.testing.assert_close(packed[r, pos], alone, atol=2e-4, rtol=2e-4)
                keep = labels != IGNORE_INDEX
                total += F.cross_entropy(alone[keep].double(), labels[keep], reduction="sum")
                count += int(keep.sum())
        flat = F.cross_entropy(packed.flatten(0, 1).double(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    assert count == int(batch["labels"].ne(IGNORE_INDEX).sum())
    torch.testing.assert_close(flat, total / count, rtol=1e-5, atol=1e-6)
