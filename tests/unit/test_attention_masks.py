"""Which attention kernel runs, and that it computes the same thing (issue 17, one host sync per step).

- Right-padded VLM batches (every arch) and unpacked text take the ``is_causal`` kernel, no
  ``(batch, 1, seq, seq)`` mask; the oracle for real positions is each sample run alone, unpadded.
- Document masks and padding inside a sequence as FlexAttention block masks equal the dense masks
  (the CPU fallback and the oracle). On CPU, torch 2.13 runs FlexAttention forward only (eager, an
  unfused reference path), which is enough to check the masks; the compiled kernel with its backward
  is compared on CUDA (``gpu``-marked).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kempnerforge.config.vlm import VLM_ARCHS, VLMConfig
from kempnerforge.model import Transformer
from kempnerforge.model.attention import (
    attend,
    causal_key_mask,
    document_attention_mask,
    document_causal_mask,
    padding_attention_mask,
)
from kempnerforge.model.vlm import build_backbone
from tests.unit.vlm_backbone_utils import random_inputs, tiny_text_config


class _SDPASpy:
    """Records the ``attn_mask`` / ``is_causal`` of every ``scaled_dot_product_attention`` call."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[tuple[int, ...] | None, bool]] = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
            self.calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
            return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)


def _backbone(arch: str):
    torch.manual_seed(0)
    model = build_backbone(tiny_text_config(), VLMConfig(arch=arch, moma_experts_per_modality=2))
    model.init_weights(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_gate"):  # cross_attention: open the zero-initialized gates
                p.fill_(0.7)
    return model.eval()


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_right_padded_vlm_batch_takes_is_causal_and_equals_each_sample_alone(arch, monkeypatch):
    """Text right-padded (7, 5 and 3 real tokens), all visual tokens real: no self-attention mask is
    built, and the logits at real positions equal those of each sample run alone without padding."""
    model = _backbone(arch)
    ids, visual = random_inputs(model.config, batch=3, n_visual=5, n_text=7)
    lengths = [7, 5, 3]
    text_mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    spy = _SDPASpy(monkeypatch)
    with torch.no_grad():
        padded = model(ids, visual, text_mask)
        self_attention = [c for c in spy.calls if c[1]]  # the causal calls (cross-attention is not causal)
        assert self_attention and all(shape is None for shape, _ in self_attention), spy.calls
        assert all(shape is None or shape[-2] == 1 for shape, _ in spy.calls)  # nothing (seq, seq) anywhere
        for i, n in enumerate(lengths):
            alone = model(ids[i : i + 1, :n], visual[i : i + 1])
            torch.testing.assert_close(padded[i, :n], alone[0], rtol=1e-5, atol=1e-5)


def test_unpacked_text_takes_is_causal(monkeypatch):
    model = Transformer(tiny_text_config())
    model.init_weights(0)
    spy = _SDPASpy(monkeypatch)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)))
    assert spy.calls == [(None, True)] * model.config.n_layers


def _qkv(bsz=2, heads=4, kv_heads=2, seq=40, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bsz, h, seq, hd, generator=g) for h in (heads, kv_heads, kv_heads))


def _doc_ids(bsz=2, seq=40, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.rand(bsz, seq, generator=g) < 0.15, dim=1)


def _flex_eager(q, k, v, block_mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": the reference path
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def test_document_block_mask_equals_the_dense_mask_on_cpu():
    """Forward only (CPU FlexAttention has no backward): the block mask gives the dense mask's output,
    on a sequence that is not a multiple of the 128-token block, with GQA."""
    q, k, v = _qkv()
    doc = _doc_ids()
    block = document_attention_mask(doc, flex=True)
    assert isinstance(block, BlockMask)
    assert torch.equal(document_attention_mask(doc), document_causal_mask(doc))  # CPU default: dense
    torch.testing.assert_close(_flex_eager(q, k, v, block), attend(q, k, v, document_causal_mask(doc)))


def test_padding_block_mask_equals_the_dense_mask_on_cpu():
    """Padding inside the sequence (as padded video frames before the text): block mask == dense mask."""
    q, k, v = _qkv()
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, 10:16] = False
    key_mask[0, :3] = False  # a query whose earlier keys are all padding still sees itself
    block = padding_attention_mask(key_mask, right_padded=False, flex=True)
    assert isinstance(block, BlockMask)
    dense = padding_attention_mask(key_mask, right_padded=False)
    assert torch.equal(dense, causal_key_mask(key_mask))
    torch.testing.assert_close(_flex_eager(q, k, v, block), attend(q, k, v, dense))
    assert padding_attention_mask(key_mask, right_padded=True) is None
    assert padding_attention_mask(None, right_padded=False) is None


@pytest.mark.gpu
def test_document_masking_flex_equals_dense_on_cuda(monkeypatch):
    """Packed documents through the whole decoder on CUDA: the compiled FlexAttention path (the default
    there) equals the dense-mask path in loss and every gradient (fp32)."""
    import kempnerforge.model.attention as attention

    cfg = tiny_text_config(max_seq_len=256)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 200), device="cuda")
    doc = _doc_ids(seq=200).cuda()

    def run(flex: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        monkeypatch.setattr(attention, "flex_attention_supported", lambda device: flex)
        model = Transformer(cfg).cuda()
        model.init_weights(0)
        if flex:
            assert isinstance(document_attention_mask(doc), BlockMask)
        loss = model(ids, doc_ids=doc).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    flex_loss, flex_grads = run(True)
    dense_loss, dense_grads = run(False)
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-5, atol=1e-5)
    for name, g in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], g, rtol=1e-4, atol=1e-5, msg=name)
