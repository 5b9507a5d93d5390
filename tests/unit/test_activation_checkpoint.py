"""Activation checkpointing: which blocks are wrapped, recompute really happens, grads equal no-AC exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer
from kempnerforge.parallel.activation_checkpoint import apply_ac, unwrap_block, validate_ac
from kempnerforge.parallel.order import TransformOrderError, record_step

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16)


def _model() -> Transformer:
    model = Transformer(CFG)
    model.init_weights(seed=0)
    return model


def _count_block_forwards(model: Transformer) -> list[int]:
    """Count calls of each block's feed_forward (recompute enters it again; a pre-hook, because the
    non-reentrant recompute stops early, before the forward returns, once it has what backward needs)."""
    counts = [0] * CFG.n_layers
    for i, block in enumerate(model.layers.values()):
        ffn = unwrap_block(block).feed_forward
        ffn.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def _step(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model(tokens).float().logsumexp(-1).sum().backward()
    from kempnerforge.model import canonical_fqn

    return {canonical_fqn(n): p.grad.clone() for n, p in model.named_parameters()}


class _CountOps(TorchDispatchMode):
    """Counts aten ops executed (ops served from a selective-checkpoint cache are not executed)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("mode", "every_n", "wrapped", "forwards"),
    [
        ("none", 2, [], [1, 1, 1, 1]),
        ("full", 2, ["0", "1", "2", "3"], [2, 2, 2, 2]),
        ("selective", 2, ["1", "3"], [1, 2, 1, 2]),
        ("selective", 3, ["2"], [1, 1, 2, 1]),
        ("selective", 1, ["0", "1", "2", "3"], [2, 2, 2, 2]),
        ("selective_op", 2, ["0", "1", "2", "3"], [2, 2, 2, 2]),
    ],
)
def test_modes_wrap_recompute_and_keep_grads_exact(mode, every_n, wrapped, forwards):
    reference = _model()
    expected = _step(reference, TOKENS)
    model = _model()
    assert apply_ac(model, mode, every_n) == wrapped
    assert [n for n, b in model.layers.items() if isinstance(b, CheckpointWrapper)] == wrapped
    counts = _count_block_forwards(model)
    grads = _step(model, TOKENS)
    assert counts == forwards  # checkpointed blocks run their forward again in backward
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name  # bitwise: recompute is deterministic


def test_selective_op_saves_matmuls_and_attention_but_recomputes_the_rest():
    """Op-level SAC: no mm / SDPA is re-executed in backward, elementwise ops (silu) are."""
    counts = {}
    for mode in ("none", "full", "selective_op"):
        model = _model()
        apply_ac(model, mode)
        loss = model(TOKENS).float().logsumexp(-1).sum()
        with _CountOps() as ops:
            loss.backward()
        counts[mode] = ops.counts
    none, full, sop = counts["none"], counts["full"], counts["selective_op"]
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert full["mm"] > none["mm"] and full.get(sdpa, 0) == CFG.n_layers  # full AC recomputes matmuls and attention
    assert sop["mm"] == none["mm"] and sop.get(sdpa, 0) == 0  # selective_op serves them from its cache
    assert none.get("silu", 0) == 0 and sop["silu"] == CFG.n_layers  # ...and recomputes the cheap ops


