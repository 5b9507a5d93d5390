"""Issue 26: the zigzag layout, the cp attention mask against the one-process masks, and what ``cp > 1`` refuses.

The training parity (gloo ranks against one process) is tests/distributed/test_context_parallel.py; here the
pieces are checked against an oracle in one process: the mask of each cp rank must be the rows (its positions)
and columns (the gathered keys, in all-gather order) of :func:`document_causal_mask` / the causal mask of the
whole sequence, and attending with it over the permuted keys must give the whole-sequence attention's rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config import ModelConfig
from kempnerforge.model.attention import document_causal_mask
from kempnerforge.module import CausalLM
from kempnerforge.parallel.context_parallel import (
    ContextParallelError,
    ContextShard,
    validate_cp_run,
    zigzag_positions,
)
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.strategies import KempnerStrategy


def _shard(seq: int, cp: int, rank: int, doc_ids=None) -> ContextShard:
    keys = torch.cat([zigzag_positions(seq, cp, r) for r in range(cp)])
    return ContextShard(zigzag_positions(seq, cp, rank), keys, doc_ids, seq)


def test_zigzag_keeps_chunk_i_and_its_mirror():
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(16, 4, 3).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_covers_the_sequence_once_and_balances_causal_work(cp):
    seq = 64
    parts = [zigzag_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    work = {int((p + 1).sum()) for p in parts}  # (query, key) pairs each rank attends under the causal mask
    assert len(work) == 1


@pytest.mark.parametrize("cp", [2, 4])
def test_mask_is_the_whole_sequence_mask_at_the_ranks_rows_and_gathered_columns(cp):
    seq = 32
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.cumsum(torch.rand(3, seq, generator=g) < 0.2, dim=1)  # boundaries inside chunks
    whole = document_causal_mask(doc_ids)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for rank in range(cp):
        shard = _shard(seq, cp, rank, doc_ids)
        rows, cols = shard.positions, shard.key_positions
        assert torch.equal(shard.attention_mask(flex=False), whole[:, :, rows][:, :, :, cols])
        plain = _shard(seq, cp, rank).attention_mask(flex=False)
        assert torch.equal(plain[0, 0], causal[rows][:, cols])


def test_attending_over_the_gathered_keys_gives_the_whole_sequence_rows():
    """What one cp rank computes (its queries, every rank's keys in gather order, the cp mask) equals the rows
    of one-process causal attention at its positions (fp32, 1e-6)."""
    seq, cp = 32, 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, seq, 8, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        shard = _shard(seq, cp, rank)
        rows, cols = shard.positions, shard.key_positions
        out = F.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, cols], v[:, :, cols], attn_mask=shard.attention_mask(flex=False)
        )
        torch.testing.assert_close(out, whole[:, :, rows], rtol=1e-6, atol=1e-6)


class _Module:
    supports_context_parallel = True


def test_refusals_name_the_setting_and_what_is_allowed():
    with pytest.raises(ContextParallelError, match=r"data.seq_len=30 must be divisible by 2 x cp = 4"):
        validate_cp_run(2, "allgather", _Module(), 30, "gloo")
    with pytest.raises(ContextParallelError, match=r"each cp rank's 12 tokens must be divisible by tp=8"):
        validate_cp_run(2, "allgather", _Module(), 24, "gloo", tp=8, sequence_parallel=True)
    with pytest.raises(ContextParallelError, match="no sharding rule for the CPU SDPA kernel"):
        validate_cp_run(2, "ring", _Module(), 32, "gloo")
    with pytest.raises(ContextParallelError, match="not wired into this build"):
        validate_cp_run(2, "ring", _Module(), 32, "nccl")
    with pytest.raises(ContextParallelError, match="use one of allgather, ring"):
        KempnerStrategy(cp_attention="zigzag")
    validate_cp_run(1, "ring", object(), 30, "gloo")  # cp=1: nothing to refuse


def test_vision_language_refuses_cp():
    from kempnerforge.module import VisionLanguage

    with pytest.raises(ContextParallelError, match="VisionLanguage: the vision-language backbones"):
        validate_cp_run(2, "allgather", VisionLanguage.__new__(VisionLanguage), 32, "gloo")


def test_mesh_lends_dp_shard_x_cp_to_ep_and_refuses_moe_sequence_aux():
    assert ParallelDims(cp=2, pp=2, world_size=4).shape == (2, 1, 1, 2, 1)
    assert ParallelDims(cp=2, ep=2, world_size=2).dp_shard == 1  # ep borrows the cp ranks
    ParallelDims(cp=2, ep=4, world_size=4)  # dp_shard x cp = 2 x 2
    with pytest.raises(MeshConfigError, match=r"ep=4 must divide dp_shard x cp = 1 x 2 = 2: .* allowed ep: \[1, 2\]"):
        ParallelDims(cp=2, ep=4, world_size=2)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, num_experts=4, top_k=2, seq_aux_loss_weight=0.01)
    with pytest.raises(MeshConfigError, match="seq_aux_loss_weight=0.01 is not supported yet"):
        CausalLM(config=cfg).validate_parallel(ParallelDims(cp=2, world_size=2))
    dims = ParallelDims(cp=2, dp_shard=-1, world_size=8)
    assert (dims.dp_shard, dims.dp) == (4, 4)  # cp ranks are not data shards


def test_model_without_the_cp_entry_is_refused_under_cp():
    """A model marked for cp but called with a whole batch would attend by gathered index: refused."""
    from kempnerforge.model.attention import context_parallel_kv

    k = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="needs the cp attention mask"):
        context_parallel_kv(k, k, object(), None)


def _flex_vs_dense(device: str, backward: bool) -> None:
    """Each cp rank's FlexAttention block mask (what CUDA runs) gives the dense mask's attention over the gathered
    keys, packed documents included; with ``backward`` the gradients of q, k, v too."""
    from torch.nn.attention.flex_attention import flex_attention

    seq, cp = 256, 2
    g = torch.Generator().manual_seed(2)
    doc_ids = torch.cumsum(torch.rand(2, seq, generator=g) < 0.05, dim=1).to(device)
    q, k, v = (torch.randn(2, 4, seq, 16, generator=g).to(device).requires_grad_(backward) for _ in range(3))
    kernel = torch.compile(flex_attention) if device == "cuda" else flex_attention
    for rank in range(cp):
        shard = _shard(seq, cp, rank, doc_ids)
        shard.positions, shard.key_positions = shard.positions.to(device), shard.key_positions.to(device)
        rows, cols = shard.positions, shard.key_positions
        args = (q[:, :, rows], k[:, :, cols], v[:, :, cols])
        flex = kernel(*args, block_mask=shard.attention_mask(flex=True))
        dense = F.scaled_dot_product_attention(*args, attn_mask=shard.attention_mask(flex=False))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
        if backward:
            grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in (flex, dense)]
            for a, b in zip(*grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_flex_block_mask_equals_the_dense_mask_on_cpu():
    """CPU: FlexAttention's eager forward (torch 2.13 has no CPU backward) checks the block mask's rule."""
    _flex_vs_dense("cpu", backward=False)


@pytest.mark.gpu
def test_flex_block_mask_equals_the_dense_mask_on_cuda_forward_and_backward():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _flex_vs_dense("cuda", backward=True)
