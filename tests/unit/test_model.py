"""Transformer construction, initialization (meta, FSDP2, RNG independence) and forward semantics."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer, canonical_fqn, param_seed
from kempnerforge.parallel.dtensor import to_full

# Std of N(0, 1) truncated at +-3: sqrt(1 - 6 * phi(3) / (2 * Phi(3) - 1)).
TRUNC3_STD = 0.98658


def _cfg(**kw) -> ModelConfig:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32, multiple_of=32)
    return ModelConfig(**{**base, **kw})


def _eager(cfg: ModelConfig, seed: int) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def _meta(cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _assert_same_state(model: Transformer, ref: Transformer) -> None:
    """Every parameter and the RoPE buffers are bitwise equal (DTensors compared as full tensors)."""
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    want = dict(ref.named_parameters()) | dict(ref.named_buffers())
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        full = to_full(tensor)
        assert not full.is_meta and not torch.isnan(full).any(), name
        assert torch.equal(full, want[name]), name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_init_equals_eager_init(tie):
    cfg = _cfg(tie_embeddings=tie, qk_norm=True)
    model = _meta(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed=5)
    _assert_same_state(model, _eager(cfg, seed=5))
    assert {"rope_cos", "rope_sin"} <= {n for n, _ in model.named_buffers()}
    assert "rope_cos" not in model.state_dict()  # non-persistent: recomputed, never checkpointed
    assert (model.output.weight is model.tok_embeddings.weight) is tie


def test_meta_init_of_qkv_biases_head_dim_and_scaled_rope():
    """Qwen-2/3-shaped configs on the meta path: q/k/v biases zero (o_proj has none), head_dim 24 != 64 / 4, and the
    RoPE buffers are the llama3-scaled tables (equal to the eager build's)."""
    from kempnerforge.model.rope import model_rope_tables

    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8}
    cfg = _cfg(attention_bias=True, head_dim=24, qk_norm=True, rope_scaling=scaling)
    model = _meta(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    _assert_same_state(model, _eager(cfg, seed=5))
    attn = model.layers["0"].attention
    # The default fused wqkv: 4 query + 2 key + 2 value heads of 24 channels.
    assert attn.wo.bias is None and attn.wqkv.weight.shape == ((4 + 2 * 2) * 24, 64)
    assert attn.wqkv.bias is not None and torch.equal(attn.wqkv.bias, torch.zeros_like(attn.wqkv.bias))
    assert torch.equal(model.rope_cos, model_rope_tables(cfg)[0])
    assert not torch.equal(model.rope_cos, model_rope_tables(_cfg(head_dim=24))[0])


def test_init_independent_of_global_rng_and_seeded():
    cfg = _cfg()
    torch.manual_seed(0)
    a = _eager(cfg, seed=1)
    torch.manual_seed(12345)
    torch.randn(100)
    b = _eager(cfg, seed=1)
    _assert_same_state(b, a)
    c = _eager(cfg, seed=2)
    assert not torch.equal(c.layers["0"].attention.wqkv.weight, a.layers["0"].attention.wqkv.weight)
    # Distinct parameters get distinct streams (no two weights of the same shape are equal).
    assert not torch.equal(a.layers["0"].attention.wqkv.weight, a.layers["1"].attention.wqkv.weight)


def test_init_std_and_residual_scaling():
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=4, vocab_size=512, max_seq_len=16, init_std=0.02)
    model = _eager(cfg, seed=0)
    block = model.layers["0"]
    scaled = 0.02 / math.sqrt(2 * cfg.n_layers)
    for weight, std in [
        (block.feed_forward.w13.weight, 0.02),  # the default fused gate/up
        (model.tok_embeddings.weight, 0.02),
        (model.output.weight, 0.02),
        (block.attention.wo.weight, scaled),
        (block.feed_forward.w2.weight, scaled),
    ]:
        assert weight.abs().max() <= 3 * std * (1 + 1e-6)  # truncated at +-3 std
        assert weight.std().item() == pytest.approx(std * TRUNC3_STD, rel=0.03)
        assert abs(weight.mean().item()) < 0.05 * std
    assert torch.equal(block.attention_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_tied_embeddings_share_one_parameter():
    cfg = _cfg(tie_embeddings=True)
    model = _eager(cfg, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = 7.0
    assert model.output.weight[0, 0].item() == 7.0
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_wrapper_components_do_not_change_the_seed():
    assert canonical_fqn("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"
    assert canonical_fqn("layers._orig_mod.1.ffn_norm.weight") == "layers.1.ffn_norm.weight"
    assert param_seed(0, "layers.0._orig_mod.attention.wq.weight") == param_seed(0, "layers.0.attention.wq.weight")
    assert param_seed(0, "layers.0.attention.wq.weight") != param_seed(1, "layers.0.attention.wq.weight")


def test_init_through_activation_checkpoint_wrapper():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = _cfg()
    model = Transformer(cfg)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block)
    model.init_weights(seed=3)
    ref = _eager(cfg, seed=3)
    for name, param in model.named_parameters():
        assert torch.equal(param, ref.get_parameter(canonical_fqn(name))), name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def gloo_world_of_one():
    """A 1-process gloo group and a 1-D CPU mesh, torn down afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fsdp2_meta_init_equals_eager(gloo_world_of_one, tie):
    from torch.distributed.fsdp import fully_shard

    cfg = _cfg(tie_embeddings=tie)
    model = _meta(cfg)
    for block in model.layers.values():
        fully_shard(block, mesh=gloo_world_of_one)
    fully_shard(model, mesh=gloo_world_of_one)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(seed=11)
    assert isinstance(model.layers["0"].attention.wqkv.weight, DTensor)
    assert (model.output.weight is model.tok_embeddings.weight) is tie
    ref = _eager(cfg, seed=11)
    _assert_same_state(model, ref)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), atol=1e-6, rtol=0)


def test_gqa_shapes_and_equivalence_to_repeated_kv_heads():
    unfused = dict(fuse_qkv=False, fuse_w13=False)  # the test edits wk / wv by name
    gqa_cfg = _cfg(n_heads=4, n_kv_heads=2, **unfused)
    gqa = _eager(gqa_cfg, seed=0)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * 16, 64)
    tokens = torch.randint(0, 256, (3, 12))
    with torch.no_grad():
        out = gqa(tokens)
    assert out.shape == (3, 12, 256) and out.dtype == torch.float32
    # The same network as MHA with each KV head's weights repeated for its query-head group.
    mha = Transformer(_cfg(n_heads=4, n_kv_heads=None, **unfused))
    sd = gqa.state_dict()
    for key in [k for k in sd if k.endswith(("attention.wk.weight", "attention.wv.weight"))]:
        sd[key] = sd[key].view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    mha.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens), out, atol=1e-5, rtol=0)


def test_causal_future_tokens_do_not_change_past_logits():
    model = _eager(_cfg(), seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().amax(dim=-1).min() > 1e-4


def test_sequence_longer_than_max_seq_len_raises():
    model = _eager(_cfg(max_seq_len=8), seed=0)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_ffn_hidden_rule():
    # Llama-3 8B: dim 4096, ffn_dim_multiplier 1.3, multiple_of 1024 -> 14336.
    assert ModelConfig(dim=4096, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024).ffn_hidden == 14336
    # Llama-2 7B rule without multiplier: int(8 * 4096 / 3) = 10922 -> 11008 (multiple of 256).
    assert ModelConfig(dim=4096, n_heads=32, multiple_of=256).ffn_hidden == 11008
    assert ModelConfig(dim=64, n_heads=4, ffn_hidden_dim=100).ffn_hidden == 100
    model = Transformer(_cfg(multiple_of=32))
    assert model.layers["0"].feed_forward.w13.weight.shape == (2 * 192, 64)  # int(8*64/3)=170 -> 192, gate + up


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tie_embeddings=True),
        dict(n_kv_heads=1, qk_norm=True),
        dict(ffn_hidden_dim=100, tie_embeddings=True),
        dict(n_kv_heads=2, attention_bias=True),
        dict(n_kv_heads=2, head_dim=24, qk_norm=True),
        dict(head_dim=8, attention_bias=True, num_experts=4, top_k=2),
    ],
    ids=["untied", "tied", "gqa-qknorm", "explicit-ffn-tied", "qkv-bias", "head-dim-24", "moe-head-dim-8-bias"],
)
def test_num_params_matches_module(kw):
    cfg = _cfg(**kw)
    model = _meta(cfg)  # counting needs no memory
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == total
    assert cfg.num_params(exclude_embedding=True) == total - cfg.vocab_size * cfg.dim


def test_flops_per_token_convention():
    cfg = _cfg()
    n_matmul = cfg.num_params() - cfg.vocab_size * cfg.dim  # untied: drop only the lookup table
    assert cfg.flops_per_token(32) == 6 * n_matmul + 12 * 2 * 64 * 32
    # The head matmul runs whether or not it is tied, so FLOPs do not depend on tying.
    assert _cfg(tie_embeddings=True).flops_per_token(32) == cfg.flops_per_token(32)


def test_key_mask_hides_padded_keys_and_equals_causal_when_all_real():
    """Attention with a key mask: real queries ignore padded keys' values; an all-True mask is plain causal."""
    from kempnerforge.model.attention import Attention, causal_key_mask
    from kempnerforge.model.rope import rope_tables

    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    attn = Attention(cfg)
    cos, sin = rope_tables(cfg.head_dim_resolved, 8, cfg.rope_theta)
    x = torch.randn(2, 8, 32)
    mask = torch.ones(2, 8, dtype=torch.bool)
    torch.testing.assert_close(attn(x, cos, sin, mask), attn(x, cos, sin), rtol=1e-6, atol=1e-6)
    mask[0, 2:4] = False  # padding in the middle (padded video frames)
    y = x.clone()
    y[0, 2:4] = 100.0
    a, b = attn(x, cos, sin, mask), attn(y, cos, sin, mask)
    real = mask[0]
    torch.testing.assert_close(a[0, real], b[0, real], rtol=0, atol=0)
    assert not torch.allclose(attn(x, cos, sin)[0, 4:], attn(y, cos, sin)[0, 4:])  # unmasked control changes
    assert causal_key_mask(torch.zeros(1, 3, dtype=torch.bool)).squeeze().equal(torch.eye(3, dtype=torch.bool))
