"""The transform chain runs in one order only; a step after a later one raises."""

from __future__ import annotations

import pytest
from torch import nn

from kempnerforge.parallel.order import CHAIN, TransformOrderError, applied_steps, record_step


def test_in_order_steps_are_recorded():
    m = nn.Linear(2, 2)
    for step in ("tp", "float8", "activation_checkpoint", "fsdp"):
        record_step(m, step)
    assert applied_steps(m) == ["tp", "float8", "activation_checkpoint", "fsdp"]


def test_the_whole_chain_is_recorded_in_order():
    m = nn.Linear(2, 2)
    for step in CHAIN:
        record_step(m, step)
    assert applied_steps(m) == list(CHAIN) == ["tp", "ep", "float8", "activation_checkpoint", "compile", "fsdp"]


@pytest.mark.parametrize(
    ("later", "earlier"), [(b, a) for i, a in enumerate(CHAIN) for b in CHAIN[i + 1 :]], ids=lambda s: s
)
def test_every_step_after_a_later_one_raises(later, earlier):
    """Issue 19 check 4: with every step of the chain on, any step applied after one that must follow it raises."""
    m = nn.Linear(2, 2)
    record_step(m, later)
    with pytest.raises(TransformOrderError, match=f"Cannot apply '{earlier}' after '{later}'"):
        record_step(m, earlier)


def test_tp_after_fsdp_raises():
    m = nn.Linear(2, 2)
    record_step(m, "fsdp")
    with pytest.raises(TransformOrderError, match="Cannot apply 'tp' after 'fsdp'"):
        record_step(m, "tp")


def test_twice_raises_and_unknown_step_raises():
    m = nn.Linear(2, 2)
    record_step(m, "tp")
    with pytest.raises(TransformOrderError, match="'tp' was already applied"):
        record_step(m, "tp")
    with pytest.raises(ValueError, match="Unknown transform step 'ddp'"):
        record_step(m, "ddp")


def test_apply_fsdp_twice_raises(gloo_world_1):
    from torch.distributed.device_mesh import init_device_mesh

    from kempnerforge.parallel.fsdp import apply_fsdp

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})
    mesh = init_device_mesh("cpu", (1,))
    apply_fsdp(model, mesh)
    with pytest.raises(TransformOrderError, match="'fsdp' was already applied"):
        apply_fsdp(model, mesh)
