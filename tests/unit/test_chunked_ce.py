"""Chunked (fused head + cross-entropy) loss equals the plain loss in value and gradient; ``loss_impl`` rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.module import CausalLM
from kempnerforge.parallel.mesh import MeshConfigError, ParallelDims
from kempnerforge.training.chunked_ce import chunked_linear_cross_entropy_sum
from kempnerforge.training.loss import IGNORE_INDEX

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16, multiple_of=16)


@pytest.mark.parametrize("chunk,z_weight", [(1, 0.0), (7, 0.0), (64, 0.0), (1000, 0.0), (7, 0.01), (None, 0.0)])
def test_value_and_gradients_equal_plain_cross_entropy(chunk, z_weight):
    """Chunked CE (+ z-loss) == F.cross_entropy (+ w * sum lse^2 over targets), value and both gradients."""
    torch.manual_seed(0)
    h = torch.randn(3, 21, 24, requires_grad=True)
    w = torch.randn(301, 24, requires_grad=True)
    y = torch.randint(0, 301, (3, 21))
    y[0, :4] = IGNORE_INDEX
    y[2, :] = IGNORE_INDEX  # a row with no target at all
    logits = (h @ w.t()).flatten(0, 1)
    ref = F.cross_entropy(logits, y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    z_ref = (torch.logsumexp(logits, -1).square() * (y.flatten() != IGNORE_INDEX)).sum()
    ref = ref + z_weight * z_ref
    (ref * 0.5).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out, z_sum = chunked_linear_cross_entropy_sum(h, w, y, chunk, z_weight)
    (out * 0.5).backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(z_sum, z_ref.detach() if z_weight else torch.tensor(0.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, gh, rtol=1e-6, atol=1e-6 * gh.abs().max().item())
    torch.testing.assert_close(w.grad, gw, rtol=1e-6, atol=1e-6 * gw.abs().max().item())
    with pytest.raises(RuntimeError, match="backward ran twice"):  # the stored gradients are scaled in place
        out, _ = chunked_linear_cross_entropy_sum(h, w, y, chunk, z_weight)
        out.backward(retain_graph=True)
        out.backward()


def _gemms(h, w, y) -> tuple[int, torch.Tensor]:
    """Matrix products the chunked loss runs (profiled aten mm / addmm calls) and its value."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out, _ = chunked_linear_cross_entropy_sum(h, w, y, 8)
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm_")), out


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_a_frozen_input_gets_no_gradient_gemm(frozen):
    """A frozen head (LLaVA's stage 1) or frozen hidden states: the other gradient equals the plain loss's, and the
    frozen one is never computed: one GEMM fewer per chunk (4 chunks: 8 instead of 12) and no buffer kept."""
    torch.manual_seed(0)
    h = torch.randn(2, 16, 24, requires_grad=True)
    w = torch.randn(301, 24, requires_grad=True)
    y = torch.randint(0, 301, (2, 16))
    both, _ = _gemms(h, w, y)
    (h if frozen == "hidden" else w).requires_grad_(False)
    F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), reduction="sum").backward()
    trained = w if frozen == "hidden" else h
    want, trained.grad = trained.grad.clone(), None
    count, out = _gemms(h, w, y)
    out.backward()
    torch.testing.assert_close(trained.grad, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert (h if frozen == "hidden" else w).grad is None
    assert (both, count) == (12, 8)


def test_bf16_inputs_match_the_module_path_at_bf16_rounding():
    """Mixed precision (bf16 head weight and hidden states, as FSDP2's policy gives them): the logits are rounded
    to bf16 as the head module's output is, everything after is fp32, gradients come back in bf16."""
    torch.manual_seed(0)
    h = torch.randn(40, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(257, 32) * 0.3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 257, (40,))
    y[:3] = IGNORE_INDEX
    ref = F.cross_entropy((h @ w.t()).float(), y, reduction="sum", ignore_index=IGNORE_INDEX)
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out, _ = chunked_linear_cross_entropy_sum(h, w, y, 16)
    out.backward()
    assert out.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)  # same bf16 logits, same fp32 math
    torch.testing.assert_close(h.grad, gh, rtol=1.6e-2, atol=1e-2 * gh.abs().max().item())
    torch.testing.assert_close(w.grad, gw, rtol=1.6e-2, atol=1e-2 * gw.abs().max().item())


def _bf16_head_inputs(tokens: int, dim: int, vocab: int):
    torch.manual_seed(0)
    h = torch.randn(tokens, dim).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, dim) * 0.3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    y[:3] = IGNORE_INDEX
    return h, w, y


