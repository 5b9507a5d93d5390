"""KV-cache decoding (kempnerforge.model.generate): cache == no-cache, padding, EOS per row, sampling, prefix."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.generate import SamplingConfig, generate, left_pad, sample_next
from kempnerforge.model.kv_cache import KVCache


def _model(**over) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64, multiple_of=16,
                      rope_theta=10000.0, init_std=0.2, **over)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(seed=3)  # init_std 0.2: peaked logits, no near-ties for argmax
    return model.eval()


def _greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding through the training forward (no cache, no mask): the oracle."""
    tokens = torch.tensor([prompt])
    for _ in range(n):
        with torch.no_grad():
            nxt = model(tokens)[0, -1].argmax()
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return tokens[0, len(prompt) :].tolist()


PROMPTS = [[5, 17, 3, 88, 41, 9], [60, 2], [11, 12, 13, 14]]


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": True, "qk_norm": True}, {"num_experts": 4, "top_k": 2}],
                         ids=["dense", "tied-qknorm", "moe"])  # fmt: skip
def test_cache_equals_training_forward_per_row_with_left_padding(over):
    model = _model(**over)
    ids, mask = left_pad(PROMPTS)
    sampling = SamplingConfig(max_new_tokens=10)
    cached = generate(model, ids, mask, sampling)
    recomputed = generate(model, ids, mask, sampling, use_cache=False)
    assert torch.equal(cached.tokens, recomputed.tokens)
    for i, prompt in enumerate(PROMPTS):  # each padded row decodes as it would alone, unpadded
        assert cached.row(i) == _greedy_reference(model, prompt, 10)
    assert cached.tokens.shape == (3, 10) and cached.lengths.tolist() == [10, 10, 10]
    assert cached.tokens_per_s > 0


def test_cached_logits_match_full_forward():
    model = _model()
    tokens = torch.tensor([PROMPTS[0]])
    cache = KVCache(2, 1, 2, 16, 8)
    from kempnerforge.model.generate import decoder_step

    with torch.no_grad():
        full = model(tokens)[0]
        h = model.tok_embeddings(tokens)
        pos = torch.arange(6)[None]
        first = decoder_step(model, h[:, :4], pos[:, :4], torch.ones(1, 4, dtype=torch.bool), cache)
        steps = [decoder_step(model, h[:, t : t + 1], pos[:, t : t + 1], torch.ones(1, 1, dtype=torch.bool), cache)
                 for t in (4, 5)]  # fmt: skip
    torch.testing.assert_close(first[0], full[3], rtol=0, atol=1e-5)
    torch.testing.assert_close(steps[0][0], full[4], rtol=0, atol=1e-5)
    torch.testing.assert_close(steps[1][0], full[5], rtol=0, atol=1e-5)


def test_eos_stops_each_row_on_its_own():
    model = _model()
    ids, mask = left_pad(PROMPTS[:2])
    free = generate(model, ids, mask, SamplingConfig(max_new_tokens=8))
    eos = free.tokens[0, 2].item()
    assert eos not in free.tokens[1].tolist()  # the chosen EOS ends row 0 only
    stopped = generate(model, ids, mask, SamplingConfig(max_new_tokens=8), eos_token_id=eos, pad_token_id=-1)
    first = free.tokens[0].tolist().index(eos)
    assert stopped.lengths.tolist() == [first + 1, 8]
    assert stopped.row(0) == free.tokens[0, : first + 1].tolist()
    assert stopped.tokens[0, first + 1 :].eq(-1).all()
    assert torch.equal(stopped.tokens[1], free.tokens[1])


def test_all_rows_at_eos_stop_early():
    model = _model()
    ids, mask = left_pad([PROMPTS[0]])
    free = generate(model, ids, mask, SamplingConfig(max_new_tokens=8))
    out = generate(model, ids, mask, SamplingConfig(max_new_tokens=8), eos_token_id=[free.tokens[0, 1].item(), 1000])
    assert out.tokens.shape[1] == free.tokens[0].tolist().index(free.tokens[0, 1].item()) + 1


def test_prefix_embeds_equal_the_same_tokens_as_prompt():
    """The VLM hook: embeddings fed as a prefix decode exactly like the tokens they embed."""
    model = _model()
    ids, mask = left_pad([PROMPTS[0], PROMPTS[2]])
    whole = generate(model, ids, mask, SamplingConfig(max_new_tokens=6))
    with torch.no_grad():
        prefix = model.tok_embeddings(ids[:, :3])
    split = generate(model, ids[:, 3:], None, SamplingConfig(max_new_tokens=6), prefix_embeds=prefix,
                     prefix_mask=mask[:, :3])  # fmt: skip
    assert torch.equal(whole.tokens, split.tokens)


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top_k = sample_next(logits, SamplingConfig(temperature=1.0, top_k=2), gen)
    assert set(top_k.tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: top_p 0.8 keeps tokens 0 and 1
    top_p = sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.8), gen)
    assert set(top_p.tolist()) == {0, 1}
    assert (top_p == 0).float().mean().item() == pytest.approx(float(probs[0] / probs[:2].sum()), abs=0.04)
    hot = sample_next(logits, SamplingConfig(temperature=1.0), gen)
    assert (hot == 0).float().mean().item() == pytest.approx(float(probs[0]), abs=0.04)
    assert sample_next(logits[:1], SamplingConfig(), gen).item() == 0  # greedy


def test_sampling_is_seeded():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.5, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(generate(model, ids, mask, cfg).tokens, generate(model, ids, mask, cfg).tokens)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
     ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)  # fmt: skip
def test_bad_sampling_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_too_long_refused_before_decoding():
    model = _model()
    ids, mask = left_pad([PROMPTS[0]])
    with pytest.raises(ValueError, match="max_seq_len=64"):
        generate(model, ids, mask, SamplingConfig(max_new_tokens=60))
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])
    with pytest.raises(ValueError, match="prefix_embeds must be"):
        generate(model, ids, mask, SamplingConfig(max_new_tokens=2), prefix_embeds=torch.zeros(1, 3, 16))