def recomputed_in_backward(monkeypatch, saved_ops: frozenset, device: str = "cpu") -> list[str]:
    """The forward-op targets (``flex_attention``, ``mm``) in the backward graph of a compiled checkpointed block
    ``silu(flex_attention(split(x @ w)))`` under ``selective_op`` with ``saved_ops``: AOTAutograd's min-cut
    partitioner (inductor's) applies the policy to the graph, so a saved op is absent there and a recomputed
    one present. torch 2.13 runs no FlexAttention backward on CPU (its API refuses inputs that require grad);
    with that check lifted the graph traces and runs in FlexAttention's reference (math) implementation
    (tests/gpu/test_gpu_loss_path.py runs it on CUDA)."""
    import torch.nn.attention.flex_attention as flex_api
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import checkpoint

    from kempnerforge.parallel import activation_checkpoint as ac

    if device == "cpu":
        monkeypatch.setattr(flex_api, "_validate_device", lambda *args: None)
    monkeypatch.setattr(ac, "SAVED_OPS", saved_ops)
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    mask = flex_api.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 2, 128, 128, device=device)

    def block(x, w):
        q, k, v = (x @ w).view(1, 128, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.silu(flex_api.flex_attention(q, k, v, block_mask=mask))

    def checkpointed(x, w):
        return checkpoint(block, x, w, use_reentrant=False, context_fn=ac.selective_op_context_fn)

    torch._dynamo.reset()  # a fresh trace: the policy is applied when the block is compiled
    backend = aot_autograd(
        fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=min_cut_rematerialization_partition
    )
    x = torch.randn(1, 128, 32, device=device, requires_grad=True)
    w = torch.randn(32, 96, device=device, requires_grad=True)
    torch.compile(checkpointed, backend=backend, fullgraph=True)(x, w).sum().backward()
    torch._dynamo.reset()
    names = [str(n.target) for n in graphs["bw"].graph.nodes if n.op == "call_function"]
    return [n for n in names if n in ("flex_attention", "flex_attention_backward", "aten.mm.default")]


def test_selective_op_saves_flex_attention_output(monkeypatch):
    """Packed documents on CUDA attend through FlexAttention: under selective_op its output is saved like SDPA's
    (the policy says MUST_SAVE for the higher-order op), so a compiled block's backward runs only the flex backward,
    no second flex forward; without the op in the list the same block recomputes it (the check can fail)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from kempnerforge.parallel.activation_checkpoint import SAVED_OPS, _save_matmul_attention_topk

    flex = torch.ops.higher_order.flex_attention
    assert _save_matmul_attention_topk(None, flex) == CheckpointPolicy.MUST_SAVE
    assert _save_matmul_attention_topk(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    # x @ w's two gradient matmuls (dx, dw); the forward x @ w is saved, not re-run.
    assert recomputed_in_backward(monkeypatch, SAVED_OPS) == ["flex_attention_backward", *["aten.mm.default"] * 2]
    assert recomputed_in_backward(monkeypatch, SAVED_OPS - {flex})[0] == "flex_attention"


def test_unknown_block_type_raises_instead_of_skipping():
    model = _model()
    model.layers["2"] = nn.Linear(32, 32)
    with pytest.raises(
        ValueError,
        match=r"does not know block type Linear \(model.layers\['2'\]\); known types: \[.*'TransformerBlock'.*\]",
    ):
        apply_ac(model, "full")
    assert not any(isinstance(b, CheckpointWrapper) for b in model.layers.values())  # nothing half-wrapped


def test_unknown_type_raises_even_in_selective_mode_where_it_would_not_be_wrapped():
    model = _model()
    model.layers["0"] = nn.Identity()
    with pytest.raises(ValueError, match="does not know block type Identity"):
        apply_ac(model, "selective", every_n=2)


def test_model_without_layers_raises():
    with pytest.raises(ValueError, match="activation checkpointing needs model.layers"):
        apply_ac(nn.Linear(2, 2), "full")


@pytest.mark.parametrize(
    ("mode", "every_n", "message"),
    [
        (
            "sometimes",
            2,
            "activation_checkpointing='sometimes' is not allowed; choose one of ['none', 'full', 'selective', 'selective_op'].",
        ),
        ("selective", 0, "ac_every_n=0 is not allowed: use an integer >= 1 (1 checkpoints every block)."),
        ("selective", 1.5, "ac_every_n=1.5 is not allowed: use an integer >= 1 (1 checkpoints every block)."),
    ],
)
def test_validation_messages(mode, every_n, message):
    with pytest.raises(ValueError) as err:
        validate_ac(mode, every_n)
    assert str(err.value) == message


def test_ac_after_fsdp_raises():
    model = _model()
    record_step(model, "fsdp")
    with pytest.raises(TransformOrderError, match="Cannot apply 'activation_checkpoint' after 'fsdp'"):
        apply_ac(model, "full")


def test_state_dict_keys_unchanged_by_ac():
    plain, wrapped = _model(), _model()
    apply_ac(wrapped, "full")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())  # and loads back through the wrapper's pre-load hook
