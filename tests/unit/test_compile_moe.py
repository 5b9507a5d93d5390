"""Per-block compile of MoE blocks equals eager (issue 19 check 5).

A tiny MoE model (dim 16, 2 blocks, 4 experts, 1 shared expert, capacity dropping, aux and z losses) trained
3 SGD steps eagerly and compiled from the same weights: losses and every gradient within 1e-6 (fp32), for
the softmax and the sigmoid router (with the aux-loss-free bias updated between steps), without and with
activation checkpointing (full, every-2nd-block, op-level selective). Every block compiles to one graph
without breaks (``fullgraph=True``) and the routing changing between steps recompiles nothing. The
state-dict keys are those of the eager model.

One case runs inductor (CPU code generation, ~35 s of CPU cold); the others use ``aot_eager``: the same
dynamo capture, AOT autograd (activation-checkpoint partitioning, the grouped-GEMM custom op) without code
generation. Expert parallelism under compile is checked in tests/distributed/test_expert_parallel_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.model.moe import _GROUPED_MM_PROBE
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.parallel.compile import apply_compile
from kempnerforge.training.moe_balance import MoEStepTracker


def _model(router: str) -> Transformer:
    cfg = ModelConfig(dim=16, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16, ffn_hidden_dim=16,
                      num_experts=4, top_k=2, router=router, n_shared_experts=1, aux_loss_weight=0.01,
                      z_loss_weight=0.001, capacity_factor=1.0,
                      bias_update_rate=0.05 if router == "sigmoid" else 0.0)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(0)
    return model


def _train(model: Transformer, steps: int = 3) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``steps`` SGD steps on fixed batches; the losses and every step's gradients by canonical name."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tracker, rate = MoEStepTracker(), model.config.bias_update_rate
    losses, grads = [], []
    for step in range(steps):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        out = model(tokens)
        loss = out.float().square().mean() + tracker.collect(model, new_step=True)
        loss.backward()
        tracker.finish_step(model, None, rate=rate)  # sigmoid: the selection bias moves between steps
        losses.append(loss.item())
        grads.append(
            {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
        )
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize(
    ("router", "ac", "backend", "graphs"),
    [
        ("sigmoid", "full", "inductor", 1),
        ("softmax", "none", "aot_eager", 1),
        ("softmax", "selective_op", "aot_eager", 1),
        ("sigmoid", "selective", "aot_eager", 2),  # block 0 plain, block 1 checkpointed: two graphs
    ],
)
def test_compiled_moe_blocks_equal_eager(router, ac, backend, graphs, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager = _model(router)
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        apply_ac(model, ac)
    torch._dynamo.reset()
    counters.clear()
    assert apply_compile(compiled, backend=backend) == ["0", "1"]
    _GROUPED_MM_PROBE.clear()  # compiled first: the build probe must also work when first run while tracing
    losses, grads = _train(compiled)
    ref_losses, ref_grads = _train(eager)
    assert counters["stats"]["unique_graphs"] == graphs  # one per block type, for all steps
    assert not counters["graph_break"] and not counters["recompiles"]
    assert ref_losses[-1] != ref_losses[0]  # the model trains (and, sigmoid, the bias moved)
    for a, b in zip(ref_losses, losses, strict=True):
        assert abs(a - b) <= 1e-6, (ref_losses, losses)
    for step, (want, got) in enumerate(zip(ref_grads, grads, strict=True)):
        assert want.keys() == got.keys()
        for name in want:
            err = (want[name] - got[name]).abs().max().item()
            assert err <= 1e-6, (step, name, err)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in k for k in compiled.state_dict())