def test_bf16_head_gradient_is_summed_in_fp32_and_rounded_once():
    """The head's bf16 gradient is the fp32 sum over chunks (1-token chunks: 61 of them) of the bf16 logit gradient
    times the bf16 hidden states, rounded to bf16 once: within one bf16 rounding (2^-8 relative) plus the fp32 sum's
    own error (61 adds: 61 * 2^-24 of the sum of |products|) of the fp64 sum. vocab x dim odd (257 x 33): the
    in-place cast's odd element count; the first half of the rows and the second go through different buffers."""
    h, w, y = _bf16_head_inputs(61, 33, 257)
    out, _ = chunked_linear_cross_entropy_sum(h, w, y, 1)
    out.backward()
    logits = (h @ w.t()).float()  # bf16 logits, as the module and the chunked path round them
    ok = (y != IGNORE_INDEX).float()[:, None]
    g = (torch.softmax(logits, -1) - F.one_hot(y.clamp(min=0), 257)) * ok
    g = g.to(torch.bfloat16).double()  # the logits' gradient as the bf16 head sees it
    ref = g.t() @ h.double()
    sum_error = 61 * 2**-24 * (g.abs().t() @ h.double().abs())
    assert w.grad.dtype == torch.bfloat16 and w.grad.is_contiguous()
    assert ((w.grad.double() - ref).abs() <= 2**-8 * ref.abs() + sum_error).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peak_memory_is_the_stated_bound(dtype):
    """Memory of one forward (torch's MemTracker on real CPU tensors) within the module docstring's bound: the
    (chunk, vocab) fp32 block and two (chunk, vocab) blocks of the inputs' dtype, the hidden states' gradient, the
    (chunk, dim) fp32 copy of a chunk's hidden states, and 4 bytes per head element for the fp32 sum. After the
    forward only the two gradients are held, each in its own dtype (bf16: 2 bytes per head element). Before the
    in-place sum (a bf16 (vocab, dim) partial per chunk and a cast copy at the end) bf16 peaked at 8 bytes per head
    element plus the chunk's blocks: 8.8 MB against this bound's 4.8 MB."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens, dim, vocab, chunk = 64, 256, 4096, 16
    h = torch.randn(tokens, dim).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim) * 0.02).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    size = h.element_size()
    tracker = MemTracker()
    tracker.track_external(h, w, y)
    cpu = torch.device("cpu")
    with tracker:
        base = tracker.get_tracker_snapshot()[cpu]["Total"]
        out, _ = chunked_linear_cross_entropy_sum(h, w, y, chunk)
        held = tracker.get_tracker_snapshot()[cpu]["Total"] - base
        rise = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - base
    bound = chunk * vocab * (4 + 2 * size) + tokens * dim * size + chunk * dim * 4 + 4 * vocab * dim
    assert rise <= bound, (rise, bound)
    assert vocab * dim * size + tokens * dim * size <= held <= vocab * dim * size + tokens * dim * size + 64


def test_autocast_keeps_the_fused_loss_exact():
    """Under bf16 autocast the fused path still computes fp32 logits from fp32 inputs (autocast is off inside it):
    equal to F.cross_entropy of the fp32 logits, value and gradients, to 1e-6."""
    torch.manual_seed(0)
    h = torch.randn(33, 24, requires_grad=True)
    w = torch.randn(301, 24, requires_grad=True)
    y = torch.randint(0, 301, (33,))
    y[:4] = IGNORE_INDEX
    ref = F.cross_entropy(h @ w.t(), y, reduction="sum", ignore_index=IGNORE_INDEX)
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = chunked_linear_cross_entropy_sum(h, w, y, 8)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, gh, rtol=1e-6, atol=1e-6 * gh.abs().max().item())
    torch.testing.assert_close(w.grad, gw, rtol=1e-6, atol=1e-6 * gw.abs().max().item())


def test_model_forward_with_labels_equals_logits_path_and_validates():
    model = Transformer(CFG)
    model.init_weights(seed=3)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    labels = torch.randint(0, CFG.vocab_size, (2, 16))
    ref = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(model(tokens, labels=labels, loss_chunk_size=5)[0], ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(model(tokens, labels=labels)[0], ref, rtol=1e-6, atol=0)  # the default chunk size
    with pytest.raises(ValueError, match="loss_impl='torch' does not fuse the head"):
        model(tokens, labels=labels, loss_impl="torch")
    with pytest.raises(ValueError, match="chunk_size=0 must be >= 1"):
        chunked_linear_cross_entropy_sum(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"disagree in the number of tokens"):
        chunked_linear_cross_entropy_sum(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), 2)


def _train(chunk: int, samples, cfg: ModelConfig = CFG, z: float = 0.0, impl: str = "auto") -> CausalLM:
    from kempnerforge.strategies import KempnerStrategy

    module = CausalLM(cfg, loss_chunk_size=chunk, init_seed=1, z_loss_weight=z, loss_impl=impl)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=KempnerStrategy(),
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(samples, batch_size=4, shuffle=False))
    return module


@pytest.mark.parametrize(
    "moe,z,tied",
    [(False, 0.0, False), (True, 0.0, False), (False, 0.05, False), (False, 0.0, True)],
    ids=["dense", "moe", "dense_zloss", "tied"],
)
def test_three_training_steps_match_the_plain_loss(moe, z, tied):
    """Module level: the default (auto: chunked) and the logits path (torch) give the same weights after 3 steps
    (MoE aux losses and the z-loss ride on the same global-token normalization; a tied head shares the embedding's
    gradient); the z-loss really changes the update."""
    cfg = replace(CFG, num_experts=4, top_k=2) if moe else replace(CFG, tie_embeddings=tied)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (12, 17), generator=gen)
    samples = [{"input_ids": r[:-1], "labels": r[1:].clone()} for r in ids]
    samples[1]["labels"][:5] = IGNORE_INDEX
    a, b = _train(0, samples, cfg, z, impl="torch"), _train(6 if z else 0, samples, cfg, z)
    assert a.resolved_loss_impl == "torch" and b.resolved_loss_impl == "chunked"
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    if z:
        c = _train(0, samples, cfg, 0.0, impl="torch")
        assert not torch.allclose(a.model.output.weight, c.model.output.weight, rtol=0, atol=1e-6)


def test_loss_impl_resolution_and_refusals():
    """auto: chunked on one process, the logits path (loss_parallel) with tp > 1 and with pp > 1; explicit fused
    settings there are refused naming the field; bad values at construction."""
    module = CausalLM(CFG)
    assert module.resolved_loss_impl == "chunked"
    module.validate_parallel(ParallelDims(tp=2, world_size=2))
    assert module.resolved_loss_impl == "torch"
    module.validate_parallel(ParallelDims(pp=2, world_size=2))
    assert module.resolved_loss_impl == "torch"
    assert CausalLM(CFG, loss_impl="torch").resolved_loss_impl == "torch"
    with pytest.raises(MeshConfigError, match=r"loss_chunk_size=8 needs tp=1 \(got tp=2\)"):
        CausalLM(CFG, loss_chunk_size=8).validate_parallel(ParallelDims(tp=2, world_size=2))
    with pytest.raises(MeshConfigError, match=r"model.loss_impl=chunked needs tp=1 \(got tp=2\)"):
        CausalLM(CFG, loss_impl="chunked").validate_parallel(ParallelDims(tp=2, world_size=2))
    with pytest.raises(MeshConfigError, match=r"model.loss_impl=liger is not supported with pp=2"):
        CausalLM(CFG, loss_impl="liger").validate_parallel(ParallelDims(pp=2, world_size=2))
    with pytest.raises(ValueError, match="loss_chunk_size=-1 must be >= 0"):
        CausalLM(CFG, loss_chunk_size=-1)
    with pytest.raises(ValueError, match=r"model.loss_impl='fast' is not allowed; choose one of \['auto'"):
        CausalLM(CFG, loss_impl="fast")
    with pytest.raises(ValueError, match="model.loss_chunk_size=8 needs model.loss_impl=chunked or auto"):
        CausalLM(CFG, loss_impl="torch", loss_chunk_size=8)


def test_liger_refused_off_cuda():
    """On CPU the Liger path is refused with one line naming the field, before any kernel runs."""
    from kempnerforge.training.loss_impl import fused_head_loss

    with pytest.raises(ValueError, match=r"model.loss_impl=liger runs Liger-Kernel's Triton kernels on CUDA only"):
        fused_head_loss(torch.zeros(1, 2, 4, requires_grad=True), torch.zeros(3, 4), torch.zeros(1, 2).long(), "liger")
    from tests.e2e.inprocess import kforge_in_process

    proc = kforge_in_process("fit", "--config", "configs/debug.yaml", "--model.loss_impl=liger")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "kforge: error: model.loss_impl: liger runs Liger-Kernel's Triton kernels on CUDA only; use auto, torch or "
        "chunked on this accelerator"
    ), last


def test_memory_benchmark_shows_chunked_peak_below_plain_at_50k_vocab():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "chunked_ce_memory.py"
    spec = importlib.util.spec_from_file_location("chunked_ce_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # 512 tokens x 50,304 vocab: plain fp32 logits are 98 MiB (plus their gradient); chunks of 64 are 12 MiB.
    plain, chunked = bench.run(512, 64, 50304, 0), bench.run(512, 64, 50304, 64)
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert plain["peak_rise_mib"] > 150
    assert chunked["peak_rise_mib"] < plain["peak_rise_mib"] / 2, (chunked, plain)  # measured ~100 vs ~310 MiB
