"""State-dict keys are identical with and without per-block compile and activation checkpointing.

``checkpoint_wrapper`` puts ``_checkpoint_wrapped_module`` into parameter FQNs and
``torch.compile(module)`` would add ``_orig_mod``; ``block.compile()`` adds nothing, and the wrapper's
state-dict hooks and DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` strip the AC part.
So a checkpoint written with AC + compile loads without them and vice versa. No forward runs here,
so nothing is actually compiled (compilation is lazy); the numerics of compiled blocks are proven by
the distributed parity test.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from kempnerforge.config import ModelConfig
from kempnerforge.model import Transformer, canonical_fqn
from kempnerforge.parallel.activation_checkpoint import apply_ac
from kempnerforge.parallel.compile import apply_compile
from kempnerforge.parallel.dtensor import to_full
from kempnerforge.parallel.order import TransformOrderError, record_step

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=16, multiple_of=16)


def _build(ac: str, compile: bool, fsdp: bool) -> Transformer:
    from torch.distributed.device_mesh import init_device_mesh

    from kempnerforge.parallel.fsdp import apply_fsdp

    with torch.device("meta"):
        model = Transformer(CFG)
    apply_ac(model, ac)
    apply_compile(model, enabled=compile)
    if fsdp:
        apply_fsdp(model, init_device_mesh("cpu", (1,)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    return model


def _keys(model: Transformer) -> dict[str, list[str]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the Adam moments, so the optimizer state has per-parameter keys
    return {
        "state_dict": list(model.state_dict()),
        "dcp_model": list(get_model_state_dict(model)),
        "dcp_optim": sorted(get_optimizer_state_dict(model, optimizer)["state"]),
    }


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize(
    ("ac", "compile"),
    [("full", False), ("none", True), ("full", True), ("selective", True), ("selective_op", True)],
)
def test_keys_identical_with_and_without_compile_and_ac(gloo_world_1, ac, compile, fsdp):
    plain = _keys(_build("none", False, fsdp))
    transformed_model = _build(ac, compile, fsdp)
    if compile:
        assert all(b._compiled_call_impl is not None for b in transformed_model.layers.values())
    if ac != "none":  # the wrapper really is there, only hidden from the state dict
        assert any("_checkpoint_wrapped_module" in n for n, _ in transformed_model.named_parameters())
    transformed = _keys(transformed_model)
    assert transformed == plain
    assert not any("_orig_mod" in k or "_checkpoint_wrapped_module" in k for ks in transformed.values() for k in ks)


def test_weights_identical_with_and_without_ac_and_compile(gloo_world_1):
    """Init is keyed by the canonical FQN, so the wrappers do not change the initial weights."""
    plain, transformed = _build("none", False, True), _build("full", True, True)
    a = {canonical_fqn(n): to_full(p) for n, p in plain.named_parameters()}
    b = {canonical_fqn(n): to_full(p) for n, p in transformed.named_parameters()}
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_plain_model_loads_a_transformed_state_dict(gloo_world_1):
    transformed, plain = _build("full", True, False), Transformer(CFG)
    result = plain.load_state_dict(transformed.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(plain.norm.weight, transformed.norm.weight)
    result = transformed.load_state_dict(plain.state_dict())
    assert not result.missing_keys and not result.unexpected_keys


def test_compile_after_fsdp_raises():
    model = Transformer(CFG)
    record_step(model, "fsdp")
    with pytest.raises(TransformOrderError, match="Cannot apply 'compile' after 'fsdp'"):
        apply_compile(model)


def test_compile_disabled_only_records():
    model = Transformer(CFG)
    assert apply_compile(model, enabled=False) == []
    assert all(b._compiled_call_impl is None for b in model.layers.values())
